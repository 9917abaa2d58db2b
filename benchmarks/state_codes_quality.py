"""Does AdamW with 8-bit block-wise moments train as well as with fp32 moments? (issue 33)

Rows per optimizer: torch.optim.AdamW; "unfused-<state>", a plain-torch AdamW whose moments
live as ampfuse.optimizers._state_codes codes between steps (per param: decode, torch's AdamW
math in fp32, encode; its fp32 row must equal torch's); "FusedAdamW-<state>", ampfuse's
FusedAdamW(state_dtype=...) with the codes decoded, updated and coded in its fused step. The
same seed, data and steps in every row of a workload, on the CPU:

- digits: the demo's CNN (ampfuse.tools.demo.training) on scikit-learn's digits, fp32; test
  accuracy;
- digits-bf16: the same CNN in bf16, FusedAdamW with master_weights True (fp32 masters) and
  "stochastic", state_dtype fp32/int8/fp8; test accuracy and bytes per param (params, grads and
  optimizer state, measured from the tensors);
- gpt: a 2-layer GPT-style decoder (benchmarks/train_workloads.GPT) as a byte-level language
  model of this repository's docs/*.md, fp32; final train loss (mean of the last 20 steps).

Usage: PYTHONPATH=python python benchmarks/state_codes_quality.py [--steps-digits N]
[--steps-gpt N]. It prints one row per state_dtype and workload, with the moments' bytes per
param measured from the optimizer's tensors.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from ampfuse.optimizers import FusedAdamW  # noqa: E402
from ampfuse.optimizers._state_codes import (  # noqa: E402
    dequantize_moment,
    keeps_fp32_moments,
    quantize_moment,
)
from ampfuse.tools.demo.training import BATCH_SIZE, batch_order, load_digits, make_model  # noqa: E402
from train_workloads import GPT  # noqa: E402

LR, WEIGHT_DECAY, BETAS, EPS = 3e-3, 1e-2, (0.9, 0.999), 1e-8


class CodedAdamW(torch.optim.Optimizer):
    """AdamW whose moments live as codes between steps (fp32 for tensors under a block)."""

    def __init__(self, params, state_dtype: str) -> None:
        super().__init__(params, {"lr": LR, "weight_decay": WEIGHT_DECAY})
        self.state_dtype = state_dtype

    def _moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            if not keeps_fp32_moments(p.numel()) and self.state_dtype != "fp32":
                self._encode(p, state["exp_avg"], state["exp_avg_sq"])
        if "exp_avg" in state:
            return state["exp_avg"], state["exp_avg_sq"]
        kind = self.state_dtype
        m = dequantize_moment(state["exp_avg_codes"], state["exp_avg_scales"], kind, False)
        v = dequantize_moment(state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], kind, True)
        return m.view_as(p), v.view_as(p)

    def _encode(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        state = self.state[p]
        state.pop("exp_avg", None)
        state.pop("exp_avg_sq", None)
        state["exp_avg_codes"], state["exp_avg_scales"] = quantize_moment(m, self.state_dtype,
                                                                          False)
        state["exp_avg_sq_codes"], state["exp_avg_sq_scales"] = quantize_moment(
            v, self.state_dtype, True)

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        b1, b2 = BETAS
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m, v = self._moments(p)
                state = self.state[p]
                state["step"] += 1
                t = state["step"]
                g = p.grad.float()
                # torch.optim.AdamW's single-tensor math, in its order.
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(EPS)
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))
                if "exp_avg" not in state:
                    self._encode(p, m, v)

    def moment_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor))


def make_optimizer(params, name: str) -> torch.optim.Optimizer:
    """"torch", "unfused-<state_dtype>" (CodedAdamW) or "FusedAdamW-<state_dtype>"."""
    if name == "torch":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, eps=EPS)
    kind, state_dtype = name.split("-")
    if kind == "unfused":
        return CodedAdamW(params, state_dtype)
    return FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, eps=EPS,
                      state_dtype=state_dtype)


def digits_run(state_dtype: str, steps: int) -> tuple[float, int, int]:
    x, y, x_test, y_test = load_digits(torch.device("cpu"))
    model = make_model(seed=0)
    optimizer = make_optimizer(model.parameters(), state_dtype)
    for idx in batch_order(steps, x.shape[0], seed=0, device="cpu"):
        loss = F.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = 100.0 * (model(x_test).argmax(1) == y_test).float().mean().item()
    return accuracy, _moment_bytes(optimizer), sum(p.numel() for p in model.parameters())


def digits_bf16_run(state_dtype: str, steps: int, master_weights) -> tuple[float, int, int]:
    x, y, x_test, y_test = load_digits(torch.device("cpu"))
    model = make_model(seed=0).to(torch.bfloat16)
    optimizer = FusedAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS,
                           eps=EPS, master_weights=master_weights, rounding_seed=0,
                           state_dtype=state_dtype.split("-")[1])
    for idx in batch_order(steps, x.shape[0], seed=0, device="cpu"):
        loss = F.cross_entropy(model(x[idx].to(torch.bfloat16)).float(), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    held = list(optimizer.state.values())
    model.eval()
    with torch.no_grad():
        logits = model(x_test.to(torch.bfloat16)).float()
        accuracy = 100.0 * (logits.argmax(1) == y_test).float().mean().item()
    # Params, grads and everything the optimizer holds between steps (moments as codes,
    # masters, step counts), measured from the tensors.
    tensors = [t for p in model.parameters() for t in (p, p.grad)]
    tensors += [t for state in held for t in state.values() if isinstance(t, torch.Tensor)]
    numel = sum(p.numel() for p in model.parameters())
    total = sum(t.numel() * t.element_size() for t in tensors)
    print(f"    bf16 model, master_weights={master_weights}, state {state_dtype}: params + grads "
          f"+ optimizer state = {total / numel:.3f} bytes per param")
    return accuracy, sum(_moment_bytes_of(state) for state in held), numel


def gpt_run(state_dtype: str, steps: int) -> tuple[float, int, int]:
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
    data = torch.tensor(list(text), dtype=torch.long)
    seq, batch = 64, 16
    torch.manual_seed(0)
    model = GPT(layers=2, d_model=128, heads=4, seq=seq, vocab=256)
    optimizer = make_optimizer(model.parameters(), state_dtype)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        window = torch.stack([data[s: s + seq + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    final = sum(losses[-20:]) / len(losses[-20:])
    return final, _moment_bytes(optimizer), sum(p.numel() for p in model.parameters())


_MOMENT_PREFIXES = ("exp_avg",)


def _moment_bytes_of(state: dict) -> int:
    """Bytes of one param's moment tensors (fp32 or codes and scales), not its step or master."""
    return sum(t.numel() * t.element_size() for k, t in state.items()
               if isinstance(t, torch.Tensor) and k.startswith(_MOMENT_PREFIXES))


