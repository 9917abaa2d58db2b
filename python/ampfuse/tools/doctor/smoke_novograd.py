"""ampfuse doctor's smoke test of fused_novograd_ (the doctor runs every op's): one
loss-scaled first step on tiny fp32/bf16/fp16 params with fp32 masters against NovoGrad written
in float64 torch ops, then a skipped step. Returns None when the op is right, else what is
wrong."""

from __future__ import annotations

import torch

from ampfuse.tools.doctor.checks import check_masters, check_skipped

_SHAPES = [(5,), (3, 4), (7,)]
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_LR, _BETAS, _EPS, _DECAY, _SCALE = 0.1, (0.95, 0.98), 1e-8, 0.01, 4.0


def _reference_step(masters, grads):
    """One first NovoGrad step (t = 1) in float64, apex's arithmetic: the running norm starts at
    the grads' own L2 norm, and the moment takes the raw grad."""
    beta1, beta2 = _BETAS
    out = []
    for p, g in zip(masters, grads):
        p, g = p.double(), g.double() / _SCALE
        norm = float(g.norm())  # sqrt(beta2 * norm^2 + (1 - beta2) * norm^2) on the first step
        denom = norm / (1 - beta2) ** 0.5 + _EPS
        m = (1 - beta1) * g
        out.append(p - _LR * ((m / (1 - beta1)) / denom + _DECAY * p))
    return out


def smoke_novograd(ops, device):
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(s, generator=gen).to(d).to(device) for s, d in zip(_SHAPES, _DTYPES)]
    masters = [p.float() for p in params]
    grads = [(torch.randn(s, generator=gen) * 3 * _SCALE).to(d).to(device)
             for s, d in zip(_SHAPES, _DTYPES)]
    expected = _reference_step(masters, grads)
    exp_avgs = [torch.zeros_like(m) for m in masters]
    norm_avgs = [torch.zeros((), device=device) for _ in masters]
    step = torch.zeros((), device=device)
    scale = torch.full((1,), _SCALE, device=device)

    def fused_step(found_inf):
        ops.fused_novograd_(params, grads, exp_avgs, norm_avgs, masters, step, _LR, *_BETAS, _EPS,
                            _DECAY, True, True, False, 2, False, scale, found_inf)

    fused_step(torch.zeros(1, device=device))
    state = params + masters + exp_avgs + norm_avgs + [step]
    return (check_masters(params, masters, expected, "NovoGrad in float64")
            or check_skipped(fused_step, state, device))


SMOKE_TESTS = {"fused_novograd_": smoke_novograd}
