"""Loads the native library and gives the ops typed Python wrappers and fake
(meta) kernels, so torch.compile, FakeTensor and opcheck can trace them.

This module is the only door between Python and the C++ ops: every other
module calls torch.ops.ampfuse.* through the functions defined here.
"""

from __future__ import annotations

import sys

import torch

try:
    from ampfuse import _C  # noqa: F401  (importing it registers torch.ops.ampfuse.*)
except ImportError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "ampfuse's native library (ampfuse._C) could not be loaded: "
        f"{error}. Build it against the installed torch with "
        "`pip install --no-build-isolation .` (or `make build` in a source checkout); "
        "it must be rebuilt whenever torch is upgraded."
    ) from error

_OPS = (
    "multi_tensor_unscale_",
    "multi_tensor_scale_",
    "multi_tensor_l2norm",
    "multi_tensor_nonfinite_check_",
    "update_scale_",
    "fused_adam_",
    "fused_sgd_",
    "fused_adagrad_",
    "fused_lamb_",
    "fused_novograd_",
    "fp8_cast_amax",
    "fp8_update_scales_",
    "fp8_gemm",
    "fp8_transpose",
)


def _has_cuda_kernels() -> bool:
    return all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"ampfuse::{name}", "CUDA")
        for name in _OPS
    )


def cuda_status() -> str:
    """Says whether ampfuse's CUDA kernels can run here and, if not, why and how to fix it."""
    if not _has_cuda_kernels():
        return (
            "ampfuse was built without CUDA kernels (no CUDA toolkit was found at build time, "
            "or torch has no CUDA support). Install the CUDA toolkit matching "
            f"torch.version.cuda ({torch.version.cuda}) and rebuild with "
            "`pip install --no-build-isolation .`."
        )
    if not torch.cuda.is_available():
        return (
            "ampfuse has CUDA kernels, but torch sees no CUDA device on this machine; "
            "the CPU kernels are used for CPU tensors."
        )
    return f"ampfuse CUDA kernels are available ({torch.cuda.device_count()} device(s))."


def cuda_available() -> bool:
    """True when ampfuse has CUDA kernels and torch sees a CUDA device."""
    return _has_cuda_kernels() and torch.cuda.is_available()


def _dtensor_rules() -> None:
    """Registers the ops' DTensor rules (ampfuse.distributed) once torch.distributed.tensor is
    loaded. No DTensor exists before that, and importing it eagerly would cost every ampfuse
    import over a second, so each wrapper checks: one dict lookup (skipped while torch.compile
    traces; eager calls register the rules). The dict lookups come first: torch.compile traces
    them, and they settle the usual case without a Python call."""
    if "torch.distributed.tensor" not in sys.modules or "ampfuse.distributed" in sys.modules:
        return
    if not torch.compiler.is_compiling():
        import ampfuse.distributed  # noqa: F401  (registers the rules)


# ---- typed wrappers ----------------------------------------------------------------


# tensor_flags, optional on the three ops below: an int32 tensor with one element per tensor of
# the list read, where the kernels OR in HELD_INF / HELD_NAN for each tensor that held an inf /
# a nan (never clearing them, as found_inf). It is written in the same pass, and only by the
# threads that saw such a value. For DTensors it is OR-reduced over the shard mesh like
# found_inf, so every rank names the same tensors.
HELD_INF = 1
HELD_NAN = 2


def multi_tensor_unscale_(grads, found_inf: torch.Tensor, inv_scale: torch.Tensor,
                          tensor_flags: torch.Tensor | None = None) -> None:
    """In place ``g *= inv_scale`` (fp32 math); ``found_inf`` set to 1 on any inf/nan."""
    _dtensor_rules()
    torch.ops.ampfuse.multi_tensor_unscale_(list(grads), found_inf, inv_scale, tensor_flags)


def multi_tensor_nonfinite_check_(tensors, found_inf: torch.Tensor,
                                  tensor_flags: torch.Tensor | None = None) -> None:
    """Sets ``found_inf`` to 1 if any element of ``tensors`` is inf/nan; reads them only and
    never clears the flag. For DTensors the flag is all-reduced (MAX) over their device meshes,
    so every rank gets the same verdict (see ampfuse.distributed)."""
    _dtensor_rules()
    torch.ops.ampfuse.multi_tensor_nonfinite_check_(list(tensors), found_inf, tensor_flags)


def multi_tensor_scale_(src, dst, scale: torch.Tensor, found_inf: torch.Tensor,
                        tensor_flags: torch.Tensor | None = None) -> None:
    """``dst[i] = src[i] * scale`` cast to ``dst[i].dtype``; flags non-finite sources."""
    _dtensor_rules()
    torch.ops.ampfuse.multi_tensor_scale_(list(src), list(dst), scale, found_inf, tensor_flags)


