"""Which gradients overflowed: the report behind ``GradScaler.last_overflow()`` and
``amp.last_overflow()``.

The unscale and check kernels already read every gradient element once to raise ``found_inf``.
Given a ``tensor_flags`` tensor (one int32 per gradient) they also OR ``HELD_INF`` / ``HELD_NAN``
into the element of each gradient that held such a value, in the same pass, written only by the
threads that saw one: a clean step writes nothing and nothing is read back. A ``CheckRecord``
keeps those device flags with the params they belong to; it is read (a host sync) only when a
report is asked for.

Names: a ``ParamNames`` knows models (their ``named_parameters()``, looked up when a report is
made, so a model whose params were replaced is named as it is now) and explicit ``(name, param)``
pairs. A param it does not know is named by its place in the optimizer, ``"group0.param7"``.
Every report and summary names a param through ``report_name``, and finds its place through
``place_in_groups``; error messages name it as the user reaches it, ``param_name``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ampfuse.ops import HELD_INF, HELD_NAN

__all__ = ["OverflowReport", "ParamNames", "CheckRecord", "OverflowRecords"]

_KINDS = {HELD_INF: "inf", HELD_NAN: "nan", HELD_INF | HELD_NAN: "inf and nan"}


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """The gradients that held inf/nan when an optimizer step was skipped.

    Attributes:
        step: the 0-based index of the optimizer step the overflow skipped: how many steps of
            that optimizer (taken or skipped) came before it, counted by the scaler or amp
            since it was created.
        param_names: the params whose gradients held inf or nan, in optimizer order; empty
            when the step was skipped for an overflow seen elsewhere (another rank's flag, or
            another optimizer of the same amp.scale_loss).
        kinds: for each name, "inf", "nan" or "inf and nan".
    """

    step: int
    param_names: list[str]
    kinds: list[str]

    def __str__(self) -> str:
        if not self.param_names:
            return (
                f"overflow at step {self.step}: no gradient checked here held inf/nan; the step "
                "was skipped for an overflow seen by another rank or optimizer"
            )
        named = ", ".join(f"{n} ({k})" for n, k in zip(self.param_names, self.kinds))
        count = len(self.param_names)
        return f"overflow at step {self.step} in {count} tensor{'s' * (count != 1)}: {named}"


def param_name(group_index: int, param_index: int) -> str:
    """How error messages name a param: the way the user would reach it through the optimizer."""
    return f"param_groups[{group_index}]['params'][{param_index}]"


def position_name(group_index: int, param_index: int) -> str:
    """The name of a param no model names: its place in the optimizer."""
    return f"group{group_index}.param{param_index}"


def report_name(known: dict[int, str], param: torch.Tensor, group_index: int,
                param_index: int) -> str:
    """How overflow reports and summaries name `param`: the name `known` ({id(param): name},
    from ParamNames.lookup()) gives it, else its place in the optimizer (position_name)."""
    return known.get(id(param)) or position_name(group_index, param_index)


def place_in_groups(param_groups: list[dict], param: torch.Tensor) -> tuple[int, int]:
    """(group index, param index) of `param` in an optimizer's param groups; (-1, -1) once it
    left them."""
    for group_index, group in enumerate(param_groups):
        for param_index, p in enumerate(group["params"]):
            if p is param:
                return group_index, param_index
    return -1, -1


class _Names(Protocol):
    """What CheckRecord.report() asks of the names it is given (ParamNames, or an optimizer's
    own names of its param groups)."""

    def lookup(self) -> dict[int, str]: ...


class ParamNames:
    """Module-qualified names for params, from models and (name, param) pairs."""

    def __init__(self) -> None:
        # weak references: a report never keeps a model alive
        self._models: list[weakref.ref[torch.nn.Module]] = []
        self._pairs = WeakIdKeyDictionary()

    def add(self, source: torch.nn.Module | Iterable[tuple[str, torch.Tensor]], what: str) -> None:
        """`source`: an nn.Module, or an iterable of (name, param) pairs such as
        model.named_parameters()."""
        if isinstance(source, torch.nn.Module):
            if not any(ref() is source for ref in self._models):
                self._models.append(weakref.ref(source))
            return
        if isinstance(source, (str, bytes, torch.Tensor)) or not hasattr(source, "__iter__"):
            raise TypeError(
                f"{what}: expected an nn.Module or an iterable of (name, param) pairs such as "
                f"model.named_parameters(), got a {type(source).__name__}."
            )
        pairs = list(source)
        for i, pair in enumerate(pairs):
            ok = (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                  and isinstance(pair[1], torch.Tensor))
            if not ok:
                raise TypeError(
                    f"{what}: item {i} is {pair!r}, not a (name, param) pair; pass "
                    "model.named_parameters() or a list of (str, Tensor) tuples."
                )
        for name, param in pairs:
            self._pairs[param] = name

    # Pickled (and deep-copied) with what holds it: amp's handle travels with its models, whose
    # copies it then names. Held weakly again once loaded.
    def __getstate__(self) -> dict[str, Any]:
        models = [ref() for ref in self._models]
        return {"models": [m for m in models if m is not None],
                "pairs": list(self._pairs.items())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self._models = [weakref.ref(m) for m in state["models"]]
        for param, name in state["pairs"]:
            self._pairs[param] = name

    def lookup(self) -> dict[int, str]:
        """{id(param): name} as the models and pairs are now (pairs win over models)."""
        names: dict[int, str] = {}
        self._models = [ref for ref in self._models if ref() is not None]
        for ref in self._models:
            module = ref()  # alive: just kept for it
            named = module.named_parameters(remove_duplicate=False)  # type: ignore[union-attr]
            for name, param in named:
                names.setdefault(id(param), name)
        names.update((id(param), name) for param, name in self._pairs.items())
        return names


class CheckRecord:
    """What the overflow checks of one optimizer step saw.

    calls: for each op call, the params whose gradients it read, as (group index, param index,
    param) in the op's list order (the indices may be None, see report()), and the device int32
    flags it wrote. verdict: the flags that decided whether the step was skipped (found_inf,
    after any all-reduce), device tensors or bools."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.calls: list[tuple[Any, torch.Tensor]] = []
        self.verdict: list[Any] = []

    def add(self, where: Any, flags: torch.Tensor) -> None:
        self.calls.append((where, flags))

    def set_verdict(self, *flags: Any) -> None:
        self.verdict = list(flags)

    def report(self, names: _Names | None,
               locate: Callable[[torch.Tensor], tuple[int, int]] | None = None
               ) -> OverflowReport | None:
        """None after a clean step, else an OverflowReport. Reads the device flags (a sync).
        locate(param) gives (group index, param index) for entries recorded without them."""
        if not any(bool(v.detach().ne(0).any()) if isinstance(v, torch.Tensor) else bool(v)
                   for v in self.verdict):
            return None
        known = names.lookup() if names is not None else {}
        held: dict[str, list[Any]] = {}  # name -> [place in the optimizer, bits]
        for where, flags in self.calls:
            for (group_index, param_index, param), bits in zip(where, flags.tolist()):
                if bits:
                    if group_index is None:
                        # Recorded without places only by an optimizer's own check, whose
                        # report passes locate.
                        group_index, param_index = locate(param)  # type: ignore[misc]
                    name = report_name(known, param, group_index, param_index)
                    entry = held.setdefault(name, [(group_index, param_index), 0])
                    entry[1] |= bits
        # Calls go by device and path (ours, float64 to torch's): report in optimizer order.
        ordered = sorted(held.items(), key=lambda item: item[1][0])
        return OverflowReport(self.step, [name for name, _ in ordered],
                              [_KINDS[bits] for _, (_, bits) in ordered])


