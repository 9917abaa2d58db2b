"""ampfuse doctor's smoke test of fused_lamb_coded_ (the doctor runs every op's): one clipped,
loss-scaled step with int8-coded moments against its definition (decode the moments, one
fused_lamb_ step on them in fp32, code them again) on the same device, bit for bit, then a
skipped step. Returns None when the op is right, else what is wrong."""

from __future__ import annotations

import torch

from ampfuse.optimizers._state_codes import dequantize_moment, quantize_moment
from ampfuse.tools.doctor.checks import check_skipped

_SHAPES = [(300,), (16, 20)]
_LR, _BETAS, _EPS, _DECAY, _MAX_NORM, _SCALE = 0.1, (0.9, 0.999), 1e-6, 0.1, 1.0, 4.0


def smoke_lamb_coded(ops, device):
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(s, generator=gen).to(device) for s in _SHAPES]
    grads = [(torch.randn(s, generator=gen) * 3 * _SCALE).to(device) for s in _SHAPES]
    coded = {}
    for key, second in (("m", False), ("v", True)):
        pairs = [quantize_moment((torch.rand(s, generator=gen) * 1e-2).to(device), "int8", second)
                 for s in _SHAPES]
        coded[key] = ([c.view(s) for (c, _), s in zip(pairs, _SHAPES)], [s for _, s in pairs])
    decoded = {key: [dequantize_moment(c, s, "int8", key == "v").view(c.shape)
                     for c, s in zip(*coded[key])] for key in coded}
    ref_params, ref_grads = [p.clone() for p in params], [g.clone() for g in grads]
    step, ref_step = torch.zeros((), device=device), torch.zeros((), device=device)
    norm = ops.multi_tensor_l2norm(grads, False)[0]
    scale = torch.full((1,), _SCALE, device=device)

    def fused_step(found_inf):
        ops.fused_lamb_coded_(params, grads, *coded["m"], *coded["v"], [], step, _LR, *_BETAS,
                              _EPS, _DECAY, True, True, True, False, _MAX_NORM, norm, scale,
                              found_inf, True, state_dtype="int8")

    fused_step(torch.zeros(1, device=device))
    ops.fused_lamb_(ref_params, ref_grads, decoded["m"], decoded["v"], [], ref_step, _LR,
                    *_BETAS, _EPS, _DECAY, True, True, True, False, _MAX_NORM, norm, scale,
                    torch.zeros(1, device=device), True)
    for i, (p, r) in enumerate(zip(params, ref_params)):
        if not torch.equal(p, r):
            return f"param {i} differs from decode -> fused_lamb_ -> encode"
    for key, (codes, scales) in coded.items():
        for i, (c, s, m) in enumerate(zip(codes, scales, decoded[key])):
            expected_codes, expected_scales = quantize_moment(m, "int8", key == "v")
            if not (torch.equal(c.reshape(-1), expected_codes) and torch.equal(s, expected_scales)):
                return f"the codes of moment {key} of param {i} differ from the new moment coded"
    state = params + coded["m"][0] + coded["m"][1] + coded["v"][0] + coded["v"][1] + [step]
    return check_skipped(fused_step, state, device)


SMOKE_TESTS = {"fused_lamb_coded_": smoke_lamb_coded}
