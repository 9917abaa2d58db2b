"""ampfuse.integrations.accelerate and .transformers with the real Accelerate and HF Trainer (CPU).

A step that a fused optimizer skips on the device (an inf planted in one gradient, bf16 autocast,
no GradScaler) must read as skipped: `accelerator.optimizer_step_was_skipped` is True for it and
the LR scheduler, prepared by Accelerate or stepped by the HF Trainer, does not advance.
"""

import tempfile
import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from ampfuse.integrations.accelerate import (  # noqa: E402
    SkipAwareAcceleratedOptimizer,
    track_skipped_steps,
    untrack_skipped_steps,
)
from ampfuse.optimizers import FusedAdamW  # noqa: E402

STEPS = 4
BATCH = 4
PLANTED = 1  # the step whose gradient gets an inf
LR = 1e-2


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; its own test case resets them after each test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class TinyRegressor(torch.nn.Module):
    """A model the HF Trainer accepts: keyword inputs in, a dict with the loss out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))
        self.autocast_seen = []  # (autocast enabled, matmul output dtype) per forward

    def forward(self, x, y):
        out = self.net(x)
        self.autocast_seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return {"loss": torch.nn.functional.mse_loss(out.float(), y)}


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return STEPS * BATCH

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=gen), "y": torch.randn(1, generator=gen)}


def plant_inf(model):
    model.net[0].weight.grad[0, 0] = float("inf")


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_only_planted_step_skipped(snapshots, skipped_flags):
    assert skipped_flags == [step == PLANTED for step in range(STEPS)]
    for step in range(STEPS):
        before, after = snapshots[step], snapshots[step + 1]
        assert all(torch.isfinite(p).all() for p in after), f"step {step} left a non-finite param"
        unchanged = all(torch.equal(p, q) for p, q in zip(before, after))
        assert unchanged == (step == PLANTED), f"step {step}: unchanged={unchanged}"


def test_accelerate_scheduler_holds_on_a_skipped_fused_step():
    """The recipe: prepare, then track_skipped_steps(optimizer). The planted step reads as
    skipped and the prepared scheduler holds; every other step advances it."""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model = TinyRegressor()
    optimizer = FusedAdamW(model.parameters(), lr=LR, skip_nonfinite=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = torch.utils.data.DataLoader(Pairs(), batch_size=BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    track_skipped_steps(optimizer)

    snapshots, skipped, lrs = [snapshot(model)], [], []
    for step, batch in enumerate(loader):
        optimizer.zero_grad()
        accelerator.backward(model(**batch)["loss"])
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        if step == PLANTED:
            plant_inf(model)
        optimizer.step()
        scheduler.step()
        snapshots.append(snapshot(model))
        skipped.append(accelerator.optimizer_step_was_skipped)
        lrs.append(scheduler.get_last_lr()[0])
    assert_only_planted_step_skipped(snapshots, skipped)
    assert lrs == [LR * 0.5, LR * 0.5, LR * 0.25, LR * 0.125]


def test_hf_trainer_scheduler_holds_on_a_skipped_fused_step():
    """The HF Trainer with AmpfuseTrainerCallback: the linear schedule does not advance on the
    skipped step, so after STEPS optimizer calls it has taken STEPS - 1 steps."""
    transformers = pytest.importorskip("transformers")
    from ampfuse.integrations.transformers import AmpfuseTrainerCallback

    class Recorder(transformers.TrainerCallback):
        def __init__(self, model):
            self.model = model
            self.snapshots, self.skipped, self.scheduler_steps = [snapshot(model)], [], []

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == PLANTED:
                plant_inf(self.model)  # after the Trainer clipped the grads

        def on_step_end(self, args, state, control, lr_scheduler=None, optimizer=None, **kw):
            self.snapshots.append(snapshot(self.model))
            self.skipped.append(optimizer.step_was_skipped)
            self.scheduler_steps.append(lr_scheduler.last_epoch)

    model = TinyRegressor()
    recorder = Recorder(model)
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=True, max_steps=STEPS,
        per_device_train_batch_size=BATCH, learning_rate=LR, lr_scheduler_type="linear",
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Pairs(),
        optimizers=(FusedAdamW(model.parameters(), lr=LR, skip_nonfinite=True), None),
        callbacks=[AmpfuseTrainerCallback(), recorder],
    )
    trainer.train()
    assert_only_planted_step_skipped(recorder.snapshots, recorder.skipped)
    assert recorder.scheduler_steps == [1, 1, 2, 3]
    # Training over, the prepared optimizer is Accelerate's own class again.
    assert type(trainer.optimizer) is AcceleratedOptimizer


def test_accelerate_gradscaler_path_sees_a_fused_skip():
    """Accelerate's fp16 path, which it takes on GPUs only, built here with a CPU GradScaler: the
    scaler calls the fused optimizer's step() even when the grads overflowed (the optimizer
    skips inside), so Accelerate's own verdict is "not skipped"."""
    accelerate.Accelerator(cpu=True)  # the process state AcceleratedOptimizer reads
    model = TinyRegressor()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    optimizer = AcceleratedOptimizer(FusedAdamW(model.parameters(), lr=LR), scaler=scaler)
    track_skipped_steps(optimizer)
    before = snapshot(model)
    scaler.scale(model(**Pairs()[0])["loss"]).backward()
    plant_inf(model)
    optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(before, snapshot(model)))
    assert optimizer.step_was_skipped is True


