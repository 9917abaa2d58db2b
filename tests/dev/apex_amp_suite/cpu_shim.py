"""A pytest plugin that runs apex's own amp tests (tests/L0/run_amp of NVIDIA/apex, from the
last commit that had apex.amp) against ampfuse's apex alias on a machine with no GPU.

Load it with ``-p cpu_shim`` (see README.md in this folder). It changes as little of the tests'
meaning as it can; every change is listed here.

Always ("strict" mode, SHIM_EXTENDED unset or 0):

 1. Device: the tests build everything on "cuda". Here
      - Tensor.cuda(...) and nn.Module.cuda(...) leave tensors on the CPU;
      - a TorchFunctionMode rewrites a `device` argument that names CUDA ("cuda", "cuda:0",
        torch.device("cuda")) to "cpu" in every torch function call (factory functions and
        Tensor.to('cuda'), which nn.Module.to('cuda') goes through);
      - torch.set_default_tensor_type(torch.cuda.X) sets torch.X (the CPU type) instead.
 2. Type names: the tests compare x.type() with 'torch.cuda.HalfTensor' and
    'torch.cuda.FloatTensor'. Tensor.type() with no argument returns the CUDA name for a CPU
    tensor; Tensor.type(arg) (a cast) maps a CUDA type argument to the CPU one. The dtype itself
    is untouched.
 3. Low-precision dtype: apex's amp is fp16-only; ampfuse picks fp16 on CUDA and bf16 on the
    CPU. amp.initialize(...) without `dtype=` gets dtype=torch.float16, the CUDA path's choice.
    SHIM_DTYPE=bf16 keeps ampfuse's CPU default instead (the type-name tests then fail by
    construction).
 4. The apex alias is installed (ampfuse.apex_compat.install_apex_alias()) before any test
    imports apex, and each test folder given on the command line goes on sys.path (the tests
    do `from utils import ...`).

Only with SHIM_EXTENDED=1 ("extended" mode), to get past APIs ampfuse leaves out on purpose and
reach the assertions behind them. These are stand-ins, not ampfuse behaviour:

 5. `import amp_C` succeeds (an empty module): test_fused_sgd.py and
    test_multiple_models_optimizers_losses.py import it only as a proxy for "apex was built
    with its CUDA extensions". The multi_tensor_* and update_scale_hysteresis tests import
    named kernels from it, which still fails, so they still skip.
 6. amp.init(...) (apex's pre-1.0 global-patching API, used by test_basic_casts,
    test_promotion and test_rnn; ampfuse's raises) is emulated with ampfuse's own O1
    machinery made active on this thread: torch.autocast('cpu', float16) and an O1 policy set
    built from the default O1 lists plus register_*_function registrations, what an O1 model's
    forward pre-hook does. Its handle's _deactivate() undoes it. `allow_banned` is ignored.
 7. amp._amp_state.handle: an object whose _deactivate() does nothing (ampfuse's O1 is scoped
    to each model's forward, so nothing global is left to undo after amp.initialize).
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

EXTENDED = os.environ.get("SHIM_EXTENDED", "0") not in ("", "0")

# ---- 1. device ---------------------------------------------------------------------------------


def _is_cuda(dev):
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


def _to_cpu_device(dev):
    return torch.device("cpu") if _is_cuda(dev) else dev


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device=torch.device("cpu"))
        name = getattr(func, "__name__", "")
        if name == "to" and args:
            args = tuple(_to_cpu_device(a) for a in args)
        return func(*args, **kwargs)


_mode = _CudaToCpu()
_mode.__enter__()  # for the whole process


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self.to("cpu", non_blocking=non_blocking, memory_format=memory_format)


def _module_cuda(self, device=None):
    return self.to("cpu")


torch.Tensor.cuda = _tensor_cuda
torch.nn.Module.cuda = _module_cuda

_CUDA_TYPE_TO_CPU = {
    "torch.cuda.FloatTensor": torch.FloatTensor,
    "torch.cuda.HalfTensor": torch.HalfTensor,
    "torch.cuda.DoubleTensor": torch.DoubleTensor,
    "torch.cuda.BFloat16Tensor": torch.BFloat16Tensor,
    "torch.cuda.IntTensor": torch.IntTensor,
    "torch.cuda.LongTensor": torch.LongTensor,
}


def _cpu_type(t):
    if isinstance(t, str):
        return t.replace("torch.cuda.", "torch.")
    name = getattr(t, "__module__", "") + "." + getattr(t, "__name__", "")
    if name in _CUDA_TYPE_TO_CPU:
        return _CUDA_TYPE_TO_CPU[name]
    return t


_orig_set_default_tensor_type = torch.set_default_tensor_type


def _set_default_tensor_type(t):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _orig_set_default_tensor_type(_cpu_type(t))


torch.set_default_tensor_type = _set_default_tensor_type

# ---- 2. type names ----------------------------------------------------------------------------

_orig_type = torch.Tensor.type


def _type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs:
        name = _orig_type(self)
        if (self.device.type == "cpu" and name.startswith("torch.")
                and not name.startswith(("torch.cuda.", "torch.sparse."))):
            return "torch.cuda." + name[len("torch."):]
        return name
    return _orig_type(self, _cpu_type(dtype), non_blocking, **kwargs)


torch.Tensor.type = _type

# ---- 4. the apex alias ------------------------------------------------------------------------

from ampfuse.apex_compat import install_apex_alias  # noqa: E402

install_apex_alias()

import ampfuse.amp as _amp  # noqa: E402  (this is apex.amp)

# ---- 3. fp16 as on CUDA -----------------------------------------------------------------------

_orig_initialize = _amp.initialize


# SHIM_DTYPE=bf16 keeps ampfuse's own CPU default instead (a side check; the type-name tests then
# fail by construction, since they expect HalfTensor).
_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}[os.environ.get("SHIM_DTYPE", "fp16")]


def _initialize(*args, **kwargs):
    kwargs.setdefault("dtype", _DTYPE)
    return _orig_initialize(*args, **kwargs)


_initialize.__wrapped__ = _orig_initialize
_amp.initialize = _initialize

# ---- extended mode ----------------------------------------------------------------------------

if EXTENDED:
    # 5. amp_C gate
    sys.modules.setdefault("amp_C", types.ModuleType("amp_C"))

    # 6. amp.init emulation
    from ampfuse.amp import per_op  # noqa: E402

    class _InitHandle:
        def __init__(self, enabled):
            self._hooks = None
            self._module = torch.nn.Module()
            if not enabled:
                return
            pending = _amp._pending_lists
            lists = per_op.CastLists(low=pending["low"], fp32=pending["fp32"],
                                     promote=pending["promote"])
            self._hooks = per_op.AutocastHooks(self._module, lists, torch.float16, "cpu")
            self._hooks._enter(self._module, ())

        def _deactivate(self):
            if self._hooks is not None:
                self._hooks._exit(self._module, (), None)
                self._hooks.remove()
                self._hooks = None

        def is_active(self):
            return self._hooks is not None

    def _init(enabled=True, loss_scale="dynamic", enable_caching=True, verbose=False,
              allow_banned=False):
        return _InitHandle(enabled)

    _amp.init = _init

    # 7. _amp_state.handle
    class _NoGlobalHandle:
        def _deactivate(self):
            pass

    from ampfuse.amp.apex_state import AmpStateView  # noqa: E402

    AmpStateView.handle = property(lambda self: _NoGlobalHandle())


def pytest_configure(config):
    # apex's tests import their helpers as a top-level module (`from utils import ...`).
    for arg in config.args:
        path = Path(arg.split("::")[0])
        folder = path if path.is_dir() else path.parent
        if folder.is_dir() and str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
