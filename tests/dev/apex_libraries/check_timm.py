"""Dev check: timm's apex code paths, unchanged, on ampfuse through the apex alias (CPU, bf16).

What timm itself does with apex, and what this script runs:

* ``timm.utils.cuda`` imports ``from apex import amp`` and sets ``has_apex``; ``ApexScaler``
  runs ``amp.scale_loss`` / ``amp.master_params`` (clipping) / ``optimizer.step()`` and saves
  ``amp.state_dict()`` under its ``state_dict_key``. timm's train.py drives it after
  ``amp.initialize(model, optimizer, opt_level="O1")``; here O1 and O2, with gradient
  accumulation (``need_update=False``) and clipping.
* ``timm.optim.create_optimizer_v2(model, "fusedadamw" | "fusedadam" | "fusedsgd" |
  "fusedlamb" | "fusednovograd")`` imports ``apex.optimizers.FusedAdam`` / ``FusedSGD`` /
  ``FusedLAMB`` / ``FusedNovoGrad`` by name and binds timm's defaults (for fusednovograd
  ``betas=(0.95, 0.98)``): the optimizer must be the alias's class, with the same param-group
  hyperparameters as ampfuse's own optimizer built with those arguments.
* ``timm.optim.Lamb``, timm's own LAMB "similar in behaviour to APEX FusedLamb", is an
  independent implementation of the same algorithm: FusedLAMB must track it in fp32.
* ``timm.optim.NvNovoGrad`` (timm's ``novograd``) is not the algorithm timm's ``fusednovograd``
  runs. At their defaults they differ in three ways: (1) NvNovoGrad normalizes the grad by the
  layer's norm and adds the L2 decay *before* the first moment (m = b1 m + g / denom + wd p;
  p -= lr m, the NovoGrad paper's order), while apex's default (reg_inside_moment=False) puts
  the raw grad into the moment and divides afterwards (m = b1 m + (1 - b1) g;
  p -= lr (m / denom + wd p)); (2) NvNovoGrad has no bias correction, apex's default divides m
  by 1 - b1^t and the norm by sqrt(1 - b2^t); (3) NvNovoGrad defaults to grad_averaging=False
  (the grad enters m times 1), apex to True (times 1 - b1). So comparing ``novograd`` with
  ``fusednovograd`` as timm builds them would only measure those differences, and is not
  done. What is the same: NvNovoGrad keeps the blended *squared* norm
  (v = b2 v + (1 - b2) ||g||^2, seeded with the first step's ||g||^2) and divides by
  sqrt(v) + eps, apex keeps the norm itself (n = sqrt(b2 n^2 + (1 - b2) ||g||^2), seeded with
  the first step's ||g||) and divides by n + eps: n = sqrt(v) exactly, so eps sits in the same
  place. FusedNovoGrad with ``bias_correction=False, reg_inside_moment=True,
  grad_averaging=False`` (norm_type=2, init_zero=False) is therefore NvNovoGrad's algorithm up
  to float rounding (one sqrt per step, the order of the norm's sum), with one exception:
  NvNovoGrad seeds a layer's running norm whenever it is exactly 0
  (``if exp_avg_sq == 0: exp_avg_sq.copy_(norm)``), so a layer whose grads were all zero on the
  first step(s) is seeded at its first non-zero grad; apex (and ampfuse, which follows apex)
  seeds on the first step only, and blends such a layer from 0, so its norm is
  sqrt(1 - b2) ||g|| (||g|| / 7.07 with b2 = 0.98) at its first non-zero grad. timm's resnet10t
  zero-initializes the last batch norm of each residual block (zero_init_last=True), which
  makes the first step's grads of the blocks' earlier layers zero. So the fp32 comparison on
  the same grads is run on resnet10t with zero_init_last=False, where every layer has a grad
  from the first step and FusedNovoGrad must track NvNovoGrad; on the default resnet10t the
  check only confirms that the first-zero-grad layers differ by exactly that sqrt(1 - b2) after
  the second step and the other layers agree.
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
from _checks import Checks, hyperparameters
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


def fresh_model(**kwargs):
    torch.manual_seed(0)
    return timm.create_model("resnet10t", num_classes=CLASSES, **kwargs)


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
    if name == "fusednovograd":
        return ampfuse.optimizers.FusedNovoGrad(groups, lr=lr, betas=(0.95, 0.98))
    return ampfuse.optimizers.FusedAdam(groups, lr=lr, adam_w_mode=name == "fusedadamw")


def learning_rate(name):
    """NovoGrad's step is about lr per layer (the grad divided by the layer's grad norm), so it
    needs a larger lr than Adam to move resnet10t in 8 steps."""
    return {"fusedsgd": 0.05, "fusednovograd": 0.2}.get(name, 2e-3)


def train_with_timm(opt_level, name, steps=STEPS, state=None):
    """timm's train.py loop with --amp-impl apex: amp.initialize, ApexScaler, accumulation."""
    from apex import amp

    model = fresh_model()
    optimizer = timm_optimizer(model, name, lr=learning_rate(name))
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
    optimizer = direct_optimizer(model, name, lr=learning_rate(name))
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


