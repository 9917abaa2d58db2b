"""What the op wrappers and fake kernels share: the tensor_flags bits, the lr argument, and
the input checks that need no data (devices, dtypes, list lengths), worded as the C++ checks
(csrc/ops/checks.h) word them, so a traced call fails as an eager one does.

A fake kernel runs instead of the real one under FakeTensor/torch.compile tracing and whenever a
meta tensor is among the inputs.
"""

from __future__ import annotations

import torch

# tensor_flags, optional on the three flagging ops (ampfuse.ops.scale): an int32 tensor with
# one element per tensor of the list read, where the kernels OR in HELD_INF / HELD_NAN for each
# tensor that held an inf / a nan (never clearing them, as found_inf). It is written in the same
# pass, and only by the threads that saw such a value. For DTensors it is OR-reduced over the
# shard mesh like found_inf, so every rank names the same tensors.
HELD_INF = 1
HELD_NAN = 2


def lr_tensor(lr, step: torch.Tensor) -> torch.Tensor:
    # torch.full on the device launches a fill with the value as an argument: no host sync.
    if isinstance(lr, torch.Tensor):
        return lr
    return torch.full((1,), float(lr), dtype=torch.float32, device=step.device)


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_list(op, name, tensors, device=None):
    """Checks dtypes and a shared device; returns that device (None for an empty list)."""
    for i, t in enumerate(tensors):
        if t.dtype not in FLOAT_DTYPES:
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


def check_scalar(op, name, t, dtype, device, device_owner="the tensors"):
    if t.dtype != dtype or t.numel() != 1 or (device is not None and t.device != device):
        raise RuntimeError(
            f"ampfuse.{op}: {name} must be a one-element {dtype} tensor on {device} (where "
            f"{device_owner} live), got shape {tuple(t.shape)}, dtype {t.dtype} on {t.device}."
        )


def check_tensor_flags(op, tensor_flags, count, list_name, found_inf):
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


def check_companions(op, params, name, tensors, fp32_only, optional):
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


def check_step_scalars(op, device, step, lr, grad_scale, found_inf):
    # With an empty params list the scalars must still share one device: step's.
    owner = "params" if device is not None else "step, as params is empty"
    device = device or step.device
    for name, t in (("step", step), ("lr", lr), ("grad_scale", grad_scale),
                    ("found_inf", found_inf)):
        if t is not None:
            check_scalar(op, name, t, torch.float32, device, device_owner=owner)


MASTER_MODES = ("fp32", "stochastic", "kahan", "split")


def check_master_mode(op, params, master_params, master_mode, param_ids):
    """The master_params/param_ids contract of each master_mode (csrc/ops/master_args.h)."""
    if master_mode not in MASTER_MODES:
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
        check_companions(op, params, "master_params", master_params, True, True)
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
    check_companions(op, params, "master_params", master_params, False, False)
    for i, t in enumerate(master_params):
        if t.dtype != expected:
            raise RuntimeError(
                f"ampfuse.{op}: master_params[{i}] must be {expected} with "
                f"master_mode={master_mode!r}, got {t.dtype}."
            )


# The coded-moment ops (fused_adam_coded_, fused_lamb_coded_; csrc/ops/coded_args.cpp): the
# codes' dtypes per state_dtype, (first moment, second moments), and the elements per scale.
CODE_DTYPES = {
    "int8": (torch.int8, torch.uint8),
    "fp8": (torch.float8_e4m3fn, torch.float8_e4m3fn),
}
STATE_BLOCK = 256  # kStateBlock, csrc/kernels/state_codes.h


def check_state_dtype(op, state_dtype, fp32_op):
    if state_dtype not in CODE_DTYPES:
        raise RuntimeError(
            f"ampfuse.{op}: state_dtype={state_dtype!r} is not one of 'int8', 'fp8' (fp32 "
            f"moments are stepped by {fp32_op})."
        )


def check_coded_moment(op, params, codes_name, codes, scales_name, scales, state_dtype, second,
                       optional):
    """One coded moment of every param, as check_coded_moment in csrc/ops/coded_args.cpp."""
    if optional and len(codes) == 0 and len(scales) == 0:
        return
    for name, tensors in ((codes_name, codes), (scales_name, scales)):
        if len(tensors) != len(params):
            raise RuntimeError(
                f"ampfuse.{op}: {name} has {len(tensors)} tensors but params has {len(params)}; "
                f"pass one tensor per param{' (or empty lists).' if optional else '.'}"
            )
    dtype = CODE_DTYPES[state_dtype][1 if second else 0]
    for i, (c, s, p) in enumerate(zip(codes, scales, params)):
        if c.dtype != dtype:
            raise RuntimeError(
                f"ampfuse.{op}: {codes_name}[{i}] must be {dtype} with state_dtype="
                f"'{state_dtype}', got {c.dtype}; create it with torch.zeros_like(param, "
                f"dtype={dtype})."
            )
        if c.shape != p.shape:
            raise RuntimeError(
                f"ampfuse.{op}: {codes_name}[{i}] has shape {list(c.shape)} but params[{i}] has "
                f"shape {list(p.shape)}; codes are shaped and laid out like their param "
                f"(torch.zeros_like(param, dtype={dtype}))."
            )
        if c.device != p.device:
            raise RuntimeError(
                f"ampfuse.{op}: {codes_name}[{i}] is on {c.device} but params[{i}] is on "
                f"{p.device}; move it to its param's device."
            )
        if c.numel() > 1 and c.stride() != p.stride():
            raise RuntimeError(
                f"ampfuse.{op}: {codes_name}[{i}] has strides {list(c.stride())} but params[{i}] "
                f"has strides {list(p.stride())}; create it with torch.zeros_like(param, "
                f"dtype={dtype}) so both share one memory layout."
            )
        if s.dtype != torch.float32:
            raise RuntimeError(
                f"ampfuse.{op}: {scales_name}[{i}] must be torch.float32 (one absmax per block), "
                f"got {s.dtype}."
            )
        if s.device != p.device:
            raise RuntimeError(
                f"ampfuse.{op}: {scales_name}[{i}] is on {s.device} but params[{i}] is on "
                f"{p.device}; move it to its param's device."
            )
        blocks = -(-p.numel() // STATE_BLOCK)
        if s.dim() != 1 or s.numel() != blocks:
            raise RuntimeError(
                f"ampfuse.{op}: {scales_name}[{i}] must be a contiguous 1-D tensor of {blocks} "
                f"elements, one per block of {STATE_BLOCK} of params[{i}]'s {p.numel()} "
                f"(ceil(numel / {STATE_BLOCK}) = {blocks} elements), got shape "
                f"{list(s.shape)}; create it with torch.zeros({blocks}, dtype=torch.float32)."
            )
