"""One training run of the demo, shared by the single-process demo (digits.py) and its FSDP2
variant (sharded.py): the data, the model, the batches and the training loop.

Every run starts from the same weights, sees the same batches in the same order and uses the
same FusedAdamW hyperparameters; only the opt level (and for some runs the low dtype, the
optimizer's master_weights or the loss scale's growth interval) differs. The fp32 baseline goes
through amp too, at O0 (fp32, loss scale 1), so the training loop is literally the same code for
every row of the table.

Nothing in the training step reads a value back to the host: losses and loss scales are kept
on the device and read once at the end (the progress bar reads the loss every 50 steps).
"""

from __future__ import annotations

import math
import time

import torch

from ampfuse import amp
from ampfuse.optimizers import FusedAdamW

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# One set of hyperparameters for every run.
BATCH_SIZE = 64
LR = 3e-3
WEIGHT_DECAY = 1e-2
FINAL_LOSS_STEPS = 20  # the table's train loss is the mean over this many last steps
WARMUP_STEPS = 20  # untimed: the first steps pay one-off costs (allocations, kernel selection)
INJECTED_PARAM = "0.weight"  # the first convolution's weight: where --inject-overflow writes


def load_digits(device) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): 1437 training and 360 test images, stratified, always
    the same split; pixels standardized with the training set's mean and std."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=360, stratify=digits.target, random_state=0)
    x_train, x_test = (torch.tensor(x, dtype=torch.float32).unsqueeze(1) for x in (x_train, x_test))
    mean, std = x_train.mean(), x_train.std()
    tensors = ((x_train - mean) / std, torch.tensor(y_train), (x_test - mean) / std,
               torch.tensor(y_test))
    return tuple(t.to(device) for t in tensors)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),  # 8x8 -> 4x4
        torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 10),
    )


def batch_order(steps: int, n: int, seed: int, device) -> torch.Tensor:
    """steps x BATCH_SIZE indices: a fresh permutation every epoch, from the run's seed."""
    generator = torch.Generator().manual_seed(seed)
    epochs = math.ceil(steps * BATCH_SIZE / n)
    order = torch.cat([torch.randperm(n, generator=generator) for _ in range(epochs)])
    return order[: steps * BATCH_SIZE].view(steps, BATCH_SIZE).to(device)


def evaluate(model, x, y) -> tuple[float, float]:
    """(accuracy in %, mean cross-entropy) on (x, y), in eval mode."""
    model.eval()
    with torch.no_grad():
        logits = model(x).float()
    model.train()
    loss = torch.nn.functional.cross_entropy(logits, y)
    return 100.0 * (logits.argmax(dim=1) == y).float().mean().item(), loss.item()


def state_bytes(model, optimizer) -> int:
    """Bytes of params, grads and optimizer state (moments, fp32 masters, step counts) that
    this process holds: its own shards of sharded (DTensor) ones."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors
               if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _numel(model) -> int:
    """Elements of the model's params this process holds (its shards of sharded ones)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
               for p in model.parameters())


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_run(name: str, opt_level: str, data, *, steps: int, seed: int, device, dtype,
              inject_overflow: int | None = None, progress: bool = True,
              sharding=None, master_weights=None, growth_interval: int | None = None,
              state_dtype: str = "fp32") -> dict:
    """Trains one model at `opt_level` ("O0" is the fp32 baseline) and returns its results:
    name, opt_level, test accuracy (%) and loss, final loss (the mean training loss of the
    last FINAL_LOSS_STEPS steps), per-step losses and loss scales, ms per step after warm-up,
    memory (and bytes per param), skipped steps, the final loss scale and amp.last_overflow()
    at the injected step.

    sharding: None, or the FSDP2 set-up of a multi-process run (sharded.Sharding), which
    shards the model, gives this process its rows of each batch and averages the losses.
    master_weights: None (amp's choice), or FusedAdamW's master_weights for an O2 run in which
    amp makes no fp32 masters (True: the optimizer's own fp32 masters; the other values are the
    master-free bf16 modes). state_dtype: FusedAdamW's, how Adam's moments are stored.
    growth_interval: None (amp's, 2000 steps as in apex), or the clean steps after which a
    dynamic loss scale doubles: the fp16 run on the CPU shortens it so that its few steps show
    the scale growing as well as backing off."""
    from tqdm import tqdm

    device = torch.device(device)
    x_train, y_train, x_test, y_test = data
    model = make_model(seed).to(device)
    amp_options = {}
    if sharding is not None:
        model, amp_options = sharding.shard(model, opt_level, dtype)
    if master_weights is not None:
        amp_options["master_weights"] = False  # the optimizer's own mode, not amp's masters
    optimizer = FusedAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                           master_weights=False if master_weights is None else master_weights,
                           state_dtype=state_dtype)
    if growth_interval is not None:
        amp_options["growth_interval"] = growth_interval
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, dtype=dtype,
                                      verbosity=0, **amp_options)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    order = batch_order(steps, len(x_train), seed, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    losses, scaled_losses = [], []
    overflow = None
    warmup = min(WARMUP_STEPS, steps // 4)
    bar = tqdm(range(steps), desc=f"{name:<7}", unit="step", disable=None if progress else True,
               dynamic_ncols=True)
    for step in bar:
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        index = order[step] if sharding is None else sharding.rows(order[step])
        loss = torch.nn.functional.cross_entropy(model(x_train[index]), y_train[index])
        optimizer.zero_grad(set_to_none=True)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            if step == inject_overflow:
                grad = model.get_parameter(INJECTED_PARAM).grad
                if sharding is not None:
                    grad = sharding.overflowing_shard(grad)  # one rank's shard only
                if grad is not None:
                    grad.view(-1)[0] = float("inf")
        optimizer.step()
        if step == inject_overflow:
            overflow = amp.last_overflow(optimizer)  # a host read, at this step only
        scheduler.step()
        losses.append(loss.detach())
        scaled_losses.append(scaled_loss.detach())
        if step % 50 == 49:
            bar.set_postfix(loss=f"{loss.item():.4f}")
    _sync(device)
    ms_per_step = 1e3 * (time.perf_counter() - start) / max(steps - warmup, 1)
    bar.close()

    losses, scaled_losses = torch.stack(losses).float(), torch.stack(scaled_losses).float()
    # apex's contract: the scaled loss is loss * loss_scale. The scale is a power of two, so
    # the ratio recovers the scale each step's backward used exactly, without a host read.
    scales = (scaled_losses / losses).cpu()
    if sharding is not None:
        losses = sharding.mean_over_ranks(losses)  # the whole batch's loss
    losses = losses.cpu()
    accuracy, test_loss = evaluate(model, x_test, y_test)
    return {
        "name": name, "opt_level": opt_level,
        "dtype": torch.float32 if opt_level == "O0" else dtype,
        "accuracy": accuracy, "test_loss": test_loss,
        "final_loss": losses[-FINAL_LOSS_STEPS:].mean().item(), "losses": losses.tolist(),
        "loss_scales": scales.tolist(), "ms_per_step": ms_per_step, "warmup_steps": warmup,
        "peak_mib": (torch.cuda.max_memory_allocated(device) / 2**20
                     if device.type == "cuda" else None),
        "state_kib": state_bytes(model, optimizer) / 2**10,
        "bytes_per_param": state_bytes(model, optimizer) / _numel(model),
        "steps": steps,
        "skipped": amp.skipped_steps(optimizer),
        "injected_step": inject_overflow, "overflow": overflow,
        "final_scale": amp.state_dict(optimizer)["loss_scaler0"]["scale"],
    }


