"""O1's function lists as aten operators: which dispatcher ops a list entry stands for, and the
policy table (aten op -> how it is cast) that per_op.py registers for a model.

O1 casts in the dispatcher (csrc/autocast/), where a call is an aten operator: F.linear is
aten::linear, Tensor.softmax is aten::softmax.int, F.cross_entropy is aten::cross_entropy_loss.
An entry names a torch function the way torch spells it ("linear", "softmax", "__matmul__",
"exp_") and stands for every functional overload of the aten op of that name (out= overloads
are left alone: an out= tensor keeps its dtype). The entries of the fp32 list also refuse
their in-place forms on fp16/bf16 tensors, which cannot run in fp32. Python-level torch
functions with no aten op of their own (F.multi_head_attention_forward) are refused: their
aten ops are what the dispatcher sees, and listing those reaches inside them.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from typing import Any

import torch

# Functions O1 always runs in fp32, on every device: softmax, norms, reductions, exp/log/pow
# and losses, where low precision loses accuracy. (CUDA autocast already keeps most of them
# in fp32; CPU autocast leaves several in bf16, so this list makes both devices agree.)
# "cpu": a fp16/bf16 accelerator tensor copied to the host arrives as fp32, as in apex's O1.
FP32_FUNCTIONS = frozenset({
    "softmax", "log_softmax", "softmin", "rms_norm", "normalize", "norm", "exp", "expm1",
    "log", "log1p", "log2", "log10", "pow", "__pow__", "__rpow__", "sum", "mean", "prod",
    "cumsum", "cumprod",
    "logsumexp", "var", "std", "softplus", "cross_entropy", "nll_loss", "mse_loss", "l1_loss",
    "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_similarity", "cpu",
})

# Norms O1 leaves to torch's autocast on each device, where their statistics are fp32 either
# way. layer_norm, group_norm: CUDA autocast runs them in fp32 (as apex's O1 did); CPU
# autocast runs them on the low dtype input with fp32 weights. batch_norm, instance_norm: on
# no autocast list, and apex's O1 left them alone too: with a fp16/bf16 input and the fp32
# weights of an O1 model, cuDNN's and torch's CPU kernels compute the statistics in fp32 and
# round only the output. Listing any of them adds a cast to fp32 and one back per call, for
# one rounding of the output: 1-4% of a step on a LayerNorm-heavy MLP on the CPU; on the H100
# a ResNet-18 O1 step's CUDA self time (torch.profiler, ops and kernels summed) was 30.1 ms
# against torch autocast's 17.8, and it used 1.9x the memory (benchmarks/RESULTS.md).
# custom_black_list=["batch_norm"] (or any of them) gives fp32.
NORMS_LEFT_TO_AUTOCAST = frozenset({"layer_norm", "group_norm", "batch_norm", "instance_norm"})

# Python-level torch functions whose work is one or more aten ops of other names.
_ALIASES = {
    "cross_entropy": ("cross_entropy_loss",),
    "nll_loss": ("nll_loss", "nll_loss_nd", "nll_loss2d"),
    "norm": ("norm", "linalg_vector_norm", "linalg_matrix_norm", "frobenius_norm"),
    # F.normalize divides by a norm: the norm runs in fp32 and the division promotes.
    "normalize": ("linalg_vector_norm", "norm"),
    "softmin": ("softmax",),  # F.softmin is softmax of the negated input
}
# Tensor.cpu() reaches the dispatcher as aten::to.dtype_layout with the tensor's own dtype.
_HOST_COPY = "cpu"
_HOST_COPY_OP = "aten::to.dtype_layout"


@functools.cache
def _aten_overloads() -> dict[str, list[str]]:
    """aten op name -> its overload names ("" for the default) in the dispatcher."""
    overloads: dict[str, list[str]] = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified[len("aten::"):].partition(".")
        overloads.setdefault(name, []).append(overload)
    return overloads


def aten_names(entry: str) -> tuple[str, ...]:
    """The aten op names a list entry stands for (empty when it has none)."""
    ops = _aten_overloads()
    if entry in _ALIASES:
        return _ALIASES[entry]
    if entry in ops:
        return (entry,)
    if entry.startswith("__") and entry.endswith("__"):
        core = entry[2:-2]  # __matmul__ -> matmul, __rpow__ -> pow, __ipow__ -> pow_
        for name in (core, core[1:] if core[:1] == "r" else None,
                     core[1:] + "_" if core[:1] == "i" else None):
            if name and name in ops:
                return (name,)
    return ()


def _qualified(name: str, overload: str) -> str:
    return f"aten::{name}.{overload}" if overload else f"aten::{name}"


def _overloads(name: str, in_place: bool) -> list[str]:
    """Qualified overloads of aten op `name`: the functional ones (no out=), or for an in-place
    op all of them."""
    result = []
    for overload in _aten_overloads().get(name, ()):
        schema = torch._C._get_schema(f"aten::{name}", overload)
        if in_place or not schema.is_mutable:
            result.append(_qualified(name, overload))
    return result


def _ops_of(entry: str) -> tuple[list[str], list[str]]:
    """(functional overloads, in-place overloads) that a list entry stands for."""
    functional: list[str] = []
    in_place: list[str] = []
    for name in aten_names(entry):
        if name.endswith("_"):
            in_place += _overloads(name, in_place=True)
        else:
            functional += _overloads(name, in_place=False)
            if name + "_" in _aten_overloads():
                in_place += _overloads(name + "_", in_place=True)
    return functional, in_place


@functools.cache
def _policies_of(entry: str, policy: str) -> dict[str, str]:
    if entry == _HOST_COPY:
        # Only the fp32 list gives .cpu() a meaning; on another list the entry just takes it
        # off the fp32 list.
        return {_HOST_COPY_OP: "to_host_fp32"} if policy == "fp32" else {}
    functional, in_place = _ops_of(entry)
    table = dict.fromkeys(functional, policy)
    if policy == "fp32":
        # An in-place op keeps its tensor's dtype, so it cannot run in fp32 on fp16/bf16.
        table.update(dict.fromkeys(in_place, "inplace_refused"))
    return table


def policy_table(low: Iterable[str], fp32: Iterable[str],
                 promote: Iterable[str]) -> dict[str, str]:
    """aten op -> policy ("lower", "fp32", "promote", "inplace_refused", "to_host_fp32") for a
    model's lists of entries. Where two entries reach one op the low list wins, then fp32."""
    table: dict[str, str] = {}
    for entries, policy in ((promote, "promote"), (fp32, "fp32"), (low, "lower")):
        for entry in sorted(entries):
            table.update(_policies_of(entry, policy))
    return table