def test_track_skipped_steps_switches_the_prepared_object_and_back():
    """The Accelerator and the prepared scheduler hold the prepared optimizer, so tracking keeps
    the object and changes only its class; normal steps still read as not skipped."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = TinyRegressor()
    fused = FusedAdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(fused, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, fused, scheduler)
    assert track_skipped_steps(optimizer) is optimizer
    assert type(optimizer) is SkipAwareAcceleratedOptimizer and optimizer.optimizer is fused
    assert track_skipped_steps(optimizer) is optimizer  # twice is harmless
    model(**Pairs()[0])["loss"].backward()
    optimizer.step()
    scheduler.step()
    assert accelerator.optimizer_step_was_skipped is False
    assert scheduler.get_last_lr() == [LR * 0.5]
    assert untrack_skipped_steps(optimizer) is optimizer
    assert type(optimizer) is AcceleratedOptimizer


def test_track_skipped_steps_refuses_what_it_cannot_track():
    accelerator = accelerate.Accelerator(cpu=True)
    model = TinyRegressor()
    with pytest.raises(TypeError, match="prepare the optimizer first"):
        track_skipped_steps(FusedAdamW(model.parameters(), lr=LR))
    torch_adamw = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
    with pytest.raises(TypeError, match="wraps a AdamW, not an ampfuse fused optimizer"):
        track_skipped_steps(torch_adamw)
    assert type(torch_adamw) is AcceleratedOptimizer


def test_fp16_on_cpu_is_fp32_in_accelerate_and_the_hf_trainer():
    """What the docs say about CPU fp16: Accelerate (and so the HF Trainer) neither autocasts
    nor scales, silently; bf16 does autocast."""
    transformers = pytest.importorskip("transformers")
    for flag, autocast in (("fp16", (False, torch.float32)), ("bf16", (True, torch.bfloat16))):
        model = TinyRegressor()
        args = transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(), use_cpu=True, max_steps=1, report_to=[],
            per_device_train_batch_size=BATCH, save_strategy="no", logging_strategy="no",
            disable_tqdm=True, **{flag: True},
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Pairs())
        trainer.train()
        assert trainer.accelerator.mixed_precision == flag
        assert trainer.accelerator.scaler is None
        assert model.autocast_seen[0] == autocast, flag
        AcceleratorState._reset_state(True)
