"""Dev check: timm's apex code paths, unchanged, on ampfuse through the apex alias (CPU, bf16).

What timm itself does with apex, and what this script runs:

* ``timm.utils.cuda`` imports ``from apex import amp`` and sets ``has_apex``; ``ApexScaler``
  runs ``amp.scale_loss`` / ``amp.master_params`` (clipping) / ``optimizer.step()`` and saves
  ``amp.state_dict()`` under its ``state_dict_key``. timm's train.py drives it after
  ``amp.initialize(model, optimizer, opt_level="O1")``; here O1 and O2, with gradient
  accumulation (``need_update=False``) and clipping.
* ``timm.optim.create_optimizer_v2(model, "fusedadamw" | "fusedadam" | "fusedsgd" |
  "fusedlamb")`` imports ``apex.optimizers.FusedAdam`` / ``FusedSGD`` / ``FusedLAMB`` by name
  and binds timm's defaults. ``fusednovograd`` must fail with the replacement named.
* ``timm.optim.Lamb``, timm's own LAMB "similar in behaviour to APEX FusedLamb", is an
  independent implementation of the same algorithm: FusedLAMB must track it in fp32.
* ``timm.layers.fast_norm`` imports ``apex.normalization.fused_layer_norm`` and uses
  ``fused_layer_norm_affine`` for LayerNorm when fast norm is on.

Each training run is repeated with ampfuse called directly (``ampfuse.amp`` and
``ampfuse.optimizers``, the same loop) and the losses must be identical; the loss must also
fall. A checkpoint taken through ``ApexScaler.state_dict()`` halfway must resume to the same
final weights as the uninterrupted run.

Run it from the repository root with timm on the path (see README.md beside this file)::

    PYTHONPATH=/path/to/libs python tests/dev/apex_libraries/check_timm.py
"""

from __future__ import annotations

import copy
import dataclasses
import sys

import torch
from _checks import Checks
from _task import CLASSES, quadrant_images
import torch.nn.functional as F

from ampfuse.apex_compat import install_apex_alias

install_apex_alias()  # before timm imports apex

import ampfuse  # noqa: E402
import timm  # noqa: E402
import timm.layers.fast_norm as fast_norm  # noqa: E402
import timm.optim  # noqa: E402
import timm.optim._optim_factory as _optim_factory  # noqa: E402
import timm.utils.cuda as timm_cuda  # noqa: E402

STEPS = 8
ACCUMULATE = 2
CLIP = 1.0
check = Checks("timm")


def batches(step, batch=16):
    """A learnable synthetic task: the class sets which quadrant of the image is bright."""
    return quadrant_images(batch, seed=1000 + step, brightness=1.0)


def fresh_model():
    torch.manual_seed(0)
    return timm.create_model("resnet10t", num_classes=CLASSES)


def timm_optimizer(model, name, lr):
    """timm's optimizer factory for `name`. timm asserts torch.cuda.is_available() before it
    imports an apex optimizer by name (timm/optim/_optim_factory.py, get_optimizer_class), so
    the entry is registered again under a new name with the class that timm's own importer
    resolves from "apex.optimizers.*"; defaults, param groups and kwargs stay timm's."""
    info = _optim_factory.default_registry.get_optimizer_info(name)
    cls = _optim_factory._import_class(info.opt_class)
    cpu_name = f"{name}cpu"  # timm reads "a_b" as a wrapper a around optimizer b
    if cpu_name not in _optim_factory.default_registry._optimizers:
        _optim_factory.default_registry.register(
            dataclasses.replace(info, name=cpu_name, opt_class=cls))
    return timm.optim.create_optimizer_v2(model, cpu_name, lr=lr, weight_decay=0.01)


def direct_optimizer(model, name, lr):
    """What timm builds for `name`, spelled with ampfuse's own optimizers."""
    decay, no_decay = [], []
    for param in model.parameters():
        (no_decay if param.ndim <= 1 else decay).append(param)
    groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.01}]
    if name == "fusedsgd":
        return ampfuse.optimizers.FusedSGD(groups, lr=lr, momentum=0.9, nesterov=True,
                                           set_grad_none=False)
    if name == "fusedlamb":
        return ampfuse.optimizers.FusedLAMB(groups, lr=lr)
    return ampfuse.optimizers.FusedAdam(groups, lr=lr, adam_w_mode=name == "fusedadamw")


def train_with_timm(opt_level, name, steps=STEPS, state=None):
    """timm's train.py loop with --amp-impl apex: amp.initialize, ApexScaler, accumulation."""
    from apex import amp

    model = fresh_model()
    optimizer = timm_optimizer(model, name, lr=0.05 if name == "fusedsgd" else 2e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    scaler = timm_cuda.ApexScaler()
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state[scaler.state_dict_key])
        start = state["step"]
    losses = []
    for step in range(start, steps):
        for micro in range(ACCUMULATE):
            images, labels = batches(step * ACCUMULATE + micro)
            loss = F.cross_entropy(model(images), labels) / ACCUMULATE
            scaler(loss, optimizer, clip_grad=CLIP, clip_mode="norm",
                   parameters=model.parameters(), need_update=micro == ACCUMULATE - 1)
            losses.append(loss.item() * ACCUMULATE)
        optimizer.zero_grad()
    checkpoint = {"model": copy.deepcopy(model.state_dict()),
                  "optimizer": copy.deepcopy(optimizer.state_dict()),
                  scaler.state_dict_key: scaler.state_dict(), "step": steps}
    return losses, model, checkpoint


