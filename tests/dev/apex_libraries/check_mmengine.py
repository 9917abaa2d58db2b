"""Dev check: mmengine's ApexOptimWrapper, unchanged, on ampfuse through the apex alias (CPU).

mmengine (the training engine of the OpenMMLab projects) imports ``apex.amp`` in
``mmengine/optim/optimizer/apex_optimizer_wrapper.py`` and, through ``ApexOptimWrapper``:

* calls ``amp.initialize(model, optimizer, opt_level=..., loss_scale="dynamic", ...)`` inside
  ``optim_context`` at the first training step, once ``optimizer`` has no ``_amp_stash``;
* backpropagates every micro-batch through ``amp.scale_loss`` (gradient accumulation with
  ``accumulative_counts``, no ``delay_unscale``);
* checkpoints ``amp.state_dict()`` under the optimizer state's ``"apex_amp"`` key, and on resume
  keeps it until ``amp.initialize`` has run, then calls ``amp.load_state_dict``.

This script trains a small CNN with mmengine's own ``Runner`` and that wrapper at O1 and O2,
checks that the loss falls, that the losses equal the same training written against ampfuse
directly, and that resuming from the Runner's checkpoint of epoch 2 ends on the uninterrupted
run's weights.

Run it from the repository root with mmengine on the path (see README.md beside this file)::

    PYTHONPATH=/path/to/libs python tests/dev/apex_libraries/check_mmengine.py
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import tempfile

import torch
from _checks import Checks
from _task import quadrant_images, small_cnn
import torch.nn.functional as F

from ampfuse.apex_compat import install_apex_alias

install_apex_alias()  # before mmengine imports apex
# mmengine 0.10.7 resumes with a bare torch.load(), which torch >= 2.6 restricts to weights;
# its checkpoints also hold mmengine's log history. Unrelated to apex; this is torch's switch.
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")

import ampfuse  # noqa: E402
import mmengine  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.optim.optimizer import apex_optimizer_wrapper  # noqa: E402
from mmengine.runner import Runner  # noqa: E402

EPOCHS = 3
BATCH = 16
SAMPLES = 256
ACCUMULATE = 2
check = Checks("mmengine")


class Net(BaseModel):
    def __init__(self):
        super().__init__()
        self.body = small_cnn()

    def forward(self, inputs, labels, mode="loss"):
        logits = self.body(inputs)
        if mode == "loss":
            return {"loss": F.cross_entropy(logits.float(), labels)}
        return logits


class Quadrants(torch.utils.data.Dataset):
    """The class sets which quadrant of a noisy 16x16 image is bright."""

    def __init__(self):
        self.images, self.labels = quadrant_images(SAMPLES, seed=0, brightness=0.5)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        return {"inputs": self.images[index], "labels": self.labels[index]}


def fresh_net():
    torch.manual_seed(0)
    return Net()


# mmengine names a runner's visualizer and message hub (process-wide instances) after its
# experiment, by default the start time to the second: two runners started in the same second
# share them, and the second one logs into the first one's deleted work_dir.
_RUNNER_IDS = itertools.count()


def make_runner(work_dir, opt_level, epochs, resume_from=None):
    return Runner(
        model=fresh_net(),
        work_dir=work_dir,
        experiment_name=f"ampfuse-check-{next(_RUNNER_IDS)}",
        train_dataloader=dict(dataset=Quadrants(), batch_size=BATCH, num_workers=0,
                              sampler=dict(type="DefaultSampler", shuffle=False),
                              collate_fn=dict(type="default_collate")),
        train_cfg=dict(by_epoch=True, max_epochs=epochs),
        optim_wrapper=dict(type="ApexOptimWrapper", opt_level=opt_level, loss_scale="dynamic",
                           verbosity=0, accumulative_counts=ACCUMULATE,
                           optimizer=dict(type="SGD", lr=0.05, momentum=0.9)),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1),
                           logger=dict(type="LoggerHook", interval=1000)),
        load_from=resume_from, resume=resume_from is not None,
        randomness=dict(seed=0), log_level="WARNING",
    )


def train_direct(opt_level, epochs):
    """What the Runner does, written against ampfuse: same data order, accumulation and SGD."""
    model = fresh_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = ampfuse.amp.initialize(model, optimizer, opt_level=opt_level,
                                              loss_scale="dynamic", verbosity=0)
    data = Quadrants()
    losses = []
    for _ in range(epochs):
        for index, start in enumerate(range(0, SAMPLES, BATCH)):
            loss = model(data.images[start:start + BATCH], data.labels[start:start + BATCH])
            loss = loss["loss"]
            losses.append(loss.item())
            with ampfuse.amp.scale_loss(loss / ACCUMULATE, optimizer) as scaled:
                scaled.backward()
            if (index + 1) % ACCUMULATE == 0:
                optimizer.step()
                optimizer.zero_grad()
    return losses, model


def runner_losses(runner):
    values, _ = runner.message_hub.get_scalar("train/loss").data
    return [float(v) for v in values]


def weights(model):
    return [t.detach().clone() for t in model.state_dict().values()]


def check_training(opt_level):
    with tempfile.TemporaryDirectory() as work_dir:
        runner = make_runner(work_dir, opt_level, EPOCHS)
        runner.train()
        losses = runner_losses(runner)
        wrapper = runner.optim_wrapper
        check(hasattr(wrapper.optimizer, "_amp_stash"),
              f"{opt_level}: the wrapper saw amp.initialize run (optimizer._amp_stash)")
        first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
        print(f"      {opt_level}: loss {first:.3f} -> {last:.3f} over {len(losses)} iterations")
        check(last < 0.5 * first, f"{opt_level}: the loss falls under ApexOptimWrapper")
        direct, direct_model = train_direct(opt_level, EPOCHS)
        check(torch.allclose(torch.tensor(losses), torch.tensor(direct), rtol=0, atol=1e-6),
              f"{opt_level}: losses equal ampfuse used directly")
        full = weights(runner.model)
        check(all(torch.equal(a, b) for a, b in zip(full, weights(direct_model))),
              f"{opt_level}: final weights identical to ampfuse used directly")
        checkpoint = torch.load(f"{work_dir}/epoch_{EPOCHS - 1}.pth", weights_only=False)
        saved_amp = checkpoint["optimizer"].get("apex_amp")
        check(saved_amp is not None, f"{opt_level}: the checkpoint holds amp's state "
              "('apex_amp' in the optimizer state)")
    with tempfile.TemporaryDirectory() as work_dir:
        make_runner(work_dir, opt_level, EPOCHS - 1).train()
        resumed = make_runner(work_dir, opt_level, EPOCHS,
                              resume_from=f"{work_dir}/epoch_{EPOCHS - 1}.pth")
        resumed.train()
        check(all(torch.equal(a, b) for a, b in zip(full, weights(resumed.model))),
              f"{opt_level}: resuming the Runner at epoch {EPOCHS - 1} ends on the "
              "uninterrupted run's weights")


def main():
    logging.getLogger("mmengine").setLevel(logging.WARNING)
    print(f"mmengine {mmengine.__version__}, torch {torch.__version__}, "
          f"ampfuse {ampfuse.__version__}")
    check(apex_optimizer_wrapper.apex_amp is ampfuse.amp,
          "mmengine's apex_amp is ampfuse.amp (ApexOptimWrapper is usable)")
    for opt_level in ("O1", "O2"):
        check_training(opt_level)
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
