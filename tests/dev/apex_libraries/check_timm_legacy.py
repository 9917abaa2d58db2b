"""Dev check: the apex import line of timm < 1.0's optimizer factory, unchanged, on ampfuse's
apex alias (CPU, fp32).

timm before 1.0, and the many training repos that pin such a timm or keep a copy of its
``timm/optim/optim_factory.py`` (the DeiT / Swin / ConvNeXt / BEiT family), import apex's fused
optimizers in one statement::

    try:
        from apex.optimizers import FusedNovoGrad, FusedAdam, FusedLAMB, FusedSGD
        has_apex = True
    except ImportError:
        has_apex = False

at module level up to timm 0.6.x, inside ``create_optimizer_v2`` from 0.9 (then ``has_apex`` is
a local of the call). One missing name makes the whole statement fail, so while the alias had
no FusedNovoGrad, ``has_apex`` was False and every ``fused*`` optimizer was refused. This script
takes that ``try`` block from the installed timm's own source, runs it against the alias
(``has_apex`` must be True, the four names the alias's classes), checks the module's
``has_apex`` where timm keeps one, and then creates ``fusedadam``, ``fusedadamw``,
``fusedlamb``, ``fusedsgd`` and ``fusednovograd`` through ``timm.optim.create_optimizer_v2``
on a small CNN: each must be the alias's class, with the param-group hyperparameters of
ampfuse's own optimizer built with the arguments timm passes, and must give the same losses
and final weights, bit for bit, as that ampfuse optimizer used directly over a few fp32 steps
(and the loss must fall).

timm's factory also asserts ``has_apex and torch.cuda.is_available()`` before any ``fused*``
optimizer. On a machine without CUDA the script makes ``torch.cuda.is_available()`` answer
True for timm's factory module alone (its module-level name ``torch``, used there only in that
assert, is swapped for a stand-in during the call); ``has_apex`` is timm's own, so the assert
still fails if the apex import fails. ampfuse's optimizers run on the CPU; the real apex's
would not.

It runs with any timm from 0.4.12 to 0.9.x (tried: 0.4.12, 0.6.13, 0.9.16). Put that timm
first on the path, before the directory holding timm 1.0 and torchvision (see README.md)::

    PYTHONPATH=/tmp/apex-libs-timm09:/tmp/apex-libs \
        python tests/dev/apex_libraries/check_timm_legacy.py
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import textwrap

import torch
import torch.nn.functional as F
from _checks import Checks, hyperparameters
from _task import quadrant_images, small_cnn

from ampfuse.apex_compat import install_apex_alias

install_apex_alias()  # before timm imports apex

import ampfuse  # noqa: E402
import timm  # noqa: E402
import timm.optim  # noqa: E402
import timm.optim.optim_factory as optim_factory  # noqa: E402

IMPORT_LINE = "from apex.optimizers import FusedNovoGrad, FusedAdam, FusedLAMB, FusedSGD"
STEPS = 8
WEIGHT_DECAY = 0.01
# name -> (the apex class timm builds, lr). LAMB and NovoGrad step about lr per layer (a
# trust ratio, a grad divided by the layer's grad norm), so they take larger lrs to train the
# small CNN in 8 steps.
OPTIMIZERS = {
    "fusedadam": ("FusedAdam", 1e-2),
    "fusedadamw": ("FusedAdam", 1e-2),
    "fusedlamb": ("FusedLAMB", 0.05),
    "fusedsgd": ("FusedSGD", 0.05),
    "fusednovograd": ("FusedNovoGrad", 0.5),
}
check = Checks("timm legacy")


class _CudaAvailable:
    """torch.cuda, except that is_available() is True."""

    @staticmethod
    def is_available():
        return True

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchWithCuda:
    """torch, with _CudaAvailable for torch.cuda (for timm's factory assert only)."""

    cuda = _CudaAvailable()

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def cuda_reported_to_timm():
    saved = optim_factory.torch
    optim_factory.torch = _TorchWithCuda()
    try:
        yield
    finally:
        optim_factory.torch = saved


def apex_try_block():
    """The try/except around IMPORT_LINE in the installed timm's optim_factory, dedented, and
    the name of the function holding it (None at module level)."""
    lines = inspect.getsource(optim_factory).splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == IMPORT_LINE)
    start = max(i for i in range(at) if lines[i].strip() == "try:")
    end = next(i for i in range(at, len(lines)) if lines[i].strip() == "has_apex = False")
    owner = None
    if lines[at].startswith(" " * 8):
        owner = next(line.split("def ", 1)[1].split("(", 1)[0]
                     for line in reversed(lines[:at]) if line.startswith("def "))
    return textwrap.dedent("\n".join(lines[start:end + 1])), owner


