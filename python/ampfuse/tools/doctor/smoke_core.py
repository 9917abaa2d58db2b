"""ampfuse doctor's smoke tests of the scaler ops, fused_adam_ and fused_sgd_ (the other
optimizers' and FP8's are in their own smoke_* modules).

Each runs one op on a few tiny tensors and returns None when it agrees with torch, or what
differs. The point is to catch a broken build or kernel, not the last unit in the last place:
tolerances are a few units of each dtype.
"""

from __future__ import annotations

import math

import torch

from ampfuse.tools.doctor.checks import check_skipped

_TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 1e-4), torch.bfloat16: (1.6e-2, 1e-3)}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SHAPES = ((5,), (3, 4), (7,))


def _sample(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)


def _differs(what, actual, expected, dtype=None):
    actual = actual.detach().float().cpu()
    expected = expected.detach().float().cpu()
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    rtol, atol = _TOL[dtype or torch.float32]
    if torch.allclose(actual, expected, rtol=rtol, atol=atol):
        return None
    error = (actual - expected).abs().nan_to_num(math.inf).flatten()
    i = int(error.argmax())
    return (f"{what}: got {actual.flatten()[i].item():.7g}, torch gives "
            f"{expected.flatten()[i].item():.7g} (element {i})")


def _first(*results):
    return next((r for r in results if r), None)


def _smoke_unscale(ops, device):
    grads = [_sample(s, d, device, i) for i, (s, d) in enumerate(zip(_SHAPES, _DTYPES))]
    expected = [(g.float() * 0.25).to(g.dtype) for g in grads]
    found_inf = torch.zeros(1, device=device)
    ops.multi_tensor_unscale_(grads, found_inf, torch.full((1,), 0.25, device=device))
    wrong = _first(*(_differs(f"grads[{i}] ({g.dtype})", g, e, g.dtype)
                     for i, (g, e) in enumerate(zip(grads, expected))))
    if wrong or found_inf.item() != 0.0:
        return wrong or "found_inf was set for finite grads"
    grads[1][0, 2] = math.inf
    flags = torch.zeros(len(grads), dtype=torch.int32, device=device)
    ops.multi_tensor_unscale_(grads, found_inf, torch.full((1,), 0.25, device=device), flags)
    if found_inf.item() != 1.0:
        return "an inf in the grads did not set found_inf"
    return _wrong_tensor_flags(flags, 1, "inf")


def _wrong_tensor_flags(flags, index, kind):
    """None if `flags` names exactly tensor `index` as holding `kind` ("inf" or "nan"), else
    what is wrong. (Reached only once the op wrappers loaded.)"""
    from ampfuse.ops import HELD_INF, HELD_NAN

    expected = [{"inf": HELD_INF, "nan": HELD_NAN}[kind] if i == index else 0
                for i in range(flags.numel())]
    got = flags.tolist()
    return None if got == expected else f"tensor_flags were {got}, expected {expected}"


def _smoke_scale(ops, device):
    src = [_sample(s, torch.float32, device, i) for i, s in enumerate(_SHAPES)]
    dst = [torch.empty(s, dtype=d, device=device) for s, d in zip(_SHAPES, _DTYPES)]
    found_inf = torch.zeros(1, device=device)
    ops.multi_tensor_scale_(src, dst, torch.full((1,), 0.5, device=device), found_inf)
    wrong = _first(*(_differs(f"dst[{i}] ({d.dtype})", d, (s * 0.5).to(d.dtype), d.dtype)
                     for i, (s, d) in enumerate(zip(src, dst))))
    if wrong or found_inf.item() != 0.0:
        return wrong or "found_inf was set for finite sources"
    return None


def _smoke_l2norm(ops, device):
    tensors = [_sample(s, d, device, i) for i, (s, d) in enumerate(zip(_SHAPES, _DTYPES))]
    total, per_tensor = ops.multi_tensor_l2norm(tensors, per_tensor=True)
    expected = torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])
    return _first(_differs("global norm", total, torch.linalg.vector_norm(expected)),
                  _differs("per-tensor norms", per_tensor, expected))


def _smoke_nonfinite_check(ops, device):
    tensors = [_sample(s, d, device, i) for i, (s, d) in enumerate(zip(_SHAPES, _DTYPES))]
    found_inf = torch.zeros(1, device=device)
    ops.multi_tensor_nonfinite_check_(tensors, found_inf)
    if found_inf.item() != 0.0:
        return "found_inf was set for finite tensors"
    tensors[1][0, 2] = math.nan
    flags = torch.zeros(len(tensors), dtype=torch.int32, device=device)
    ops.multi_tensor_nonfinite_check_(tensors, found_inf, flags)
    if found_inf.item() != 1.0:
        return "a nan in the tensors did not set found_inf"
    return _wrong_tensor_flags(flags, 1, "nan")


