"""NovoGrad as apex.optimizers.FusedNovoGrad computes it (its Python driver and its CUDA
kernels, read for their arithmetic), written in float64 torch ops: the reference the fused op
and FusedNovoGrad are checked against."""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class NovoGradConfig:
    lr: float = 1e-2
    beta1: float = 0.95
    beta2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.0
    bias_correction: bool = True
    grad_averaging: bool = True
    reg_inside_moment: bool = False
    norm_type: int = 2
    init_zero: bool = False


def reference_step(p, g, m, avg, t, c):
    """One NovoGrad step of one tensor in float64: p the param, g its unscaled grad, m its first
    moment, avg its running grad norm (ignored on a seeded first step), t the step number
    (1-based). Returns the new (p, m, avg)."""
    p, g, m = p.double(), g.double(), m.double()
    if c.norm_type == 0:
        norm = float(g.abs().max()) if g.numel() else 0.0
        old = norm if (t == 1 and not c.init_zero) else avg
        avg = c.beta2 * old + (1 - c.beta2) * norm
    else:
        squares = float(g.square().sum())
        old = math.sqrt(squares) if (t == 1 and not c.init_zero) else avg
        avg = math.sqrt(c.beta2 * old * old + (1 - c.beta2) * squares)
    bc1 = 1 - c.beta1 ** t if c.bias_correction else 1.0
    bc2 = math.sqrt(1 - c.beta2 ** t) if c.bias_correction else 1.0
    beta3 = 1 - c.beta1 if c.grad_averaging else 1.0
    denom = avg / bc2 + c.eps
    if c.reg_inside_moment:
        g = g / denom + c.weight_decay * p
        m = c.beta1 * m + beta3 * g
        p = p - c.lr * m / bc1
    else:
        m = c.beta1 * m + beta3 * g
        p = p - c.lr * ((m / bc1) / denom + c.weight_decay * p)
    return p, m, avg


class ReferenceNovoGrad:
    """reference_step over a list of tensors, keeping the state between steps."""

    def __init__(self, params, config):
        self.params = [p.detach().double().clone() for p in params]
        self.moments = [torch.zeros_like(p) for p in self.params]
        self.norms = [0.0] * len(self.params)
        self.config = config
        self.t = 0

    def step(self, grads, grad_scale=1.0):
        self.t += 1
        for i, g in enumerate(grads):
            self.params[i], self.moments[i], self.norms[i] = reference_step(
                self.params[i], g.double() / grad_scale, self.moments[i], self.norms[i], self.t,
                self.config)
