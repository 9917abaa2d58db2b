"""ampfuse doctor's smoke tests of the FP8 ops (the doctor runs every op's): each calls the
op on tiny tensors and compares with torch. Each returns None when the op is right, else what
is wrong."""

from __future__ import annotations

import torch

from ampfuse.ops.fp8 import FP8_MAX

E4M3 = torch.float8_e4m3fn


def _sample(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)


def smoke_cast_amax(ops, device):
    for dtype, fp8 in ((torch.float32, E4M3), (torch.bfloat16, torch.float8_e5m2)):
        x = _sample((5, 7), dtype, device, 1)
        scale, amax = torch.full((1,), 40.0, device=device), torch.zeros(1, device=device)
        out = ops.fp8_cast_amax(x, scale, amax, fp8)
        limit = FP8_MAX[fp8]
        expected = (x.float() * scale).clamp(-limit, limit).to(fp8)
        if not torch.equal(out.view(torch.uint8), expected.view(torch.uint8)):
            return f"{dtype} -> {fp8}: the codes differ from torch's clamp and cast"
        if amax.item() != x.float().abs().max().item():
            return f"{dtype}: amax {amax.item()}, torch gives {x.float().abs().max().item()}"
    return None


def smoke_update_scales(ops, device):
    amaxes = [torch.full((1,), 3.0, device=device), torch.full((1,), 0.0, device=device)]
    histories = [torch.zeros(4, device=device), torch.zeros(2, device=device)]
    scales = [torch.ones(1, device=device), torch.full((1,), 8.0, device=device)]
    scale_invs = [torch.ones(1, device=device), torch.ones(1, device=device)]
    ops.fp8_update_scales_(amaxes, histories, scales, scale_invs, [448.0, 57344.0],
                                    1, "max")
    want = (torch.tensor(448.0) / 3.0) / 2.0
    if scales[0].item() != want.item() or scale_invs[0].item() != (1 / want).item():
        return f"scale {scales[0].item()}, expected {want.item()} (448 / 3 / 2**1)"
    if scales[1].item() != 8.0 or scale_invs[1].item() != 0.125:
        return "a zero amax changed the scale"
    if histories[0][0].item() != 3.0 or amaxes[0].item() != 0.0:
        return "the history did not take the step's amax, or the amax was not reset"
    return None


def smoke_gemm(ops, device):
    a = _sample((16, 32), torch.float32, device, 2).to(E4M3)
    b = _sample((48, 32), torch.float32, device, 3).to(E4M3)
    sa, sb = torch.full((1,), 0.5, device=device), torch.full((1,), 0.25, device=device)
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        try:
            ops.fp8_gemm(a, b, sa, sb)
        except RuntimeError as error:
            if "8.9" in str(error):
                return None  # refused by name, as designed: FP8 GEMMs need sm_89+
            raise
        return "an FP8 GEMM ran on a GPU below compute capability 8.9"
    out = ops.fp8_gemm(a, b, sa, sb, None, torch.float32).double().cpu()
    expected = (a.double() @ b.double().T).cpu() * 0.125
    # Hopper's FP8 tensor cores keep fewer bits than fp32 while they accumulate (about 14 are
    # reported), so the error is measured against the sum of |products|, not the result: a
    # wrong layout, scale or operand is off by the size of the terms themselves.
    magnitude = (a.double().abs() @ b.double().abs().T).cpu() * 0.125
    worst = ((out - expected).abs() / magnitude.clamp_min(1e-30)).max().item()
    if not worst <= 2.0**-11:
        return (f"the product differs from the float64 product of the fp8 values by up to "
                f"{worst:.2e} of the sum of |products| (allowed: {2.0**-11:.2e})")
    return None