def _smoke_update_scale(ops, device):
    def state():
        return (torch.full((1,), 1024.0, device=device), torch.zeros(1, dtype=torch.int32,
                                                                     device=device))

    scale, growth = state()
    torch_scale, torch_growth = state()
    hysteresis = torch.ones(1, dtype=torch.int32, device=device)
    for step, found in enumerate((0.0, 0.0, 1.0, 0.0, 0.0, 0.0)):
        found_inf = torch.full((1,), found, device=device)
        ops.update_scale_(scale, growth, hysteresis, found_inf, 2.0, 0.5, 2, 1, 0.0, math.inf)
        torch._amp_update_scale_(torch_scale, torch_growth, found_inf, 2.0, 0.5, 2)
        if scale.item() != torch_scale.item() or growth.item() != torch_growth.item():
            return (f"step {step}: scale {scale.item()}, growth tracker {growth.item()}; "
                    f"torch._amp_update_scale_ gives {torch_scale.item()}, {torch_growth.item()}")
    return None


def _optimizer_case(device):
    """fp32, bf16 and fp16 params with fp32 masters and grads scaled by 4, and the fp32 copies
    that torch's optimizer steps on."""
    params = [_sample(s, d, device, 10 + i) for i, (s, d) in enumerate(zip(_SHAPES, _DTYPES))]
    masters = [p.float() for p in params]
    reference = [torch.nn.Parameter(m.clone()) for m in masters]
    grads = [[_sample(s, torch.float32, device, 20 + 3 * k + i) for i, s in enumerate(_SHAPES)]
             for k in range(2)]
    return params, masters, reference, grads


def _check_step(params, masters, reference):
    for i, (p, m, r) in enumerate(zip(params, masters, reference)):
        wrong = _first(_differs(f"master {i}", m, r),
                       _differs(f"param {i} ({p.dtype})", p, r.detach().to(p.dtype), p.dtype))
        if wrong:
            return wrong
    return None


def _steps_like_torch(case, torch_optimizer, fused_step, state, device):
    """Two steps of fused_step(found_inf, k) on the case's params beside torch_optimizer on
    its fp32 reference (fed the same grads, rounded as the params' dtype rounds them), then
    the skip contract on everything the op writes (`state`: its own state tensors)."""
    params, masters, reference, grads = case
    for k in range(2):
        for i, (r, g) in enumerate(zip(reference, grads[k])):
            r.grad = (g * 4).to(params[i].dtype).float() / 4
        torch_optimizer.step()
        fused_step(torch.zeros(1, device=device), k)
        wrong = _check_step(params, masters, reference)
        if wrong:
            return f"after step {k + 1}: {wrong}"
    return check_skipped(lambda f: fused_step(f, 0), params + masters + state, device)


def _smoke_adam(ops, device):
    case = params, masters, reference, grads = _optimizer_case(device)
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    step = torch.zeros(1, device=device)
    # Adam is nearly blind to a grad scale that is not divided out, except through eps: a
    # large eps makes a forgotten or doubled unscale show.
    torch_adam = torch.optim.AdamW(reference, lr=0.1, eps=0.1, weight_decay=0.1, foreach=False)
    scale = torch.full((1,), 4.0, device=device)

    def fused_step(found_inf, k):
        ops.fused_adam_(params, [(g * 4).to(p.dtype) for g, p in zip(grads[k], params)],
                        exp_avgs, exp_avg_sqs, [], masters, step, 0.1, 0.9, 0.999, 0.1, 0.1,
                        adam_w_mode=True, grad_scale=scale, found_inf=found_inf)

    return _steps_like_torch(case, torch_adam, fused_step, exp_avgs + exp_avg_sqs + [step],
                             device)


def _smoke_sgd(ops, device):
    case = params, masters, reference, grads = _optimizer_case(device)
    buffers = [torch.zeros_like(m) for m in masters]
    step = torch.zeros(1, device=device)
    torch_sgd = torch.optim.SGD(reference, lr=1e-2, momentum=0.9, weight_decay=0.1, foreach=False)
    scale = torch.full((1,), 4.0, device=device)

    def fused_step(found_inf, k):
        ops.fused_sgd_(params, [(g * 4).to(p.dtype) for g, p in zip(grads[k], params)], buffers,
                       masters, step, 1e-2, momentum=0.9, weight_decay=0.1, grad_scale=scale,
                       found_inf=found_inf)

    return _steps_like_torch(case, torch_sgd, fused_step, buffers + [step], device)


SMOKE_TESTS = {
    "multi_tensor_unscale_": _smoke_unscale,
    "multi_tensor_scale_": _smoke_scale,
    "multi_tensor_l2norm": _smoke_l2norm,
    "multi_tensor_nonfinite_check_": _smoke_nonfinite_check,
    "update_scale_": _smoke_update_scale,
    "fused_adam_": _smoke_adam,
    "fused_sgd_": _smoke_sgd,
}
