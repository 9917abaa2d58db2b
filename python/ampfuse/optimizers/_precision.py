"""master_weights: how a fused optimizer keeps the precision that a low-precision param lacks.

A group's ``master_weights`` is one of

- ``True``: an fp32 master per fp16/bf16 param (state 'master_param', 4 extra bytes per param);
- ``False``: none; the param is updated in place and rounded to nearest;
- ``"stochastic"``: none; a bf16 param is rounded stochastically, with counter-based random bits
  from (the group's ``rounding_seed``, the step, the param's index in the optimizer, the
  element), so a run is reproducible and resumes bit for bit (0 extra bytes);
- ``"kahan"``: a bf16 compensation per bf16 param (state 'kahan_compensation', 2 extra bytes)
  that carries each update's rounding error into the next;
- ``"split"``: the low 16 bits of an fp32 master (state 'master_low_bits', int16, 2 extra
  bytes), read as the signed remainder from the bf16 param, which is the master rounded to
  nearest: master bits = (param bits << 16) + low. The masters are exactly those of ``True``
  and so is the param, except where the master lies exactly halfway above an even bf16 value
  (ties round away from zero here, to even under ``True``; see split_halves).

The three bf16 modes apply to bf16 params; fp32 params of such a group are updated in fp32 as
with ``False``, and fp16 params are refused (fp16 is not the high half of an fp32, and its
narrow range wants the loss scaling and fp32 masters of ``True``).

Each param's state holds at most one of the three keys. A state holding another mode's key (a
checkpoint of another mode, or a group whose mode was changed) is converted at the param's next
step, through the precise value the state stands for: the fp32 master; the param with its low
half; the param plus its compensation; or the param itself. Converting True -> "split" and
"split" -> True is exact both ways (and moves no param but such a tie); a mode that holds less
than that value rounds it to what it can hold (to nearest, and for "kahan" the remainder into the
compensation).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ampfuse.overflow import param_name

# master_weights values that update bf16 params without an fp32 master.
BF16_MODES = ("stochastic", "kahan", "split")
MASTER_WEIGHTS_VALUES = (True, False) + BF16_MODES

# The state key of each mode's extra tensor, by the mode a param is stepped in ("fp32": a
# low-precision param with master_weights=True).
EXTRA_KEYS = {"fp32": "master_param", "kahan": "kahan_compensation", "split": "master_low_bits"}

# Optimizer-state bytes per param that each master_weights value adds for a bf16 param, on top
# of the param, its grad and the optimizer's own fp32 state (Adam's two moments, SGD's buffer).
EXTRA_BYTES_PER_PARAM = {True: 4, False: 0, "stochastic": 0, "kahan": 2, "split": 2}


def check_master_weights(optimizer: object, index: int, group: dict[str, Any],
                         check_params: bool = True) -> None:
    """A group's master_weights must be one of MASTER_WEIGHTS_VALUES, and (check_params) a bf16
    mode takes no fp16 param. step() checks the params itself, as it walks them anyway."""
    value = group["master_weights"]
    if not any(value is v if isinstance(v, bool) else value == v
               for v in MASTER_WEIGHTS_VALUES):
        raise ValueError(
            f"{type(optimizer).__name__}: param_groups[{index}] has master_weights={value!r}; it "
            "must be True (fp32 masters), False (none, round to nearest), 'stochastic', "
            "'kahan' or 'split' (bf16 params without fp32 masters)."
        )
    if check_params and value in BF16_MODES:
        for i, p in enumerate(group["params"]):
            check_param_for_mode(optimizer, index, i, p, value)
    seed = group.get("rounding_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(
            f"{type(optimizer).__name__}: param_groups[{index}] has rounding_seed={seed!r}; it "
            "must be an int in [0, 2**63)."
        )


def check_param_for_mode(optimizer: object, group_index: int, param_index: int,
                         p: torch.Tensor, value: object) -> None:

    if p.dtype == torch.float16:
        raise ValueError(
            f"{type(optimizer).__name__}: {param_name(group_index, param_index)} is "
            f"torch.float16, but master_weights={value!r} updates bfloat16 params only; put fp16 "
            "params in a param group with master_weights=True (fp32 masters)."
        )


def param_mode(master_weights: bool | str, p: torch.Tensor) -> str:
    """How `p` is stepped: "fp32" (fp32 master), "none" (in place, to nearest), or a bf16
    mode. The caller has checked master_weights."""
    if master_weights is True:
        return "fp32" if p.dtype in (torch.float16, torch.bfloat16) else "none"
    if master_weights and p.dtype == torch.bfloat16:
        return master_weights
    return "none"


def has_foreign_state(state: dict[str, Any], mode: str) -> bool:
    """Whether `state` holds an extra tensor of a mode other than `mode`, or low bits of the
    old split layout (to convert)."""
    own = EXTRA_KEYS.get(mode)
    for key in (*EXTRA_KEYS.values(), LEGACY_LOW_BITS):
        if key != own and key in state:
            return True
    return False


# ---- checkpoints ------------------------------------------------------------------------------

# The dtype each extra tensor is kept in.
EXTRA_DTYPES = {"master_param": torch.float32, "kahan_compensation": torch.bfloat16,
                "master_low_bits": torch.int16}

# How a checkpoint's 'master_low_bits' go with its params, saved beside them in each param's
# state (a 0-dim int64 tensor): 1 (the only layout before the key existed, so a state without
# the key): the param is
# the master's high half truncated toward zero and the low bits are the rest, unsigned. 2: the
# param is the master rounded to nearest and the low bits the signed remainder (split_halves).
# A layout-1 state loads under LEGACY_LOW_BITS, a key of no mode, which the param's next step
# converts like another mode's state (through precise_value), rewriting the param rounded; the
# load itself cannot, as the model's weights may be loaded after the optimizer's state.
SPLIT_LAYOUT_KEY = "master_low_bits_layout"
SPLIT_LAYOUT = 2
LEGACY_LOW_BITS = "master_low_bits_truncated"


# Neither gloo nor NCCL all-gathers int16, and torch's full (unsharded) state dicts
# (get_optimizer_state_dict(..., full_state_dict=True)) gather every DTensor in the optimizer's
# state_dict. So sharded low halves go into state_dict() as int32, which every backend gathers
# and which holds the same values; a load takes them back in either dtype. Plain tensors keep
# int16, the checkpoint format of an unsharded run.
_GATHERABLE_LOW_BITS = torch.int32


def _is_dtensor(t: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # only loaded where DTensors exist
    return module is not None and isinstance(t, module.DTensor)


def export_extra(state: dict[str, Any], out: dict[str, Any]) -> None:
    """Copies the extra tensor `state` holds (if any) into the state_dict entry `out`, low bits
    with their layout (old-layout ones not yet converted as they were loaded)."""
    layouts = {"master_low_bits": SPLIT_LAYOUT, LEGACY_LOW_BITS: 1}
    for key in (*EXTRA_DTYPES, LEGACY_LOW_BITS):
        if key in state:
            value = state[key]
            if key in layouts:
                if _is_dtensor(value):
                    value = value.to(_GATHERABLE_LOW_BITS)
                # A tensor, like 'step': code that moves every state entry (.to(device))
                # moves it too.
                out[SPLIT_LAYOUT_KEY] = torch.tensor(layouts[key])
                key = "master_low_bits"
            out[key] = value


def _saved_layout(saved: dict[str, Any], where: str, owner: str) -> int:
    layout = saved.get(SPLIT_LAYOUT_KEY, 1)
    if isinstance(layout, torch.Tensor):
        layout = layout.item()
    if layout not in (1, SPLIT_LAYOUT):
        raise ValueError(
            f"{owner}.load_state_dict: state of {where} has {SPLIT_LAYOUT_KEY}={layout!r}; this "
            f"ampfuse reads layouts 1 and {SPLIT_LAYOUT} of master_weights='split' low bits. A "
            "newer ampfuse saved it: load it with that version."
        )
    return int(layout)


def _loaded_low_bits(value: torch.Tensor, where: str, owner: str) -> torch.Tensor:
    """Saved low halves as int16: as they are, or from the int32 a sharded state_dict() gave
    (checked to be int16 values, on this rank's part of them)."""
    if value.dtype != _GATHERABLE_LOW_BITS:
        return value
    local: Any = value.to_local() if _is_dtensor(value) else value  # type: ignore[attr-defined]
    low, high = torch.aminmax(local) if local.numel() else (0, 0)
    if int(low) < -0x8000 or int(high) > 0x7FFF:
        raise ValueError(
            f"{owner}.load_state_dict: state of {where} has 'master_low_bits' as int32 with "
            "values outside int16; they are not the low halves master_weights='split' saves, "
            "so the state dict is damaged or not from ampfuse."
        )
    return value.to(torch.int16)


def import_extras(group: dict[str, Any], p: torch.Tensor, saved: dict[str, Any], where: str,
                  owner: str) -> dict[str, torch.Tensor]:
    """{key: tensor} of the extra tensors of a saved state that `p` keeps, laid out like p in
    their dtype; converted to the group's mode at p's next step. A saved fp32 master is left
    out where the mode holds nothing it could convert into ("none", "stochastic"): the param
    holds it rounded to nearest. Compensations and low halves belong to bf16 params only."""
    out = {}
    mode = param_mode(group["master_weights"], p)
    for key, dtype in EXTRA_DTYPES.items():
        value = saved.get(key)
        if value is None:
            continue
        if key == "master_param" and mode not in EXTRA_KEYS:
            continue
        if key != "master_param" and p.dtype != torch.bfloat16:
            continue
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"{owner}.load_state_dict: state of {where} has {key!r} of shape "
                f"{tuple(value.shape)} but the param has shape {tuple(p.shape)}; the state dict "
                "belongs to another model."
            )
        if key == "master_low_bits":
            value = _loaded_low_bits(value, where, owner)
        if value.dtype != dtype and (key != "master_param" or not value.is_floating_point()):
            also = " (or int32, as a sharded state_dict() gives it)" if key == (
                "master_low_bits") else ""
            raise ValueError(
                f"{owner}.load_state_dict: state of {where} has {key!r} of dtype {value.dtype}; "
                f"it must be {dtype}{also} (saved by master_weights="
                f"{ {v: k for k, v in EXTRA_KEYS.items()}[key]!r})."
            )
        if key == "master_low_bits" and _saved_layout(saved, where, owner) == 1:
            key = LEGACY_LOW_BITS
        out[key] = like(p, dtype).copy_(value)
    return out