def check_import_line():
    import apex.optimizers

    block, owner = apex_try_block()
    where = "module level" if owner is None else f"inside {owner}()"
    print(f"      timm {timm.__version__} optim_factory ({where}):")
    print(textwrap.indent(block, "        "))
    namespace = {}
    exec(compile(block, optim_factory.__file__, "exec"), namespace)  # timm's own lines
    check(namespace["has_apex"] is True, f"timm's apex try block ({where}) sets has_apex = True "
          "on the alias")
    check(all(name in namespace and namespace[name] is getattr(apex.optimizers, name, None)
              for name in ("FusedNovoGrad", "FusedAdam", "FusedLAMB", "FusedSGD")),
          "its four names are the alias's apex.optimizers classes")
    if owner is None:
        check(optim_factory.has_apex is True,
              "timm.optim.optim_factory.has_apex is True (the module imported it at load)")
    else:
        print(f"      (has_apex is a local of {owner}() in this timm; the factory's assert "
              "below checks it on every fused* call)")


def batches(step, batch=16):
    return quadrant_images(batch, seed=2000 + step, brightness=1.0)


def fresh_model():
    torch.manual_seed(0)
    return small_cnn()


def timm_groups(model):
    """timm's split: no decay for 1-d params and biases (all of them 1-d here)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim <= 1 or name.endswith(".bias") else decay).append(param)
    return [{"params": no_decay, "weight_decay": 0.0},
            {"params": decay, "weight_decay": WEIGHT_DECAY}]


def direct_optimizer(model, name, lr):
    """What timm < 1.0's create_optimizer_v2 builds for `name` (its param groups, the
    top-level weight_decay=0. it passes beside them, its per-name arguments), spelled with
    ampfuse's own optimizers."""
    groups = timm_groups(model)
    opt = ampfuse.optimizers
    if name in ("fusedadam", "fusedadamw"):
        return opt.FusedAdam(groups, lr=lr, weight_decay=0.0, adam_w_mode=name == "fusedadamw")
    if name == "fusedlamb":
        return opt.FusedLAMB(groups, lr=lr, weight_decay=0.0)
    if name == "fusedsgd":
        return opt.FusedSGD(groups, lr=lr, momentum=0.9, nesterov=True, weight_decay=0.0,
                            set_grad_none=False)
    return opt.FusedNovoGrad(groups, lr=lr, weight_decay=0.0, betas=(0.95, 0.98))


def timm_optimizer(model, name, lr):
    # Positional: timm 0.4 names these (model, optimizer_name, learning_rate, weight_decay),
    # 0.5+ (model_or_params, opt, lr, weight_decay).
    with cuda_reported_to_timm():
        return timm.optim.create_optimizer_v2(model, name, lr, WEIGHT_DECAY)


def train(model, optimizer):
    losses = []
    for step in range(STEPS):
        images, labels = batches(step)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def check_optimizer(name):
    import apex.optimizers

    class_name, lr = OPTIMIZERS[name]
    model, direct_model = fresh_model(), fresh_model()
    try:
        optimizer = timm_optimizer(model, name, lr)
    except (AssertionError, ImportError) as error:  # timm's "APEX and CUDA required" assert
        check(False, f"{name}: create_optimizer_v2 raised {type(error).__name__}: {error}")
        return
    direct = direct_optimizer(direct_model, name, lr)
    check(type(optimizer) is getattr(apex.optimizers, class_name)
          and isinstance(optimizer, getattr(ampfuse.optimizers, class_name)),
          f"{name}: create_optimizer_v2 gives the alias's apex.optimizers.{class_name}")
    check(hyperparameters(optimizer) == hyperparameters(direct),
          f"{name}: its param groups' hyperparameters equal ampfuse's {class_name} built with "
          "timm's arguments")
    losses, direct_losses = train(model, optimizer), train(direct_model, direct)
    print(f"      {name}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {STEPS} steps")
    check(sum(losses[-2:]) < sum(losses[:2]), f"{name}: the loss falls")
    check(losses == direct_losses and all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                          direct_model.state_dict().values())),
        f"{name}: losses and final weights identical to ampfuse.optimizers.{class_name} used "
        "directly")


def main():
    torch.backends.mkldnn.enabled = False  # torch's own, deterministic kernels (see check_timm)
    torch.set_num_threads(1)
    print(f"timm {timm.__version__} ({timm.__file__}), torch {torch.__version__}, "
          f"ampfuse {ampfuse.__version__}")
    if not timm.__version__.startswith("0."):
        print("this check is for timm < 1.0: put that timm first on PYTHONPATH (README.md)")
        return 2
    check_import_line()
    for name in OPTIMIZERS:
        check_optimizer(name)
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