def train_direct(opt_level, name, steps=STEPS):
    """The same training written against ampfuse without apex or timm's helpers."""
    model = fresh_model()
    optimizer = direct_optimizer(model, name, lr=0.05 if name == "fusedsgd" else 2e-3)
    model, optimizer = ampfuse.amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    losses = []
    for step in range(steps):
        for micro in range(ACCUMULATE):
            images, labels = batches(step * ACCUMULATE + micro)
            loss = F.cross_entropy(model(images), labels) / ACCUMULATE
            with ampfuse.amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            if micro == ACCUMULATE - 1:
                torch.nn.utils.clip_grad_norm_(ampfuse.amp.master_params(optimizer), CLIP)
                optimizer.step()
            losses.append(loss.item() * ACCUMULATE)
        optimizer.zero_grad()
    return losses, model


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values()))


def check_imports():
    check(timm_cuda.has_apex, "timm.utils.cuda.has_apex is True")
    check(timm_cuda.amp is ampfuse.amp, "timm's `amp` is ampfuse.amp")
    check("state_dict" in timm_cuda.amp.__dict__, "ApexScaler will save amp.state_dict()")
    check(fast_norm.has_apex and fast_norm.has_apex_rmsnorm,
          "timm.layers.fast_norm found apex's fused layer/RMS norm functions")


def check_fast_norm():
    x = torch.randn(4, 10, 64)
    weight, bias = torch.randn(64), torch.randn(64)
    reference = F.layer_norm(x, (64,), weight, bias, 1e-5)
    check(torch.allclose(fast_norm.fast_layer_norm(x, [64], weight, bias, 1e-5), reference,
                         atol=1e-5), "fast_layer_norm (apex path) matches F.layer_norm in fp32")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fast_norm.fast_layer_norm(x, [64], weight, bias, 1e-5)
    check(out.dtype == torch.bfloat16, "fast_layer_norm under autocast returns the autocast "
          "dtype, as apex's fused kernel does")
    rms = fast_norm.fast_rms_norm(x, [64], weight, 1e-5)
    check(torch.allclose(rms, F.rms_norm(x, (64,), weight, 1e-5), atol=1e-5),
          "fast_rms_norm (apex path) matches F.rms_norm")


def check_missing_optimizers():
    for name, replacement in (("fusednovograd", "timm.optim.NvNovoGrad"),):
        try:
            timm_optimizer(fresh_model(), name, 1e-3)
            message = ""
        except ImportError as error:
            message = str(error)
        check(replacement in message, f"timm's {name} fails to import and names {replacement}")


def check_timm_lamb(steps=STEPS):
    """timm.optim.Lamb and FusedLAMB on two copies of one fp32 model, with timm's defaults and
    param groups (no decay on 1-d params, so both trust-ratio branches run). Both step on the
    grads of timm's copy: fed their own, the copies' tiny rounding differences are amplified
    by Adam's normalized steps on near-zero grads, which would test the model, not the math."""
    timm_model, fused_model = fresh_model(), fresh_model()
    timm_lamb = timm.optim.create_optimizer_v2(timm_model, "lamb", lr=2e-3, weight_decay=0.01)
    fused_lamb = direct_optimizer(fused_model, "fusedlamb", lr=2e-3)
    worst = 0.0
    for step in range(steps):
        images, labels = batches(step)
        F.cross_entropy(timm_model(images), labels).backward()
        for p, q in zip(timm_model.parameters(), fused_model.parameters()):
            q.grad = p.grad.clone()
        timm_lamb.step()
        fused_lamb.step()
        timm_lamb.zero_grad()
        fused_lamb.zero_grad()
        with torch.no_grad():
            worst = max(worst, max(float((q - p).abs().max() / p.abs().max().clamp(min=1e-12))
                                   for p, q in zip(timm_model.parameters(),
                                                   fused_model.parameters())))
    check(worst < 1e-5, f"FusedLAMB tracks timm.optim.Lamb over {steps} fp32 steps on the same "
          f"grads (worst difference {worst:.1e} of a param's largest value)")


def check_training(opt_level, name):
    losses, model, _ = train_with_timm(opt_level, name)
    direct, direct_model = train_direct(opt_level, name)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4  # 2 steps each
    print(f"      {opt_level} {name}: loss {first:.3f} -> {last:.3f} over {STEPS} steps")
    check(last < first, f"{opt_level} {name}: the loss falls under timm's ApexScaler")
    check(losses == direct, f"{opt_level} {name}: losses identical to ampfuse used directly")
    check(same_weights(model, direct_model), f"{opt_level} {name}: final weights identical")


def check_resume(opt_level, name):
    _, full_model, _ = train_with_timm(opt_level, name)
    _, _, halfway = train_with_timm(opt_level, name, steps=STEPS // 2)
    _, resumed_model, _ = train_with_timm(opt_level, name, state=halfway)
    check(same_weights(full_model, resumed_model),
          f"{opt_level} {name}: resume from ApexScaler/optimizer/model checkpoints gives the "
          "uninterrupted run's weights")


def main():
    # Runs are compared bit for bit, so the convolutions must be deterministic: oneDNN's bf16
    # convolutions on the CPU are not (three identical torch-only runs of this model with
    # torch.autocast and torch.optim.AdamW in one process differ); torch's own kernels are.
    torch.backends.mkldnn.enabled = False
    torch.set_num_threads(1)
    print(f"timm {timm.__version__}, torch {torch.__version__}, ampfuse {ampfuse.__version__}")
    check_imports()
    check_fast_norm()
    check_missing_optimizers()
    check_timm_lamb()
    for opt_level in ("O1", "O2"):
        for name in ("fusedadamw", "fusedadam", "fusedsgd", "fusedlamb"):
            check_training(opt_level, name)
        check_resume(opt_level, "fusedadamw")
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