# ---- checking custom lists ---------------------------------------------------------------------


@functools.cache
def _python_torch_functions() -> frozenset[str]:
    """Names of torch's overridable functions and Tensor methods (Python-level or not)."""
    names: set[Any] = set()  # the functions' __name__, None where they have none
    for funcs in torch.overrides.get_overridable_functions().values():
        names.update(getattr(f, "__name__", None) for f in funcs)
    names.discard(None)
    return frozenset(names)


@functools.cache
def _known_entries() -> frozenset[str]:
    names = set(_aten_overloads()) | set(_ALIASES) | {_HOST_COPY}
    return frozenset(n for n in names | _python_torch_functions() if aten_names(n)
                     or n == _HOST_COPY)


def _entries(value: object, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(
            f"amp.initialize: {what} must be a list of function names, e.g. "
            f"{what}=['softmax'], got {value!r}."
        )
    for entry in value:
        if not isinstance(entry, str):
            named = getattr(entry, "__name__", None)
            hint = f" Write its name instead: {named!r}." if named in _known_entries() else ""
            raise TypeError(
                f"amp.initialize: {what} entries are function names (strings); got {entry!r}."
                + hint
            )
    return list(value)


def check_entry(entry: str, where: str) -> None:
    """Raises ValueError unless `entry` names an aten op (directly or as a torch function that
    is one), with a suggestion for a misspelling."""
    if entry in _known_entries():
        return
    if entry in _python_torch_functions():
        raise ValueError(
            f"{where}: {entry!r} is a Python-level torch function with no aten operator of "
            "its own. O1 casts in the dispatcher, where the aten operators it calls are seen, "
            "inside it too: list those instead (for attention: 'linear', 'softmax', "
            "'baddbmm', 'bmm'), or decorate your own function with @amp.float_function / "
            "@amp.half_function."
        )
    close = difflib.get_close_matches(entry, _known_entries(), n=3)
    hint = (f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else
            " Entries are names as torch calls them, e.g. 'linear', 'matmul', 'softmax'.")
    raise ValueError(
        f"{where}: {entry!r} is not the name of any torch function or aten operator, "
        f"so it would never match anything.{hint}"
    )


def check_custom_lists(white: object, black: object) -> None:
    """Checks amp.initialize's custom_white_list and custom_black_list: lists of names, each
    naming an aten op or a torch function that is one (an entry that matches nothing would
    silently do nothing), and no name in both. Raises TypeError or ValueError naming the
    entry."""
    white_names = _entries(white, "custom_white_list")
    black_names = _entries(black, "custom_black_list")
    for what, names in (("custom_white_list", white_names), ("custom_black_list", black_names)):
        for name in names:
            check_entry(name, f"amp.initialize: {what} entry")
    both = sorted(set(white_names) & set(black_names))
    if both:
        raise ValueError(
            f"amp.initialize: {both} in both custom_white_list and custom_black_list; a function "
            "runs either in the low dtype (white) or in fp32 (black), so keep each name in one."
        )