def _moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(_moment_bytes_of(s) for s in optimizer.state.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-digits", type=int, default=400)
    parser.add_argument("--steps-gpt", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, 1 thread, batch {BATCH_SIZE} (digits)")
    print(f"{'workload':38} {'optimizer':17} {'metric':>22} {'moment B/param':>15} "
          f"{'time s':>7}")
    every = ("torch", *(f"{kind}-{state}" for kind in ("unfused", "FusedAdamW")
                        for state in ("fp32", "int8", "fp8")))
    fused = tuple(f"FusedAdamW-{state}" for state in ("fp32", "int8", "fp8"))
    rows = [("digits", digits_run, args.steps_digits, "test acc %", every)]
    for master in (True, "stochastic"):
        rows.append((f"digits-bf16 master_weights={master}",
                     lambda d, n, m=master: digits_bf16_run(d, n, m),
                     args.steps_digits, "test acc %", fused))
    rows.append(("gpt", gpt_run, args.steps_gpt, "final train loss", every))
    for name, run, steps, metric, state_dtypes in rows:
        for state_dtype in state_dtypes:
            start = time.perf_counter()
            value, moment_bytes, numel = run(state_dtype, steps)
            label = "torch.optim.AdamW" if state_dtype == "torch" else state_dtype
            print(f"{name:38} {label:17} {metric + ' ' + format(value, '.4f'):>22} "
                  f"{moment_bytes / numel:15.3f} {time.perf_counter() - start:7.1f}"
                  f"  ({steps} steps)")


if __name__ == "__main__":
    main()