def multi_tensor_l2norm(tensors, per_tensor: bool = False):
    """Returns ``(global_norm, per_tensor_norms)`` in fp32. For DTensors (e.g. FSDP2 grads)
    both are the norms of the whole tensors, as Replicate DTensors (see ampfuse.distributed)."""
    _dtensor_rules()
    return torch.ops.ampfuse.multi_tensor_l2norm(list(tensors), per_tensor)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = float("inf"),
) -> None:
    """One step of the dynamic loss-scale rule, on the scale's device."""
    torch.ops.ampfuse.update_scale_(
        scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
        growth_interval, hysteresis, min_scale, max_scale,
    )


def _lr_tensor(lr, step: torch.Tensor) -> torch.Tensor:
    # torch.full on the device launches a fill with the value as an argument: no host sync.
    if isinstance(lr, torch.Tensor):
        return lr
    return torch.full((1,), float(lr), dtype=torch.float32, device=step.device)


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, step, lr,
                beta1, beta2, eps, weight_decay, adam_w_mode=True, bias_correction=True,
                amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
                write_unscaled_grads=False, master_mode="fp32", param_ids=(), seed=0) -> None:
    """One Adam/AdamW step over lists (see the op's schema in csrc/registration.cpp).

    lr is a float or a one-element float32 tensor on the params' device. With
    write_unscaled_grads and a grad_scale, the grads are left divided by grad_scale (unless the
    step is skipped), as torch's fused optimizers leave them. master_mode "stochastic",
    "kahan" or "split" updates bf16 params without fp32 masters (master_params: none, bf16
    compensations, int16 low halves; param_ids and seed key the stochastic rounding)."""
    lr = _lr_tensor(lr, step)
    _dtensor_rules()
    torch.ops.ampfuse.fused_adam_(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs),
        list(master_params), step, lr, beta1, beta2, eps, weight_decay, adam_w_mode,
        bias_correction, amsgrad, maximize, grad_scale, found_inf, write_unscaled_grads,
        master_mode, list(param_ids), seed,
    )


def fused_sgd_(params, grads, momentum_buffers, master_params, step, lr, momentum=0.0,
               dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, grad_scale=None,
               found_inf=None, write_unscaled_grads=False, wd_after_momentum=False,
               master_mode="fp32", param_ids=(), seed=0) -> None:
    """One SGD step over lists (see the op's schema in csrc/registration.cpp).

    lr is a float or a one-element float32 tensor on the params' device; write_unscaled_grads
    and the master modes as for fused_adam_; wd_after_momentum adds the weight decay to the
    update after the momentum step (apex's option) instead of to the grad before it."""
    lr = _lr_tensor(lr, step)
    _dtensor_rules()
    torch.ops.ampfuse.fused_sgd_(
        list(params), list(grads), list(momentum_buffers), list(master_params), step, lr,
        momentum, dampening, weight_decay, nesterov, maximize, grad_scale, found_inf,
        write_unscaled_grads, wd_after_momentum, master_mode, list(param_ids), seed,
    )


# ---- fake kernels --------------------------------------------------------------------
# A fake kernel runs instead of the real one under FakeTensor/torch.compile tracing and
# whenever a meta tensor is among the inputs, so it repeats the checks that do not need
# data (devices, dtypes, list lengths) with the real kernels' wording.

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_list(op, name, tensors, device=None):
    """Checks dtypes and a shared device; returns that device (None for an empty list)."""
    for i, t in enumerate(tensors):
        if t.dtype not in _FLOAT_DTYPES:
            raise RuntimeError(
                f"ampfuse.{op}: {name}[{i}] has dtype {t.dtype}; ampfuse ops take torch.float32, "
                "torch.float16 or torch.bfloat16 tensors."
            )
        device = device or t.device
        if t.device != device:
            raise RuntimeError(
                f"ampfuse.{op}: {name}[{i}] is on {t.device} but the other tensors are on "
                f"{device}; all tensors of one call must be on the same device."
            )
    return device


def _check_scalar(op, name, t, dtype, device, device_owner="the tensors"):
    if t.dtype != dtype or t.numel() != 1 or (device is not None and t.device != device):
        raise RuntimeError(
            f"ampfuse.{op}: {name} must be a one-element {dtype} tensor on {device} (where "
            f"{device_owner} live), got shape {tuple(t.shape)}, dtype {t.dtype} on {t.device}."
        )


