"""Lets code that imports apex run on ampfuse without editing it.

Training libraries import apex in their own files (``from apex import amp``,
``apex.optimizers.FusedAdam``, ``apex.parallel.DistributedDataParallel``), so their users cannot
"change one import". Two opt-in switches make ``apex`` resolve to ampfuse:

* In one process: call ``ampfuse.apex_compat.install_apex_alias()`` before the library imports
  apex. The names ``apex``, ``apex.amp`` (ampfuse.amp itself), ``apex.amp._amp_state``,
  ``apex.optimizers``, ``apex.parallel`` (with ``LARC`` and ``distributed``),
  ``apex.normalization`` and ``apex.normalization.fused_layer_norm``, among others (_MODULES),
  are entered in ``sys.modules``; other ``apex.*`` modules fail to import with a message that
  names the replacement.
* For the whole environment, including libraries that look for apex's package metadata or run
  in worker processes: ``python -m ampfuse.apex_compat install`` (see ``metadata.py``).

Neither ever hides a real apex by surprise: both refuse while another ``apex`` is importable,
unless the caller says so explicitly (``replace_real_apex=True``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["install_apex_alias", "uninstall_apex_alias", "apex_alias_installed", "real_apex"]

# The first line of the stub package that `python -m ampfuse.apex_compat install` writes: it tells
# our own stub apart from a real apex found on sys.path.
STUB_MARKER = "# ampfuse apex alias stub"
# apex.__version__ and the version of the apex distribution that the install command writes:
# "0.0.0" so that no version check mistakes it for a real apex release, "+ampfuse" to say whose.
ALIAS_VERSION = "0.0.0+ampfuse"

# Public apex module name -> ampfuse module that stands in for it.
_MODULES = {
    "apex": "ampfuse.apex_compat.apex",
    "apex.amp": "ampfuse.amp",
    "apex.amp._amp_state": "ampfuse.apex_compat.apex.amp_state",
    "apex.optimizers": "ampfuse.apex_compat.apex.optimizers",
    # apex's optimizer submodules, which some code imports from (fairseq, DeepSpeed's old apex
    # path): all are the one alias module.
    **{f"apex.optimizers.{sub}": "ampfuse.apex_compat.apex.optimizers"
       for sub in ("fused_adam", "fused_sgd", "fused_adagrad", "fused_lamb", "fused_novograd",
                   "fused_mixed_precision_lamb")},
    "apex.fp16_utils": "ampfuse.apex_compat.apex.fp16_utils",
    **{f"apex.fp16_utils.{sub}": "ampfuse.apex_compat.apex.fp16_utils"
       for sub in ("fp16util", "fp16_optimizer", "loss_scaler")},
    "apex.multi_tensor_apply": "ampfuse.apex_compat.apex.multi_tensor_apply",
    "apex.multi_tensor_apply.multi_tensor_apply": "ampfuse.apex_compat.apex.multi_tensor_apply",
    "apex.contrib": "ampfuse.apex_compat.apex.contrib",
    "apex.contrib.clip_grad": "ampfuse.apex_compat.apex.contrib.clip_grad",
    "apex.contrib.clip_grad.clip_grad": "ampfuse.apex_compat.apex.contrib.clip_grad",
    "apex.contrib.optimizers": "ampfuse.apex_compat.apex.contrib.optimizers",
    **{f"apex.contrib.optimizers.{sub}": "ampfuse.apex_compat.apex.contrib.optimizers"
       for sub in ("fp16_optimizer", "fused_adam", "fused_lamb", "fused_sgd")},
    "apex.parallel": "ampfuse.apex_compat.apex.parallel",
    "apex.parallel.LARC": "ampfuse.apex_compat.apex.parallel.LARC",
    # flat_dist_call, Reducer and the flatten helpers (NVIDIA's BERT scripts import them).
    "apex.parallel.distributed": "ampfuse.apex_compat.apex.parallel.distributed",
    # Where apex defined SyncBatchNorm (with and without its CUDA kernels).
    **{f"apex.parallel.{sub}": "ampfuse.apex_compat.apex.parallel"
       for sub in ("sync_batchnorm", "optimized_sync_batchnorm")},
    "apex.normalization": "ampfuse.apex_compat.apex.normalization",
    "apex.normalization.fused_layer_norm":
        "ampfuse.apex_compat.apex.normalization.fused_layer_norm",
}

# apex modules with no counterpart here, and what to use instead.
_REPLACEMENTS = {
    "apex.contrib.optimizers.distributed_fused_adam": "shard with FSDP2 "
    "(torch.distributed.fsdp.fully_shard) and step with ampfuse.optimizers.FusedAdam",
    "apex.contrib.optimizers.distributed_fused_lamb": "shard with FSDP2 "
    "(torch.distributed.fsdp.fully_shard) and step with ampfuse.optimizers.FusedLAMB",
    "apex.contrib.": "of apex.contrib only clip_grad and optimizers have an ampfuse version; "
    "apex.contrib's other kernels (fused attention, group norm, sparsity, ...) have none: use "
    "the real apex, or the torch modules they accelerate",
    "apex.transformer": "apex.transformer (Megatron tensor parallelism) has no ampfuse version; "
    "use torch.distributed.tensor.parallel or the real apex",
    "apex.parallel.multiproc": "start one process per GPU with torchrun "
    "(python -m torch.distributed.run)",
    "apex.mlp": "use torch.nn.Sequential of Linear layers",
    "apex.fused_dense": "use torch.nn.Linear (torch.compile fuses the bias and activation)",
    "apex.amp.": "ampfuse.amp has apex's public amp API (initialize, scale_loss, master_params, "
    "state_dict, register_*_function) but not apex's private amp submodules",
}


class ApexAliasError(RuntimeError):
    """The alias cannot be installed (or removed) as asked; nothing was changed."""


class _MissingApexModules(importlib.abc.MetaPathFinder):
    """Answers an import of an apex module that ampfuse does not provide with an error that says
    what to use instead, rather than Python's bare "No module named ...". It raises
    ModuleNotFoundError, an ImportError, so libraries that probe with try/except still fall
    back as they would without apex."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("apex.") or fullname in sys.modules:
            return None
        advice = next((hint for prefix, hint in _REPLACEMENTS.items()
                       if fullname == prefix.rstrip(".")
                       or fullname.startswith(prefix.rstrip(".") + ".")), None)
        if advice is None:
            advice = ("ampfuse provides apex.amp, apex.optimizers (all of apex's fused "
                      "optimizers), apex.fp16_utils, apex.multi_tensor_apply, apex.parallel, "
                      "apex.normalization, apex.contrib.clip_grad and apex.contrib.optimizers")
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: apex here is ampfuse's compatibility alias, which "
            f"does not provide it; {advice}.", name=fullname)


