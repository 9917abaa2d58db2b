"""Dev check: PyTorch-Ignite's apex and amp training steps, unchanged, on ampfuse (CPU).

Ignite's ``create_supervised_trainer`` (``ignite/engine/__init__.py``) has two mixed-precision
update functions that matter here:

* ``amp_mode="apex"`` (``supervised_training_step_apex``): ``from apex import amp`` at trainer
  creation, then per iteration ``zero_grad`` at the first micro-batch, the loss divided by
  ``gradient_accumulation_steps``, ``with amp.scale_loss(loss, optimizer)`` around backward, and
  ``optimizer.step()`` every ``gradient_accumulation_steps`` iterations. The model and optimizer
  must have gone through ``amp.initialize`` beforehand. Ignite's docs checkpoint ``amp`` itself
  next to the model and optimizer (``Checkpoint(to_save={..., "amp": amp})``), which needs
  ``apex.amp`` to have ``state_dict``/``load_state_dict``.
* ``amp_mode="amp"`` with ``scaler=`` a GradScaler instance (``supervised_training_step_amp``):
  ``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``, ``scaler.update()``. A torch
  user swaps in ``ampfuse.GradScaler`` there.

This script trains a small CNN with Ignite's own trainers and checks: the loss falls; the
losses and weights equal the same training written against ampfuse directly (apex path, O1 and
O2, with accumulation); a run resumed from Ignite's ``Checkpoint`` (model, optimizer, amp,
trainer) ends on the uninterrupted run's weights; an overflowing iteration is skipped (weights
unchanged, scale halved); and ``ampfuse.GradScaler`` gives torch's GradScaler's weights bit for
bit on the amp path.

Run it from the repository root with Ignite on the path (see README.md beside this file)::

    PYTHONPATH=/path/to/libs python tests/dev/apex_libraries/check_ignite.py
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.nn.functional as F
from _checks import Checks
from _task import quadrant_images, small_cnn

from ampfuse.apex_compat import install_apex_alias

install_apex_alias()  # Ignite imports apex when the apex trainer is created

import ampfuse  # noqa: E402
import ignite  # noqa: E402
from ampfuse import amp  # noqa: E402
from ignite.engine import Events, create_supervised_trainer  # noqa: E402
from ignite.handlers import Checkpoint, DiskSaver  # noqa: E402

EPOCHS = 3
BATCH = 16
SAMPLES = 256
ACCUMULATE = 2
DTYPE = torch.bfloat16  # CPU mixed precision
check = Checks("ignite")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = small_cnn()

    def forward(self, x):
        return self.body(x)


IMAGES, LABELS = quadrant_images(SAMPLES, seed=0, brightness=0.5)
BATCHES = [(IMAGES[s:s + BATCH], LABELS[s:s + BATCH]) for s in range(0, SAMPLES, BATCH)]


def loss_fn(y_pred, y):
    return F.cross_entropy(y_pred.float(), y)


def fresh(opt_level):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    return amp.initialize(model, optimizer, opt_level=opt_level, dtype=DTYPE,
                          loss_scale="dynamic", verbosity=0)


def weights(model):
    return [t.detach().clone() for t in model.state_dict().values()]


def params(model):
    """The trained weights only: batch norm's running statistics move in every forward, taken
    step or skipped."""
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def apex_trainer(model, optimizer, losses=None, loss=loss_fn):
    trainer = create_supervised_trainer(model, optimizer, loss, amp_mode="apex",
                                        gradient_accumulation_steps=ACCUMULATE)
    if losses is not None:
        trainer.add_event_handler(Events.ITERATION_COMPLETED,
                                  lambda engine: losses.append(engine.state.output))
    return trainer


def train_direct(opt_level, epochs):
    """Ignite's apex update written against ampfuse: same batches, accumulation and SGD."""
    model, optimizer = fresh(opt_level)
    losses, iteration = [], 0
    for _ in range(epochs):
        for x, y in BATCHES:
            iteration += 1
            if (iteration - 1) % ACCUMULATE == 0:
                optimizer.zero_grad()
            loss = loss_fn(model(x), y) / ACCUMULATE
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            if iteration % ACCUMULATE == 0:
                optimizer.step()
            losses.append((loss * ACCUMULATE).item())
    return losses, model