def _check_tensor_flags(op, tensor_flags, count, list_name, found_inf):
    if tensor_flags is None:
        return
    if (tensor_flags.dtype != torch.int32 or tensor_flags.dim() != 1
            or tensor_flags.numel() != count or not tensor_flags.is_contiguous()):
        raise RuntimeError(
            f"ampfuse.{op}: tensor_flags must be a contiguous 1-D torch.int32 tensor with one "
            f"element per tensor of {list_name} ({count}), got shape "
            f"{list(tensor_flags.shape)} and dtype {tensor_flags.dtype}. Create it with "
            f"torch.zeros(len({list_name}), dtype=torch.int32, device=...)."
        )
    if tensor_flags.device != found_inf.device:
        raise RuntimeError(
            f"ampfuse.{op}: tensor_flags is on {tensor_flags.device} but must be on "
            f"{found_inf.device} (the device of found_inf); move tensor_flags to "
            f"{found_inf.device}."
        )


@torch.library.register_fake("ampfuse::multi_tensor_unscale_")
def _unscale_fake(grads, found_inf, inv_scale, tensor_flags=None):
    device = _check_list("multi_tensor_unscale_", "grads", grads)
    _check_scalar("multi_tensor_unscale_", "found_inf", found_inf, torch.float32, device)
    _check_scalar("multi_tensor_unscale_", "inv_scale", inv_scale, torch.float32, device)
    _check_tensor_flags("multi_tensor_unscale_", tensor_flags, len(grads), "grads", found_inf)


@torch.library.register_fake("ampfuse::multi_tensor_nonfinite_check_")
def _nonfinite_check_fake(tensors, found_inf, tensor_flags=None):
    op = "multi_tensor_nonfinite_check_"
    device = _check_list(op, "tensors", tensors)
    _check_scalar(op, "found_inf", found_inf, torch.float32, device)
    _check_tensor_flags(op, tensor_flags, len(tensors), "tensors", found_inf)


@torch.library.register_fake("ampfuse::multi_tensor_scale_")
def _scale_fake(src, dst, scale, found_inf, tensor_flags=None):
    op = "multi_tensor_scale_"
    if len(src) != len(dst):
        raise RuntimeError(
            f"ampfuse.{op}: src has {len(src)} tensors but dst has {len(dst)}; "
            "pass one destination per source."
        )
    device = _check_list(op, "dst", dst, _check_list(op, "src", src))
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.shape != d.shape:
            raise RuntimeError(
                f"ampfuse.{op}: src[{i}] has shape {tuple(s.shape)} but dst[{i}] has shape "
                f"{tuple(d.shape)}; each destination must match its source's shape."
            )
    _check_scalar(op, "scale", scale, torch.float32, device)
    _check_scalar(op, "found_inf", found_inf, torch.float32, device)
    _check_tensor_flags(op, tensor_flags, len(src), "src", found_inf)


@torch.library.register_fake("ampfuse::multi_tensor_l2norm")
def _l2norm_fake(tensors, per_tensor):
    device = _check_list("multi_tensor_l2norm", "tensors", tensors) or torch.device("cpu")
    global_norm = torch.empty((), dtype=torch.float32, device=device)
    per_tensor_norms = torch.empty(
        (len(tensors) if per_tensor else 0,), dtype=torch.float32, device=device
    )
    return global_norm, per_tensor_norms


@torch.library.register_fake("ampfuse::update_scale_")
def _update_scale_fake(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                       backoff_factor, growth_interval, hysteresis, min_scale, max_scale):
    op = "update_scale_"
    _check_scalar(op, "scale", scale, torch.float32, scale.device)
    for name, t, dtype in (("growth_tracker", growth_tracker, torch.int32),
                           ("hysteresis_tracker", hysteresis_tracker, torch.int32),
                           ("found_inf", found_inf, torch.float32)):
        _check_scalar(op, name, t, dtype, scale.device, device_owner="scale")


def _check_companions(op, params, name, tensors, fp32_only, optional):
    if optional and len(tensors) == 0:
        return
    if len(tensors) != len(params):
        raise RuntimeError(
            f"ampfuse.{op}: {name} has {len(tensors)} tensors but params has {len(params)}; "
            "pass one per param."
        )
    for i, (t, p) in enumerate(zip(tensors, params)):
        if t.shape != p.shape or t.device != p.device:
            raise RuntimeError(
                f"ampfuse.{op}: {name}[{i}] has shape {tuple(t.shape)} on {t.device} but "
                f"params[{i}] has shape {tuple(p.shape)} on {p.device}."
            )
        if fp32_only and t.dtype != torch.float32:
            raise RuntimeError(f"ampfuse.{op}: {name}[{i}] must be torch.float32, got {t.dtype}.")


