"""amp.state_dict() / amp.load_state_dict(): the loss scalers and the fp32 masters amp keeps.

Each loss scaler is saved under apex's key ("loss_scaler0", ...) with apex's two entries
("loss_scale", "unskipped") beside ours, so a script that reads apex's entries keeps working,
and a checkpoint written by apex loads here. Loading checks the whole state before it changes
anything: a state from another model or setup is refused with nothing half-loaded.
"""

from __future__ import annotations

import math
import re
from typing import Any, NoReturn

import torch

from ampfuse.amp.binding import Binding
from ampfuse.amp.optimizer_access import optimizer_params

# `handle` below is amp's handle (handle.AmpHandle), which imports this module: typed Any.

_SCALER_KEY = re.compile(r"loss_scaler(\d+)$")
_OUR_KEYS = ("master_params", "skipped_steps", "unstepped_fused_masters")


def state_dict(handle: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i, scaler in enumerate(handle.scalers):
        entry = scaler.state_dict()
        entry["loss_scale"] = entry["scale"]  # apex's names for the same two values
        entry["unskipped"] = entry["growth_tracker"]
        state[f"loss_scaler{i}"] = entry
    masters = [[m.detach().clone() for _, m in b.masters] for b in handle.bindings]
    if any(masters):
        state["master_params"] = masters
    state["skipped_steps"] = [0 if c is None else int(c.item()) for c in handle.skipped_counts()]
    unstepped = [_unstepped_fused_masters(b) for b in handle.bindings]
    if any(unstepped):
        state["unstepped_fused_masters"] = unstepped
    return state


def _unstepped_fused_masters(b: Binding) -> dict[int, torch.Tensor]:
    """Masters amp seeded into a fused optimizer for params that have not stepped yet. The
    optimizer's own state_dict leaves them out (torch.optim would read a state without 'step'
    as corrupt), so amp's checkpoint carries them, by position in the param groups."""
    if not b.fused:
        return {}
    unstepped = b.inner.masters(unstepped_only=True)
    return {i: unstepped[p].detach().clone() for i, p in enumerate(optimizer_params(b.inner))
            if p in unstepped}


def _fail(message: str) -> NoReturn:
    raise ValueError(f"amp.load_state_dict: {message}; nothing was loaded.")


def _scaler_values(key: str, entry: Any) -> tuple[float, int, Any, Any]:
    """(scale, growth tracker, hysteresis tracker or None, skipped or None) of one saved loss
    scaler, in ampfuse's or apex's format."""
    if not isinstance(entry, dict):
        _fail(f"{key!r} is a {type(entry).__name__}, not a dict")
    if "scale" in entry:
        scale, tracker = entry["scale"], entry.get("growth_tracker", 0)
    elif "loss_scale" in entry:
        scale, tracker = entry["loss_scale"], entry.get("unskipped", 0)
    else:
        _fail(f"{key!r} has neither 'scale' (ampfuse) nor 'loss_scale' (apex); its keys are "
              f"{sorted(entry)}")
    try:
        scale, tracker = float(scale), int(tracker)
    except (TypeError, ValueError):
        _fail(f"{key!r} holds scale={scale!r} and growth tracker={tracker!r}, not numbers")
    if not (math.isfinite(scale) and scale > 0.0) or tracker < 0:
        _fail(f"{key!r} holds scale={scale} and growth tracker={tracker}; the scale must be "
              "finite and > 0 and the tracker >= 0")
    return scale, tracker, entry.get("hysteresis_tracker"), entry.get("skipped_steps")


def _check_masters(handle: Any, saved: list[list[torch.Tensor]]) -> None:
    if len(saved) > len(handle.bindings):
        _fail(f"the state holds masters for {len(saved)} optimizers, but this amp.initialize "
              f"has {len(handle.bindings)}")
    for index, (b, values) in enumerate(zip(handle.bindings, saved)):
        if len(values) != len(b.masters):
            _fail(f"the checkpoint holds {len(values)} master params for optimizer {index}, "
                  f"which has {len(b.masters)}; was it saved from another model?")
        for i, ((_, master), value) in enumerate(zip(b.masters, values)):
            if tuple(value.shape) != tuple(master.shape):
                _fail(f"master param {i} of optimizer {index} has shape {tuple(value.shape)} in "
                      f"the checkpoint and {tuple(master.shape)} here; was it saved from another "
                      "model?")


def _check_unstepped(handle: Any, saved: list[dict[int, torch.Tensor]]) -> None:
    for b, entries in zip(handle.bindings, saved):
        params = optimizer_params(b.inner) if b.fused else []
        for i, value in entries.items():
            if i >= len(params) or params[i].shape != value.shape:
                _fail("the checkpoint's fp32 masters do not match this optimizer's params; was "
                      "it saved from another model?")


def load_state_dict(handle: Any, state: dict[str, Any]) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"amp.load_state_dict: expected the dict amp.state_dict() returned, got "
                        f"a {type(state).__name__}.")
    scaler_keys = sorted((int(m.group(1)), k) for k in state if (m := _SCALER_KEY.match(k)))
    unknown = sorted(k for k in state if not _SCALER_KEY.match(k) and k not in _OUR_KEYS)
    if unknown:
        _fail(f"unexpected keys {unknown}: this is not a state from amp.state_dict() (ampfuse's "
              "or apex's); pass checkpoint['amp'], not the whole checkpoint")
    expected = [f"loss_scaler{i}" for i in range(len(handle.scalers))]
    if [k for _, k in scaler_keys] != expected:
        _fail(f"the state has loss scalers {[k for _, k in scaler_keys]} but amp.initialize was "
              f"given num_losses={len(handle.scalers)} ({expected})")
    values = [_scaler_values(k, state[k]) for k in expected]
    saved_masters = state.get("master_params", [])
    _check_masters(handle, saved_masters)
    _check_unstepped(handle, state.get("unstepped_fused_masters", []))

    # Everything checked: now change things.
    for scaler, (scale, tracker, hysteresis, skipped) in zip(handle.scalers, values):
        scaler.load_state_dict({
            "scale": scale, "growth_tracker": tracker,
            "hysteresis_tracker": scaler.hysteresis if hysteresis is None else hysteresis,
            "skipped_steps": 0 if skipped is None else skipped,
        })
    for b, count in zip(handle.bindings, state.get("skipped_steps", [])):
        if b.skipped is None:
            b.skipped = torch.zeros(1, device=b.device)
        b.skipped.fill_(float(count))
    with torch.no_grad():
        for b, masters in zip(handle.bindings, saved_masters):
            for (p, master), value in zip(b.masters, masters):
                master.copy_(value)
                p.copy_(value)
            b.tracker.mark(p for p, _ in b.masters)
    for b, entries in zip(handle.bindings, state.get("unstepped_fused_masters", [])):
        if not entries:  # always so for a torch.optim optimizer (_check_unstepped)
            continue
        params = optimizer_params(b.inner)
        # A param that stepped since took its master from the optimizer's own checkpoint.
        b.inner.set_masters({params[i]: value.to(params[i].device, torch.float32).clone()
                             for i, value in entries.items()}, keep_stepped=True)
