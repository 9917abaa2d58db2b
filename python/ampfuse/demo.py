"""A short mixed-precision training run built directly on ampfuse's ops and optimizers.

The model is kept in the low dtype (bf16 on CPU, fp16 on CUDA) and trained by
FusedAdamW with fp32 master weights. The step never reads a value back to the host:
one multi_tensor_l2norm of the scaled gradients yields the overflow flag
(a non-finite norm) and the clipping factor, and both fold into the optimizer's
grad_scale, so there is no separate unscale pass. update_scale_ adjusts the dynamic
loss scale on the device. The same model is also trained in plain fp32 with
torch.optim.AdamW for comparison. An overflow is injected at one step to show
that the step is skipped and the scale backs off.
"""

from __future__ import annotations

import time

import torch

import ampfuse


def _make_data(n: int, seed: int, device: torch.device):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=generator)
    teacher = torch.randn(32, 4, generator=generator)
    y = (x @ teacher + 0.1 * torch.randn(n, 4, generator=generator)).argmax(dim=1)
    return x.to(device), y.to(device)


def _make_model(seed: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 4)
    ).to(device)


def _batches(steps, x, y, batch=64):
    for step in range(steps):
        start = (step * batch) % len(x)
        yield step, x[start:start + batch], y[start:start + batch]


def _accuracy(model, x, y, dtype):
    with torch.no_grad():
        return (model(x.to(dtype)).float().argmax(dim=1) == y).float().mean().item()


def _train_fp32(steps, seed, device, x, y, lr):
    model = _make_model(seed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _, xb, yb in _batches(steps, x, y):
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return _accuracy(model, x, y, torch.float32)


def _train_mixed(steps, seed, device, x, y, lr, low, overflow_step, max_norm=5.0):
    model = _make_model(seed, device).to(low)
    params = list(model.parameters())
    optimizer = ampfuse.optimizers.FusedAdamW(params, lr=lr, weight_decay=0.0, master_weights=True)

    def scalar(value, dtype=torch.float32):
        return torch.full((1,), value, dtype=dtype, device=device)

    scale, growth, hysteresis = scalar(2.0**16), scalar(0, torch.int32), scalar(1, torch.int32)
    skipped = scalar(0.0)
    for step, xb, yb in _batches(steps, x, y):
        loss = torch.nn.functional.cross_entropy(model(xb.to(low)).float(), yb)
        if step == overflow_step:
            loss = loss * float("inf")  # what an fp16 overflow in the backward looks like
        optimizer.zero_grad(set_to_none=True)
        (loss * scale).backward()
        scaled_norm, _ = ampfuse.multi_tensor_l2norm([p.grad for p in params])
        found_inf = (~torch.isfinite(scaled_norm)).float().reshape(1)
        # Clipping to max_norm is one more factor in the scale the optimizer divides out.
        clip = torch.clamp(scaled_norm / scale / max_norm, min=1.0)
        optimizer.step(grad_scale=scale * clip, found_inf=found_inf)
        ampfuse.update_scale_(scale, growth, hysteresis, found_inf)
        skipped += found_inf
    return _accuracy(model, x, y, low), int(skipped.item()), scale.item()


def run_demo(steps: int = 300, device: str | None = None, seed: int = 0) -> int:
    device = torch.device(device or ("cuda" if ampfuse.cuda_available() else "cpu"))
    low = torch.float16 if device.type == "cuda" else torch.bfloat16
    x, y = _make_data(4096, seed, device)
    lr = 1e-2
    print(f"ampfuse demo: {steps} steps on {device}, low precision {low}; {ampfuse.cuda_status()}")

    _train_fp32(5, seed, device, x, y, lr)  # untimed: first calls pay one-off start-up costs
    start = time.perf_counter()
    fp32_accuracy = _train_fp32(steps, seed, device, x, y, lr)
    fp32_seconds = time.perf_counter() - start
    start = time.perf_counter()
    mixed_accuracy, skipped, final_scale = _train_mixed(
        steps, seed, device, x, y, lr, low, overflow_step=steps // 2
    )
    mixed_seconds = time.perf_counter() - start

    print(f"{'run':<24}{'accuracy':>10}{'seconds':>10}{'skipped':>10}{'final scale':>14}")
    print(f"{'fp32':<24}{fp32_accuracy:>10.3f}{fp32_seconds:>10.2f}{0:>10}{'-':>14}")
    print(f"{str(low).replace('torch.', '') + ' + fp32 masters':<24}{mixed_accuracy:>10.3f}"
          f"{mixed_seconds:>10.2f}{skipped:>10}{final_scale:>14g}")
    if skipped != 1:
        print(f"error: expected exactly the injected overflow to be skipped, got {skipped} skips")
        return 1
    return 0
