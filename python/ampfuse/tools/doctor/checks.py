"""Checks the doctor's optimizer smoke tests share (report.py and the smoke_*.py modules of
the optimizers added after it). Each returns None when the op is right, else what is wrong."""

from __future__ import annotations

import torch


def check_skipped(step_fn, tensors, device):
    """step_fn(found_inf) with found_inf set must leave every one of `tensors` as it was."""
    before = [t.clone() for t in tensors]
    step_fn(torch.ones(1, device=device))
    if not all(torch.equal(a, b) for a, b in zip(tensors, before)):
        return "a step with found_inf set changed params or state"
    return None


def check_masters(params, masters, expected, reference_name):
    """Each fp32 master close to its float64 (or torch) reference, each param its master
    rounded."""
    for i, (p, m, e) in enumerate(zip(params, masters, expected)):
        if not torch.allclose(m.double().cpu(), e.double().cpu(), rtol=1e-5, atol=1e-6):
            return (f"master {i}: {m.flatten()[:3].tolist()} where {reference_name} gives "
                    f"{e.flatten()[:3].tolist()}")
        if not torch.equal(p, m.to(p.dtype)):
            return f"param {i} ({p.dtype}) is not its master rounded"
    return None
