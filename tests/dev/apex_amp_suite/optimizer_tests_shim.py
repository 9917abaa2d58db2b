"""Additions to cpu_shim.py (this folder) that apex's optimizer tests
(tests/L0/run_optimizers of NVIDIA/apex) need on a machine with no GPU. Load after it:

    -p cpu_shim -p optimizer_tests_shim

Every addition changes a CUDA-only call of the TEST or its REFERENCE code; none touches ampfuse or
the apex alias the tests exercise (apex.optimizers.*, apex.multi_tensor_apply stay as they are).

 A1. torch.amp.autocast / torch.autocast("cuda", ...) -> autocast("cpu", dtype=float16 unless
     given), CUDA autocast's default dtype. Without it torch disables CUDA autocast with a warning
     on a machine without CUDA and test_adam's GradScaler tests run in plain fp32 (they then pass
     trivially, and testGradScalerCapturableMaster fails on fp32 input into its fp16 convs).
 A2. torch.amp.GradScaler("cuda", ...) (and torch.GradScaler) -> GradScaler("cpu", ...). Without
     it torch disables the scaler ("CUDA is not available. Disabling"), so no scaling and no
     _step_supports_amp_scaling path of the fused optimizer would be exercised.
 A3. torch.cuda.synchronize() -> no-op when CUDA is unavailable (test_lamb calls it between
     steps; torch raises "Found no NVIDIA driver").
 A4. torch.cuda.manual_seed(s) / manual_seed_all(s) also seed the CPU generator (test_lamb's
     setUp seeds only CUDA; the shim puts its "cuda" tensors on the CPU, so without this the data
     would be unseeded and runs not reproducible).
 A5. test_lamb's reference optimizer RefLAMB uses apex's amp_C.multi_tensor_l2norm through
     apex.multi_tensor_apply.multi_tensor_applier, and raises unless the applier is available.
     For test modules defining RefLAMB only, the module global `multi_tensor_applier` is replaced
     by a torch stand-in that calls the op directly, and an `amp_C` module (the committed shim's
     empty one in SHIM_EXTENDED mode, else a new one) gets `multi_tensor_l2norm` (apex's
     semantics: fp32 L2 norm of all tensors in tensor_lists[0] as a 1-element tensor, plus
     per-tensor norms when asked) and `multi_tensor_lamb` (a placeholder RefLAMB only looks up).
     The alias's own multi_tensor_applier keeps available=False.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.amp
import torch.amp.autocast_mode
import torch.amp.grad_scaler


def _cpu(dev):
    if isinstance(dev, torch.device):
        return "cpu" if dev.type == "cuda" else dev
    if isinstance(dev, str) and (dev == "cuda" or dev.startswith("cuda:")):
        return "cpu"
    return dev


# ---- A1. autocast -------------------------------------------------------------------------------

_Autocast = torch.amp.autocast_mode.autocast


class _CpuAutocast(_Autocast):
    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if _cpu(device_type) != device_type:
            device_type = "cpu"
            if dtype is None:
                dtype = torch.float16
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


torch.amp.autocast = _CpuAutocast
torch.autocast = _CpuAutocast

# ---- A2. GradScaler -----------------------------------------------------------------------------

_GradScaler = torch.amp.grad_scaler.GradScaler


class _CpuGradScaler(_GradScaler):
    def __init__(self, device="cuda", *args, **kwargs):
        super().__init__(_cpu(device), *args, **kwargs)


torch.amp.GradScaler = _CpuGradScaler
if hasattr(torch, "GradScaler"):
    torch.GradScaler = _CpuGradScaler

# ---- A3. torch.cuda.synchronize -----------------------------------------------------------------

_orig_sync = torch.cuda.synchronize


def _synchronize(device=None):
    if torch.cuda.is_available():
        return _orig_sync(device)
    return None


torch.cuda.synchronize = _synchronize

# ---- A4. torch.cuda.manual_seed -----------------------------------------------------------------

_orig_cuda_seed, _orig_cuda_seed_all = torch.cuda.manual_seed, torch.cuda.manual_seed_all


def _cuda_manual_seed(seed):
    torch.random.default_generator.manual_seed(int(seed))
    return _orig_cuda_seed(seed)


def _cuda_manual_seed_all(seed):
    torch.random.default_generator.manual_seed(int(seed))
    return _orig_cuda_seed_all(seed)


torch.cuda.manual_seed = _cuda_manual_seed
torch.cuda.manual_seed_all = _cuda_manual_seed_all

# ---- A5. the reference LAMB's amp_C kernels -----------------------------------------------------


def _ref_multi_tensor_l2norm(noop_flag, tensor_lists, per_tensor=False, *args):
    """apex's amp_C.multi_tensor_l2norm: fp32 math, result a 1-element fp32 tensor."""
    tensors = tensor_lists[0]
    norms = torch.stack([t.detach().float().norm(2) for t in tensors])
    total = norms.norm(2).reshape(1)
    return total, (norms if per_tensor else torch.empty(0))


def _ref_multi_tensor_lamb(*args, **kwargs):
    raise RuntimeError("extra_shim: amp_C.multi_tensor_lamb is a placeholder (RefLAMB only "
                       "looks it up)")


class _RefApplier:
    available = True
    warned = False

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        return op(noop_flag_buffer, tensor_lists, *args)


_amp_C = sys.modules.get("amp_C")
if _amp_C is None:
    _amp_C = types.ModuleType("amp_C")
    sys.modules["amp_C"] = _amp_C
_amp_C.multi_tensor_l2norm = _ref_multi_tensor_l2norm
_amp_C.multi_tensor_lamb = _ref_multi_tensor_lamb


def pytest_runtest_setup(item):
    module = getattr(item, "module", None)
    if module is not None and hasattr(module, "RefLAMB") and hasattr(module,
                                                                     "multi_tensor_applier"):
        module.multi_tensor_applier = _RefApplier()