def _check_step_scalars(op, device, step, lr, grad_scale, found_inf):
    # With an empty params list the scalars must still share one device: step's.
    owner = "params" if device is not None else "step, as params is empty"
    device = device or step.device
    for name, t in (("step", step), ("lr", lr), ("grad_scale", grad_scale),
                    ("found_inf", found_inf)):
        if t is not None:
            _check_scalar(op, name, t, torch.float32, device, device_owner=owner)


_MASTER_MODES = ("fp32", "stochastic", "kahan", "split")


def _check_master_mode(op, params, master_params, master_mode, param_ids):
    """The master_params/param_ids contract of each master_mode (csrc/ops/master_args.h)."""
    if master_mode not in _MASTER_MODES:
        raise RuntimeError(
            f"ampfuse.{op}: master_mode={master_mode!r} is not one of 'fp32', 'stochastic', "
            "'kahan', 'split'."
        )
    if master_mode != "stochastic" and len(param_ids) != 0:
        raise RuntimeError(
            f"ampfuse.{op}: param_ids key stochastic rounding; pass them with "
            f"master_mode='stochastic' only (got {len(param_ids)} with "
            f"master_mode={master_mode!r})."
        )
    if master_mode == "fp32":
        _check_companions(op, params, "master_params", master_params, True, True)
        return
    for i, p in enumerate(params):
        if p.dtype != torch.bfloat16:
            raise RuntimeError(
                f"ampfuse.{op}: master_mode={master_mode!r} updates torch.bfloat16 params, but "
                f"params[{i}] is {p.dtype}."
            )
    if master_mode == "stochastic":
        if len(master_params) != 0 or len(param_ids) != len(params):
            raise RuntimeError(
                f"ampfuse.{op}: master_mode='stochastic' takes master_params=[] and one param id "
                f"per param ({len(params)}), got {len(master_params)} and {len(param_ids)}."
            )
        return
    expected = torch.int16 if master_mode == "split" else torch.bfloat16
    _check_companions(op, params, "master_params", master_params, False, False)
    for i, t in enumerate(master_params):
        if t.dtype != expected:
            raise RuntimeError(
                f"ampfuse.{op}: master_params[{i}] must be {expected} with "
                f"master_mode={master_mode!r}, got {t.dtype}."
            )


@torch.library.register_fake("ampfuse::fused_adam_")
def _adam_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, step, lr,
               beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, amsgrad, maximize,
               grad_scale, found_inf, write_unscaled_grads=False, master_mode="fp32",
               param_ids=(), seed=0):
    op = "fused_adam_"
    device = _check_list(op, "params", params)
    _check_companions(op, params, "grads", grads, fp32_only=False, optional=False)
    _check_companions(op, params, "exp_avgs", exp_avgs, fp32_only=True, optional=False)
    _check_companions(op, params, "exp_avg_sqs", exp_avg_sqs, fp32_only=True, optional=False)
    _check_companions(op, params, "max_exp_avg_sqs", max_exp_avg_sqs, True, not amsgrad)
    _check_master_mode(op, params, master_params, master_mode, param_ids)
    _check_step_scalars(op, device, step, lr, grad_scale, found_inf)


@torch.library.register_fake("ampfuse::fused_sgd_")
def _sgd_fake(params, grads, momentum_buffers, master_params, step, lr, momentum, dampening,
              weight_decay, nesterov, maximize, grad_scale, found_inf, write_unscaled_grads=False,
              wd_after_momentum=False, master_mode="fp32", param_ids=(), seed=0):
    op = "fused_sgd_"
    device = _check_list(op, "params", params)
    _check_companions(op, params, "grads", grads, fp32_only=False, optional=False)
    _check_companions(op, params, "momentum_buffers", momentum_buffers, True, True)
    _check_master_mode(op, params, master_params, master_mode, param_ids)
    _check_step_scalars(op, device, step, lr, grad_scale, found_inf)


# The FP8 ops' wrappers and fake kernels live in _fp8_ops; their wrappers are also here, beside
# every other op's.
from ampfuse._fp8_ops import (  # noqa: E402,F401
    fp8_cast_amax,
    fp8_gemm,
    fp8_transpose,
    fp8_update_scales_,
)
# fused_adagrad_'s, fused_lamb_'s and fused_novograd_'s wrappers and fake kernels live in
# _adagrad_ops, _lamb_ops and _novograd_ops, for the same reason.
from ampfuse._adagrad_ops import fused_adagrad_  # noqa: E402,F401
from ampfuse._lamb_ops import fused_lamb_  # noqa: E402,F401
from ampfuse._novograd_ops import fused_novograd_  # noqa: E402,F401
