"""ampfuse doctor's smoke test of fused_lamb_ (the doctor runs every op's): one clipped,
loss-scaled step on tiny fp32/bf16/fp16 params with fp32 masters against LAMB written in
float64 torch ops, then a skipped step. Returns None when the op is right, else what is
wrong."""

from __future__ import annotations

import torch

from ampfuse.tools.doctor.checks import check_masters, check_skipped

_SHAPES = [(5,), (3, 4), (7,)]
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_LR, _BETAS, _EPS, _DECAY, _MAX_NORM, _SCALE = 0.1, (0.9, 0.999), 1e-6, 0.1, 1.0, 4.0


def _reference_step(masters, grads):
    """One first LAMB step (t = 1) in float64, apex's arithmetic (AdamW mode, clipping)."""
    grads = [g.double() / _SCALE for g in grads]
    norm = float(torch.sqrt(sum(g.square().sum() for g in grads)))
    clip = max(norm / _MAX_NORM, 1.0)
    beta1, beta2 = _BETAS
    out = []
    for p, g in zip(masters, grads):
        p = p.double()
        g = g / clip
        m, v = (1 - beta1) * g, (1 - beta2) * g * g
        update = (m / (1 - beta1)) / ((v / (1 - beta2)).sqrt() + _EPS) + _DECAY * p
        ratio = _LR * float(p.norm()) / float(update.norm())
        out.append(p - ratio * update)
    return out


def smoke_lamb(ops, device):
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(s, generator=gen).to(d).to(device) for s, d in zip(_SHAPES, _DTYPES)]
    masters = [p.float() for p in params]
    grads = [(torch.randn(s, generator=gen) * 3 * _SCALE).to(d).to(device)
             for s, d in zip(_SHAPES, _DTYPES)]
    expected = _reference_step(masters, grads)
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    step = torch.zeros((), device=device)
    norm = ops.multi_tensor_l2norm(grads, False)[0]
    scale = torch.full((1,), _SCALE, device=device)

    def fused_step(found_inf):
        ops.fused_lamb_(params, grads, exp_avgs, exp_avg_sqs, masters, step, _LR, *_BETAS, _EPS,
                        _DECAY, True, True, True, False, _MAX_NORM, norm, scale, found_inf)

    fused_step(torch.zeros(1, device=device))
    state = params + masters + exp_avgs + exp_avg_sqs + [step]
    return (check_masters(params, masters, expected, "LAMB in float64")
            or check_skipped(fused_step, state, device))


SMOKE_TESTS = {"fused_lamb_": smoke_lamb}
