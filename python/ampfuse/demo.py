"""A short mixed-precision training run built directly on ampfuse's ops.

The model is kept in the low dtype (bf16 on CPU, fp16 on CUDA) and trained
against fp32 master weights: the loss is scaled, gradients are unscaled into
fp32 master gradients with one fused multi_tensor_scale_, clipped with
multi_tensor_l2norm, the dynamic loss scale is updated on the device with
update_scale_, and the masters are copied back to the model with another fused
scale. The same model is also trained in plain fp32 for comparison. An
overflow is injected at one step to show that the step is skipped and the
scale backs off.
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


def _train_fp32(steps, seed, device, x, y, lr):
    model = _make_model(seed, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        batch = slice((step * 64) % len(x), (step * 64) % len(x) + 64)
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def _train_mixed(steps, seed, device, x, y, lr, low, overflow_step):
    model = _make_model(seed, device)
    masters = [p.detach().clone() for p in model.parameters()]  # fp32 master weights
    model.to(low)
    params = list(model.parameters())
    master_grads = [torch.zeros_like(m) for m in masters]
    optimizer = torch.optim.SGD(masters, lr=lr, momentum=0.9)
    for m, g in zip(masters, master_grads):
        m.grad = g

    def scalar(value, dtype=torch.float32):
        return torch.full((1,), value, dtype=dtype, device=device)

    scale, growth, hysteresis = scalar(2.0**16), scalar(0, torch.int32), scalar(1, torch.int32)
    found_inf, one = scalar(0.0), scalar(1.0)
    skipped = 0
    for step in range(steps):
        batch = slice((step * 64) % len(x), (step * 64) % len(x) + 64)
        logits = model(x[batch].to(low)).float()
        loss = torch.nn.functional.cross_entropy(logits, y[batch])
        if step == overflow_step:
            loss = loss * float("inf")  # what an fp16 overflow in the backward looks like
        model.zero_grad(set_to_none=True)
        (loss * scale).backward()
        found_inf.zero_()
        # Unscale the low-precision grads straight into the fp32 master grads.
        ampfuse.multi_tensor_scale_([p.grad for p in params], master_grads, 1.0 / scale, found_inf)
        total_norm, _ = ampfuse.multi_tensor_l2norm(master_grads)
        clip = torch.clamp(5.0 / (total_norm + 1e-6), max=1.0).reshape(1)
        ampfuse.multi_tensor_scale_(master_grads, master_grads, clip, torch.zeros_like(found_inf))
        ampfuse.update_scale_(scale, growth, hysteresis, found_inf)
        # The fused optimizers of ampfuse.optimizers skip on the device; torch.optim needs
        # the flag on the host.
        if found_inf.item():
            skipped += 1
            continue
        optimizer.step()
        ampfuse.multi_tensor_scale_(masters, params, one, torch.zeros_like(found_inf))
    with torch.no_grad():
        accuracy = (model(x.to(low)).float().argmax(dim=1) == y).float().mean().item()
    return accuracy, skipped, scale.item()


def run_demo(steps: int = 300, device: str | None = None, seed: int = 0) -> int:
    device = torch.device(device or ("cuda" if ampfuse.cuda_available() else "cpu"))
    low = torch.float16 if device.type == "cuda" else torch.bfloat16
    x, y = _make_data(4096, seed, device)
    lr = 0.05
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