# ---- conversions ------------------------------------------------------------------------------


def _as_int16(bits: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of int64 `bits` as int16 (two's complement)."""
    low = bits & 0xFFFF
    return torch.where(low >= 0x8000, low - 0x10000, low).to(torch.int16)


def split_halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(param bits, low bits), both int16, that master_weights="split" keeps for the fp32
    masters x: the kernels' split_master (csrc/kernels/bf16_modes.h), bit for bit.

    With u = x's bit pattern (sign and magnitude), the param is (u + 0x8000) >> 16 and the low
    bits are u's low 16 bits read as a signed remainder r in [-0x8000, 0x7fff]: u = (param << 16)
    + r, because adding 0x8000 carries into the high half exactly when the low half is 0x8000 or
    more, i.e. when r is negative. So every fp32 pattern, infinities and the masters that round
    to them included, comes back exactly. The param is x rounded to nearest in magnitude with
    ties away from zero (to even under master_weights=True; the two differ only for u's low half
    exactly 0x8000 with an even high half). No 16-bit remainder could keep ties to even: an
    even bf16 value is the nearest, ties to even, of 2^16 + 1 fp32 values. A NaN master gives
    the canonical NaN param 0x7fc0 (as rounding to nearest does), and its low bits keep the
    joined value a NaN."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    # Shifts as multiplications and floor divisions (of values >= 0): on a DTensor (FSDP2),
    # torch 2.11's `<<` by a Python int returns its input unchanged.
    high = (bits + 0x8000) // 0x10000
    high = torch.where(torch.isnan(x), torch.full_like(high, 0x7FC0), high)
    return _as_int16(high), _as_int16(bits)


def joined_master(p: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 master that bf16 `p` and its low bits `low` stand for (split_halves' inverse,
    the kernels' join_master)."""
    high = p.view(torch.int16).to(torch.int64) & 0xFFFF
    bits = high * 0x10000 + low.to(torch.int64)  # not <<: see split_halves
    return _as_int32(bits).view(torch.float32)


def _as_int32(bits: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 `bits` as int32."""
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 0x80000000, bits - 0x100000000, bits).to(torch.int32)


def _joined_truncated(p: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 master of split's layout 1: bf16 `p` its high half, `low` its low half."""
    high = p.view(torch.int16).to(torch.int64) & 0xFFFF
    return _as_int32(high * 0x10000 + (low.to(torch.int64) & 0xFFFF)).view(torch.float32)


def precise_value(p: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """The fp32 value the param's state stands for (see the module docstring)."""
    if "master_param" in state:
        return state["master_param"].detach().float()
    if "master_low_bits" in state:
        return joined_master(p.detach(), state["master_low_bits"])
    if LEGACY_LOW_BITS in state:
        return _joined_truncated(p.detach(), state[LEGACY_LOW_BITS])
    if "kahan_compensation" in state:
        return p.detach().float() + state["kahan_compensation"].float()
    return p.detach().float()


def like(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros of `dtype` shaped and laid out like p."""
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)


@torch.no_grad()
def prepare_extra(p: torch.Tensor, state: dict[str, Any], mode: str) -> None:
    """Makes `state` hold exactly `mode`'s extra tensor (none for "none" and "stochastic"),
    converting another mode's (see the module docstring) or starting from the param's value.
    Writes the param when the conversion moves it (e.g. "split" -> "kahan", or old-layout low
    bits -> "split" or True: that layout kept the param truncated toward zero)."""
    own = EXTRA_KEYS.get(mode)
    if own is not None and own in state and not has_foreign_state(state, mode):
        return
    if own is None and set(state).isdisjoint(("kahan_compensation", "master_low_bits",
                                              LEGACY_LOW_BITS)):
        # Only an fp32 master to drop: the param holds it rounded to nearest already (or a
        # value someone wrote since, which wins), as when master_weights was turned off.
        state.pop("master_param", None)
        return
    converting = has_foreign_state(state, mode)
    x: Any = precise_value(p, state) if converting else None  # a tensor where converting
    for key in (*EXTRA_KEYS.values(), LEGACY_LOW_BITS):
        state.pop(key, None)
    if mode == "fp32":
        master = like(p, torch.float32)
        state["master_param"] = master.copy_(x if converting else p)
        if converting:
            p.copy_(x)
    elif mode == "split":
        low = like(p, torch.int16)
        if converting:
            high, low_bits = split_halves(x.contiguous())
            p.view(torch.int16).copy_(high)
            low.copy_(low_bits)
        state["master_low_bits"] = low
    elif mode == "kahan":
        compensation = like(p, torch.bfloat16)
        if converting:
            p.copy_(x)
            error = x - p.float()
            compensation.copy_(torch.where(torch.isfinite(p), error, torch.zeros_like(error)))
        state["kahan_compensation"] = compensation
    elif converting:
        p.copy_(x)


@torch.no_grad()
def reset_extra(state: dict[str, Any], mode: str) -> None:
    """After something else wrote the param: a compensation or low half left over would be
    added to a value it does not belong to, so it is zeroed (the param's value rules)."""
    key = EXTRA_KEYS.get(mode)
    if key is not None and key != "master_param" and key in state:
        state[key].zero_()