def _is_alias_module(module: object) -> bool:
    return getattr(module, "__name__", None) == _MODULES["apex"]


def apex_alias_installed() -> bool:
    """True when ``import apex`` in this process gives ampfuse's alias."""
    return _is_alias_module(sys.modules.get("apex"))


def _is_stub(origin: str | None) -> bool:
    """Whether the apex at `origin` is the stub package written by `python -m
    ampfuse.apex_compat install`, which only forwards to this alias."""
    if not origin or not origin.endswith("__init__.py"):
        return False
    try:
        with open(origin, encoding="utf-8") as stub:
            return stub.readline().rstrip("\n") == STUB_MARKER
    except OSError:
        return False


def real_apex() -> str | None:
    """Where an apex that is not ampfuse's lives, or None: a module already imported under the
    name apex, or a package that ``import apex`` would find. Nothing is imported."""
    module = sys.modules.get("apex")
    if module is not None:
        origin = getattr(module, "__file__", None)
        if _is_alias_module(module) or _is_stub(origin):
            return None
        return origin or repr(module)
    try:
        spec = importlib.util.find_spec("apex")
    except (ImportError, ValueError):
        return None
    if spec is None or _is_stub(spec.origin):
        return None
    if spec.origin and spec.origin != "namespace":
        return spec.origin
    locations = ", ".join(spec.submodule_search_locations or [])
    return f"a directory named apex without __init__.py at {locations}"


def install_apex_alias(*, replace_real_apex: bool = False) -> ModuleType:
    """Makes ``import apex`` give ampfuse's apex compatibility package in this process, and
    returns that package. Call it before the code that imports apex; calling it again changes
    nothing.

    Refuses (ApexAliasError, nothing changed) while another apex is importable, so a real apex
    install is never hidden by surprise; pass replace_real_apex=True to alias apex anyway (for
    this process only; the installed apex is left as it is). Even then it refuses once the
    other apex has been imported, since code holding its modules would mix the two.
    """
    if apex_alias_installed():
        return sys.modules["apex"]
    loaded = sys.modules.get("apex")
    if loaded is not None and not _is_stub(getattr(loaded, "__file__", None)):
        raise ApexAliasError(
            f"install_apex_alias: another apex is already imported ({real_apex()}); call "
            "install_apex_alias() before anything imports apex, or keep using that apex.")
    other = real_apex()
    if other is not None and not replace_real_apex:
        raise ApexAliasError(
            f"install_apex_alias: a real apex is installed ({other}); ampfuse will not hide it. "
            "Uninstall it, or pass install_apex_alias(replace_real_apex=True) to use ampfuse "
            "under the name apex in this process anyway.")
    modules = {name: importlib.import_module(target) for name, target in _MODULES.items()}
    # Stale entries from an apex that was imported and then dropped from sys.modules.
    for name in [n for n in sys.modules if n.startswith("apex.") and n not in modules]:
        del sys.modules[name]
    sys.modules.update(modules)
    if not any(isinstance(f, _MissingApexModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _MissingApexModules())
    return modules["apex"]


def uninstall_apex_alias() -> bool:
    """Undoes install_apex_alias in this process: ``import apex`` finds whatever is installed
    again. Returns False when the alias was not installed. Modules that already hold the alias
    (``from apex import amp``) keep it."""
    if not apex_alias_installed():
        return False
    for name in _MODULES:
        if sys.modules.get(name) is not None and sys.modules[name].__name__ == _MODULES[name]:
            del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _MissingApexModules)]
    return True