def check_novograd_factory():
    """timm's fusednovograd entry, as create_optimizer_v2 builds it through the alias."""
    import apex.optimizers

    lr = learning_rate("fusednovograd")
    model = fresh_model()
    optimizer = timm_optimizer(model, "fusednovograd", lr)
    check(type(optimizer) is apex.optimizers.FusedNovoGrad
          and isinstance(optimizer, ampfuse.optimizers.FusedNovoGrad),
          "timm's fusednovograd is the alias's apex.optimizers.FusedNovoGrad (an "
          "ampfuse.optimizers.FusedNovoGrad)")
    groups = hyperparameters(optimizer)
    check([g["betas"] for g in groups] == [(0.95, 0.98)] * 2
          and [g["weight_decay"] for g in groups] == [0.0, 0.01]
          and all(g["lr"] == lr for g in groups),
          "fusednovograd has timm's betas (0.95, 0.98), its decay and no-decay groups and lr")
    check(groups == hyperparameters(direct_optimizer(fresh_model(), "fusednovograd", lr)),
          "fusednovograd's param-group hyperparameters equal ampfuse.optimizers.FusedNovoGrad's "
          "with the same arguments (apex's defaults for the rest)")


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


def novograd_pair(lr, **model_kwargs):
    """Two copies of one fp32 resnet10t: timm.optim.NvNovoGrad as timm's "novograd" builds it
    (timm's defaults and param groups) on one, FusedNovoGrad set to NvNovoGrad's algorithm (see
    the module docstring) with the same groups on the other."""
    timm_model, fused_model = fresh_model(**model_kwargs), fresh_model(**model_kwargs)
    nv = timm.optim.create_optimizer_v2(timm_model, "novograd", lr=lr, weight_decay=0.01)
    decay, no_decay = [], []
    for param in fused_model.parameters():
        (no_decay if param.ndim <= 1 else decay).append(param)
    fused = ampfuse.optimizers.FusedNovoGrad(
        [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.01}],
        lr=lr, betas=(0.95, 0.98), eps=1e-8, bias_correction=False, reg_inside_moment=True,
        grad_averaging=False)
    return timm_model, fused_model, nv, fused


def step_on_timm_grads(step, timm_model, fused_model, nv, fused):
    """One step of both optimizers on the grads of timm's copy (as in check_timm_lamb);
    returns the grads."""
    images, labels = batches(step)
    F.cross_entropy(timm_model(images), labels).backward()
    grads = [p.grad.clone() for p in timm_model.parameters()]
    for q, grad in zip(fused_model.parameters(), grads):
        q.grad = grad.clone()
    nv.step()
    fused.step()
    nv.zero_grad()
    fused.zero_grad()
    return grads


def check_timm_novograd(steps=STEPS):
    """timm.optim.NvNovoGrad against FusedNovoGrad in NvNovoGrad's configuration, in fp32 on
    the same grads, where the two are one algorithm (every layer has a grad from the first
    step), and the one documented difference where they are not."""
    lr = learning_rate("fusednovograd")
    timm_model, fused_model, nv, fused = novograd_pair(lr, zero_init_last=False)
    check(type(nv) is timm.optim.NvNovoGrad and nv.defaults["betas"] == (0.95, 0.98)
          and not nv.defaults["grad_averaging"] and not nv.defaults["decoupled_decay"],
          "timm's novograd is NvNovoGrad with betas (0.95, 0.98), no grad averaging, L2 decay "
          "inside the moment")
    worst = 0.0
    for step in range(steps):
        grads = step_on_timm_grads(step, timm_model, fused_model, nv, fused)
        if step == 0:
            zero_first = sum(not g.any() for g in grads)
        with torch.no_grad():
            worst = max(worst, max(float((q - p).abs().max() / p.abs().max().clamp(min=1e-12))
                                   for p, q in zip(timm_model.parameters(),
                                                   fused_model.parameters())))
    check(zero_first == 0 and worst < 1e-5,
          "FusedNovoGrad(bias_correction=False, reg_inside_moment=True, grad_averaging=False) "
          f"tracks timm.optim.NvNovoGrad over {steps} fp32 steps on the same grads, resnet10t "
          f"with zero_init_last=False (worst difference {worst:.1e} of a param's largest value)")

    # timm's default resnet10t: params without a grad on the first step are seeded differently.
    timm_model, fused_model, nv, fused = novograd_pair(lr)
    first = step_on_timm_grads(0, timm_model, fused_model, nv, fused)
    second = step_on_timm_grads(1, timm_model, fused_model, nv, fused)
    late = [not g0.any() and bool(g1.any()) for g0, g1 in zip(first, second)]
    ratios = [float(fused.state[q]["norm_avg"] / nv.state[p]["exp_avg_sq"].sqrt())
              for p, q in zip(timm_model.parameters(), fused_model.parameters())]
    expected = [(1 - 0.98) ** 0.5 if is_late else 1.0 for is_late in late]
    off = max(abs(r / e - 1) for r, e in zip(ratios, expected))
    check(sum(late) > 0 and off < 1e-5,
          f"default resnet10t (zero_init_last=True): the {sum(late)} of {len(late)} params whose "
          "first-step grads are all zero have FusedNovoGrad's running norm sqrt(1 - 0.98) times "
          "NvNovoGrad's after the second step (apex seeds on the first step only, NvNovoGrad "
          f"whenever its norm is 0); the other params' norms agree (worst ratio off by {off:.1e})")


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
    check_novograd_factory()
    check_timm_lamb()
    check_timm_novograd()
    for opt_level in ("O1", "O2"):
        for name in ("fusedadamw", "fusedadam", "fusedsgd", "fusedlamb", "fusednovograd"):
            check_training(opt_level, name)
        check_resume(opt_level, "fusedadamw")
    check_resume("O2", "fusednovograd")  # FusedNovoGrad's state (norms, step) under O2's masters
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
