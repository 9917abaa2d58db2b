"""ampfuse doctor's smoke test of fused_adagrad_ (the doctor runs every op's): two
loss-scaled steps with weight decay and lr_decay on tiny fp32/bf16/fp16 params with fp32 masters
against torch.optim.Adagrad on the same fp32 values, then a skipped step. Returns None when the
op is right, else what is wrong."""

from __future__ import annotations

import torch

from ampfuse.tools.doctor.checks import check_masters, check_skipped

_SHAPES = [(5,), (3, 4), (7,)]
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_LR, _LR_DECAY, _DECAY, _EPS, _SCALE = 0.1, 0.05, 0.1, 1e-10, 4.0


def smoke_adagrad(ops, device):
    gen = torch.Generator().manual_seed(11)
    params = [torch.randn(s, generator=gen).to(d).to(device) for s, d in zip(_SHAPES, _DTYPES)]
    masters = [p.float() for p in params]
    reference = [torch.nn.Parameter(m.clone()) for m in masters]
    torch_adagrad = torch.optim.Adagrad(reference, lr=_LR, lr_decay=_LR_DECAY,
                                        weight_decay=_DECAY, eps=_EPS, foreach=False)
    sums = [torch.zeros_like(m) for m in masters]
    step = torch.zeros((), device=device)
    scale = torch.full((1,), _SCALE, device=device)

    def fused_step(grads, found_inf):
        ops.fused_adagrad_(params, grads, sums, masters, step, _LR, _LR_DECAY, _DECAY, _EPS,
                           grad_scale=scale, found_inf=found_inf)

    for k in range(2):
        grads = [(torch.randn(s, generator=gen) * _SCALE).to(d).to(device)
                 for s, d in zip(_SHAPES, _DTYPES)]
        for r, g in zip(reference, grads):
            r.grad = g.float() / _SCALE
        torch_adagrad.step()
        fused_step(grads, torch.zeros(1, device=device))
        wrong = check_masters(params, masters, [r.detach() for r in reference],
                              "torch.optim.Adagrad")
        if wrong:
            return f"after step {k + 1}: {wrong}"
    return check_skipped(lambda found_inf: fused_step(grads, found_inf),
                         params + masters + sums + [step], device)


SMOKE_TESTS = {"fused_adagrad_": smoke_adagrad}