class OverflowRecords:
    """The latest CheckRecord and the step count of each optimizer a scaler checks.

    Keyed by id(optimizer) with a weak reference to check identity, as GradScaler keys its own
    per-optimizer records; the names are shared by all optimizers."""

    def __init__(self) -> None:
        self.names = ParamNames()
        # id(optimizer) -> (weakref, CheckRecord)
        self._latest: dict[int, tuple[weakref.ref[Any], CheckRecord]] = {}
        # id(optimizer) -> (weakref, steps so far)
        self._steps: dict[int, tuple[weakref.ref[Any], int]] = {}

    def _live(self, table: dict[int, tuple[weakref.ref[Any], Any]], optimizer: object) -> Any:
        entry = table.get(id(optimizer))
        return entry[1] if entry is not None and entry[0]() is optimizer else None

    def begin(self, optimizer: object) -> CheckRecord:
        """A new record for this step of `optimizer`, replacing the previous one."""
        record = CheckRecord(self._live(self._steps, optimizer) or 0)
        self._latest[id(optimizer)] = (weakref.ref(optimizer), record)
        return record

    def record_of(self, optimizer: object) -> CheckRecord | None:
        return self._live(self._latest, optimizer)

    def records_by_id(self, key: int) -> list[CheckRecord]:
        """The latest record of the optimizer whose id is `key` (GradScaler's own key), if
        that optimizer is alive: a list of zero or one."""
        entry = self._latest.get(key)
        return [entry[1]] if entry is not None and entry[0]() is not None else []

    def stepped(self, optimizer: object) -> None:
        """One more step (taken or skipped) of `optimizer`."""
        count = self._live(self._steps, optimizer) or 0
        self._steps[id(optimizer)] = (weakref.ref(optimizer), count + 1)

    def last_overflow(self, optimizer: object, what: str) -> OverflowReport | None:
        if optimizer is None:
            live = [entry for entry in self._latest.values() if entry[0]() is not None]
            if len(live) > 1:
                raise ValueError(
                    f"{what}: {len(live)} optimizers were checked; pass the optimizer whose "
                    "last step you are asking about."
                )
            record = live[0][1] if live else None
        else:
            record = self.record_of(optimizer)
        return None if record is None else record.report(self.names)

    # A copy (pickle, deepcopy) keeps no history: its optimizers are other objects, and models
    # are held weakly. Names must be given again.
    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