def smoke_transpose(ops, device):
    x = _sample((33, 20), torch.float32, device, 4).to(E4M3)
    out = ops.fp8_transpose(x)
    expected = x.cpu().t().contiguous().view(torch.uint8)
    if out.shape != (20, 33) or not torch.equal(out.cpu().view(torch.uint8), expected):
        return "the codes differ from torch's transpose of the same tensor"
    return None


SMOKE_TESTS = {
    "fp8_cast_amax": smoke_cast_amax,
    "fp8_update_scales_": smoke_update_scales,
    "fp8_gemm": smoke_gemm,
    "fp8_transpose": smoke_transpose,
}


def _torch_codes(x, scale, fp8):
    limit = FP8_MAX[fp8]
    return (x.float() * scale).clamp(-limit, limit).to(fp8).view(torch.uint8)


def smoke_tensor_scale(ops, device):
    x = _sample((5, 7), torch.bfloat16, device, 5)
    amax, scale, scale_inv = ops.fp8_tensor_scale(x, E4M3, 1.0)
    want_amax = x.float().abs().max()
    want = (torch.tensor(448.0) / want_amax.cpu()) / 2.0
    if amax.item() != want_amax.item():
        return f"amax {amax.item()}, torch gives {want_amax.item()}"
    if scale.item() != want.item() or scale_inv.item() != (1 / want).item():
        return f"scale {scale.item()}, expected {want.item()} (448 / amax / 2**1)"
    return None


def smoke_cast_transpose(ops, device):
    x = _sample((9, 20), torch.float32, device, 6)
    scale, amax = torch.full((1,), 30.0, device=device), torch.zeros(1, device=device)
    out, out_t = ops.fp8_cast_transpose(x, scale, amax, E4M3)
    expected = _torch_codes(x, scale, E4M3)
    if not torch.equal(out.view(torch.uint8), expected):
        return "the codes differ from torch's clamp and cast"
    if not torch.equal(out_t.view(torch.uint8), expected.t().contiguous()):
        return "the transposed codes differ from torch's transpose of the codes"
    if amax.item() != x.abs().max().item():
        return f"amax {amax.item()}, torch gives {x.abs().max().item()}"
    return None


def smoke_cast_transpose_dbias(ops, device):
    x = _sample((9, 20), torch.float16, device, 7)
    scale, amax = torch.full((1,), 30.0, device=device), torch.zeros(1, device=device)
    out, out_t, dbias = ops.fp8_cast_transpose_dbias(x, scale, amax, torch.float8_e5m2)
    expected = _torch_codes(x, scale, torch.float8_e5m2)
    if not torch.equal(out.view(torch.uint8), expected) or not torch.equal(
            out_t.view(torch.uint8), expected.t().contiguous()):
        return "the codes differ from torch's clamp and cast"
    worst = (dbias.double() - x.double().sum(0)).abs().max().item()
    if not worst <= 1e-5:
        return f"dbias differs from the float64 column sums by {worst:.2e}"
    return None


def smoke_quantize_rowwise(ops, device):
    x = (_sample((6, 16), torch.float32, device, 8)
         * torch.logspace(-3, 3, 6, device=device)[:, None])
    for transpose in (False, True):
        rows = x.t() if transpose else x
        out, scale_inv = ops.fp8_quantize_rowwise(x, E4M3, transpose)
        scale = torch.tensor(448.0, device=device) / rows.abs().amax(1)
        if not torch.equal(out.view(torch.uint8), _torch_codes(rows, scale[:, None], E4M3)):
            return f"transpose={transpose}: the codes differ from torch's per-row cast"
        if not torch.equal(scale_inv, 1 / scale):
            return f"transpose={transpose}: scale_inv is not 1 / (448 / row amax)"
    return None


SMOKE_TESTS.update({
    "fp8_tensor_scale": smoke_tensor_scale,
    "fp8_cast_transpose": smoke_cast_transpose,
    "fp8_cast_transpose_dbias": smoke_cast_transpose_dbias,
    "fp8_quantize_rowwise": smoke_quantize_rowwise,
})