def check_apex_path(opt_level):
    model, optimizer = fresh(opt_level)
    losses = []
    apex_trainer(model, optimizer, losses).run(BATCHES, max_epochs=EPOCHS)
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    print(f"      {opt_level}: loss {first:.3f} -> {last:.3f} over {len(losses)} iterations")
    check(last < 0.5 * first, f"{opt_level}: the loss falls under Ignite's apex trainer")
    direct, direct_model = train_direct(opt_level, EPOCHS)
    check(losses == direct, f"{opt_level}: losses equal ampfuse used directly")
    full = weights(model)
    check(same(full, weights(direct_model)),
          f"{opt_level}: final weights identical to ampfuse used directly")

    # Ignite's Checkpoint of model, optimizer, amp and trainer after epoch 2, resumed the way
    # apex asks: amp.initialize on the fresh objects first, then load_state_dict for all.
    with tempfile.TemporaryDirectory() as directory:
        model, optimizer = fresh(opt_level)
        trainer = apex_trainer(model, optimizer)
        to_save = {"model": model, "optimizer": optimizer, "amp": amp, "trainer": trainer}
        handler = Checkpoint(to_save, DiskSaver(directory, require_empty=False), n_saved=None)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
        trainer.run(BATCHES, max_epochs=EPOCHS - 1)
        saved = torch.load(handler.last_checkpoint, weights_only=False)  # a Path in the dir
        check("amp" in saved and "loss_scaler0" in saved["amp"],
              f"{opt_level}: Ignite's checkpoint holds amp's state (loss scaler)")
        model, optimizer = fresh(opt_level)
        trainer = apex_trainer(model, optimizer)
        Checkpoint.load_objects(
            {"model": model, "optimizer": optimizer, "amp": amp, "trainer": trainer}, saved)
        trainer.run(BATCHES, max_epochs=EPOCHS)
        check(same(full, weights(model)),
              f"{opt_level}: resuming from Ignite's Checkpoint at epoch {EPOCHS - 1} ends on the "
              "uninterrupted run's weights")


def check_overflow():
    """An inf loss on one optimizer step's micro-batch: that step is skipped, the scale halves."""
    model, optimizer = fresh("O2")
    state = {}

    def poisoned_loss(y_pred, y):
        loss = loss_fn(y_pred, y)
        return loss * float("inf") if state.get("poison") else loss

    trainer = apex_trainer(model, optimizer, loss=poisoned_loss)

    @trainer.on(Events.ITERATION_STARTED)
    def poison(engine):
        state["poison"] = engine.state.iteration == 3  # the first micro-batch of step 2
        if engine.state.iteration == 3:
            state["weights"] = params(model)
            state["scale"] = amp.state_dict()["loss_scaler0"]["loss_scale"]

    @trainer.on(Events.ITERATION_COMPLETED)
    def after(engine):
        if engine.state.iteration == 4:  # step 2 taken (or skipped) here
            state["after"] = params(model)
            state["scale_after"] = amp.state_dict()["loss_scaler0"]["loss_scale"]

    trainer.run(BATCHES[:6], max_epochs=1)
    check(same(state["weights"], state["after"]),
          "O2: the step whose micro-batch overflowed is skipped (weights unchanged)")
    check(state["scale_after"] == state["scale"] / 2,
          f"O2: the overflow halves the loss scale ({state['scale']} -> {state['scale_after']})")
    check(all(torch.isfinite(t).all() for t in weights(model) if t.is_floating_point()),
          "O2: the weights stay finite after the overflow")


def check_amp_scaler():
    """Ignite's amp_mode="amp" update with a GradScaler instance: ampfuse's against torch's."""
    results = {}
    for name, scaler in (("torch", torch.amp.GradScaler("cpu")),
                         ("ampfuse", ampfuse.GradScaler("cpu"))):
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        trainer = create_supervised_trainer(model, optimizer, loss_fn, amp_mode="amp",
                                            scaler=scaler, gradient_accumulation_steps=ACCUMULATE)
        trainer.run(BATCHES, max_epochs=2)
        results[name] = (weights(model), scaler.get_scale())
    check(same(results["torch"][0], results["ampfuse"][0]),
          "amp_mode='amp': ampfuse.GradScaler gives torch's GradScaler's weights bit for bit")
    check(results["torch"][1] == results["ampfuse"][1],
          f"amp_mode='amp': the same scale afterwards ({results['ampfuse'][1]})")


def main():
    print(f"ignite {ignite.__version__}, torch {torch.__version__}, ampfuse {ampfuse.__version__}")
    import apex.amp

    check(apex.amp is amp, "Ignite's `from apex import amp` is ampfuse.amp")
    for opt_level in ("O1", "O2"):
        check_apex_path(opt_level)
    check_overflow()
    check_amp_scaler()
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
