"""ampfuse doctor's smoke test of fused_adam_coded_ (the doctor runs every op's): two
loss-scaled steps with int8 and fp8 moment codes on fp32/bf16/fp16 params with fp32 masters,
each equal bit for bit to its reference (the codes decoded, fused_adam_ on fp32 moments, coded
again), then a skipped step. Returns None when the op is right, else what is wrong."""

from __future__ import annotations

import torch

from ampfuse.optimizers._state_codes import dequantize_moment, quantize_moment
from ampfuse.tools.doctor.checks import check_skipped

_SHAPES = [(300,), (2, 256)]
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_HYPER = (0.9, 0.999, 1e-8, 0.1)  # beta1, beta2, eps, weight decay
_SCALE = 4.0


def _case(kind, dtype, device, gen):
    params = [torch.randn(s, generator=gen).to(dtype).to(device) for s in _SHAPES]
    masters = [p.float() for p in params]
    codes = {}
    for key, second in (("exp_avg", False), ("exp_avg_sq", True)):
        pairs = [quantize_moment(torch.rand(p.numel(), generator=gen).to(device) * 1e-3, kind,
                                 second) for p in params]
        codes[key] = ([c.view(p.shape) for (c, _), p in zip(pairs, params)],
                      [s for _, s in pairs])
    return params, masters, codes


def _reference(params, grads, masters, codes, step, kind, scale):
    """The reference step on copies: (params, masters, codes) after it."""
    params, masters = [p.clone() for p in params], [m.clone() for m in masters]
    moments = [[dequantize_moment(c, s, kind, second).view(c.shape) for c, s in zip(*codes[key])]
               for key, second in (("exp_avg", False), ("exp_avg_sq", True))]
    torch.ops.ampfuse.fused_adam_(params, [g.clone() for g in grads], moments[0], moments[1], [],
                                  masters, step.clone(), torch.full_like(step, 0.1), *_HYPER,
                                  True, True, False, False, scale, None, False, "fp32", [], 0)
    return params, masters, [quantize_moment(m, kind, second)
                             for ms, second in zip(moments, (False, True)) for m in ms]


def _fused_step(ops, kind, params, masters, codes, step, scale, grads, found_inf):
    ops.fused_adam_coded_(params, grads, *codes["exp_avg"], *codes["exp_avg_sq"], [], [],
                          masters, step, 0.1, *_HYPER, grad_scale=scale, found_inf=found_inf,
                          state_dtype=kind)


def _same(got, want):
    """(params, masters, [(codes, scales)]) equal bit for bit."""
    tensors_equal = all(torch.equal(a, b) for a, b in zip(got[0] + got[1], want[0] + want[1]))
    return tensors_equal and all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)
        for (a, sa), (b, sb) in zip(got[2], want[2]))


def _smoke_one(ops, kind, dtype, device, gen):
    scale = torch.full((1,), _SCALE, device=device)
    params, masters, codes = _case(kind, dtype, device, gen)
    step = torch.zeros(1, device=device)
    grads: list[torch.Tensor] = []
    for k in range(2):
        grads = [(torch.randn(s, generator=gen) * _SCALE).to(dtype).to(device) for s in _SHAPES]
        want = _reference(params, grads, masters, codes, step, kind, scale)
        _fused_step(ops, kind, params, masters, codes, step, scale, grads,
                    torch.zeros(1, device=device))
        got = (params, masters, [(c.reshape(-1), s) for key in ("exp_avg", "exp_avg_sq")
                                 for c, s in zip(*codes[key])])
        if not _same(got, want):
            return (f"state_dtype={kind!r}, {dtype} params, step {k + 1}: differs from "
                    "dequantize -> fused_adam_ -> quantize")
    state = [t for key in ("exp_avg", "exp_avg_sq") for ts in codes[key] for t in ts]
    return check_skipped(
        lambda found_inf: _fused_step(ops, kind, params, masters, codes, step, scale, grads,
                                      found_inf),
        params + masters + state + [step], device)


def smoke_adam_coded(ops, device):
    gen = torch.Generator().manual_seed(13)
    for kind in ("int8", "fp8"):
        for dtype in _DTYPES:
            wrong = _smoke_one(ops, kind, dtype, device, gen)
            if wrong:
                return wrong
    return None


SMOKE_TESTS = {"fused_adam_coded_": smoke_adam_coded}
