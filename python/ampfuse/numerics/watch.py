"""Numerics you can see: which dtype each op of a model ran in, and how close its values come to
fp16's limits.

    with ampfuse.numerics.watch(model) as w:
        loss = loss_fn(model(x), y)
        loss.backward()
    print(w.report())
    black = w.suggest_black_list(dtype=torch.float16, loss_scale=2.0**16)

Three things are installed on entering the `with` and removed on leaving it (an exception
included), so a model that is not watched pays nothing:

- forward pre/post hooks on every submodule, which keep the stack of running modules (ops are
  attributed to the innermost one), record each module's output (and, for the suggestions, its
  input) and put a hook on each output that needs a gradient, which records the gradient;
- a TorchDispatchMode. It sits below the Autocast and Autograd keys, so it sees the ops that
  really ran: autocast's casts, the low-precision matmul, the fp32 softmax of O1's list, and the
  backward's ops (attributed to the module whose forward created their autograd node, from the
  node's sequence number);
- a TorchFunctionMode that notes which torch functions each module calls: custom lists name
  those (F.linear is `linear` to O1's lists, while the dispatcher below it runs `addmm`).

Statistics stay on the tensors' device (a running absmax and a histogram of binary exponents
read from the values' bits, updated in place): nothing is read back to the host until report()
or the suggestions ask for it. Each tensor is measured once (a module's output is usually its
last op's). Values are recorded as they were computed: a gradient recorded under a loss scale
is the scaled gradient.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch._ops import OpOverload
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakTensorKeyDictionary

from ampfuse.numerics._segments import ForwardSegments
from ampfuse.numerics._stats import (
    FP16_MAX,
    FP16_TINY,
    Counts,
    Flag,
    Report,
    Row,
    Stat,
    StatKey,
    format_rows,
    measure,
)
from ampfuse.numerics._flags import check_limits, find_flags

if TYPE_CHECKING:
    from typing import Self

__all__ = ["watch", "Watch", "Row", "Report", "Flag", "format_rows"]

OUTSIDE = "(outside)"  # ops run outside every module's forward: a loss, an optimizer step
ROOT = "(model)"  # the watched model itself (named "" by named_modules)


def _first_float(values: Any) -> torch.Tensor | None:
    for value in tree_leaves(values):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    return None


def _fp16_headroom(absmax: float) -> float:
    """log2(65504 / absmax): +inf for an all-zero tensor, -inf once an inf was seen (the
    tensor overflowed), nan when nothing was measured."""
    if math.isnan(absmax):
        return math.nan
    if absmax == 0:
        return math.inf
    return -math.inf if math.isinf(absmax) else math.log2(FP16_MAX / absmax)


def _plain(tensor: torch.Tensor | None) -> bool:
    """Only ordinary dense tensors are measured (not meta, fake or subclass tensors)."""
    return (tensor is not None and type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and tensor.layout == torch.strided and tensor.device.type != "meta")


class _OpMode(TorchDispatchMode):
    """Records every op that computes floating values (views and aliases are skipped)."""

    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func: OpOverload, types: Collection[type],
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        watch = self.watch
        if watch._quiet:
            return out
        returns = func._schema.returns
        if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
            return out  # a view: no new values
        tensor = _first_float(out)
        dtype_of = tensor if tensor is not None else _first_float((args, kwargs))
        if dtype_of is None:
            return out
        node = torch._C._current_autograd_node()
        if node is None:
            module, phase = watch._current(), "forward"
        else:
            module, phase = watch._module_of_node(node), "backward"
        watch._record(module, phase, func.overloadpacket.__name__, dtype_of.dtype,
                      tensor if _plain(tensor) else None)
        return out


class _NameMode(TorchFunctionMode):
    """Notes the torch functions each module's forward calls (the names custom lists use)."""

    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type],
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        watch = self.watch
        if not watch._quiet and watch._stack:
            name = getattr(func, "__name__", None)
            if name is not None:
                watch._called.setdefault(watch._stack[-1], set()).add(name)
        return func(*args, **(kwargs or {}))


class Watch:
    """What watch(model) returns: a context manager that records while it is entered, and keeps
    what it recorded for report(), flags() and suggest_black_list() afterwards. It can be
    entered again to record more (the statistics add up)."""

    # models inside a `with` now: one watch per model at a time
    _watched: ClassVar[weakref.WeakSet[torch.nn.Module]] = weakref.WeakSet()

    def __init__(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"numerics.watch: expected a torch.nn.Module, got {type(model)}. "
                            "Pass the model whose forward you run inside the `with`.")
        self.model = model
        self._stats: dict[StatKey, Stat] = {}  # in first-seen order
        # module -> names of the torch functions its forward called
        self._called: dict[str, set[str]] = {}
        # (hook handles, entered modes) while inside the `with`
        self._installed: tuple[list[RemovableHandle], list[Any]] | None = None
        self._stack: list[str] = []
        self._measured = WeakTensorKeyDictionary()  # tensor -> (version, measure(tensor))
        self._quiet = 0  # > 0 while the watch computes statistics of its own
        # Where each module's forward starts and ends in autograd's node count, to attribute
        # the backward's ops to modules. Kept across re-entries: a backward in a later `with`
        # than its forward is still attributed.
        self._segments = ForwardSegments(OUTSIDE)
        self._root_start: int | None = None  # the node count when the running root forward began

    # ---- entering and leaving ------------------------------------------------------------------

    def __enter__(self) -> Self:
        if self._installed is not None:
            raise RuntimeError("numerics.watch: this watch is already active; leave its `with` "
                               "before entering it again.")
        if self.model in Watch._watched:
            raise RuntimeError("numerics.watch: this model is already being watched; nest the "
                               "code in the existing `with` instead of a second watch.")
        handles: list[RemovableHandle] = []
        modes: list[Any] = []
        self._installed = (handles, modes)
        self._stack, self._root_start = [], None
        self._mark()  # from here until a forward starts: outside the model
        Watch._watched.add(self.model)
        try:
            for name, module in self.model.named_modules():
                name = name or ROOT
                handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
                handles.append(module.register_forward_hook(self._post_hook(name),
                                                            always_call=True))
            for mode in (_OpMode(self), _NameMode(self)):
                mode.__enter__()
                modes.append(mode)
        except BaseException:
            self._uninstall()
            raise
        return self

    def __exit__(self, *exc_info: object) -> Literal[False]:
        self._uninstall()
        return False

    def _uninstall(self) -> None:
        assert self._installed is not None  # called inside the `with` only
        handles, modes = self._installed
        try:
            for mode in reversed(modes):
                mode.__exit__(None, None, None)
        finally:
            for handle in handles:
                handle.remove()
            self._installed = None
            self._stack, self._root_start = [], None
            self._measured = WeakTensorKeyDictionary()
            Watch._watched.discard(self.model)

    @property
    def active(self) -> bool:
        """True inside the `with`."""
        return self._installed is not None

    # ---- recording -----------------------------------------------------------------------------

    def _current(self) -> str:
        return self._stack[-1] if self._stack else OUTSIDE

    def _mark(self) -> None:
        self._segments.mark(self._current())

    def _module_of_node(self, node: torch.autograd.graph.Node) -> str:
        return self._segments.module_of(node)

    def _measure(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """measure(tensor), once per tensor and version: a module's output is usually the
        output of its last op, and its input the previous module's output."""
        cached = self._measured.get(tensor)
        if cached is not None and cached[0] == tensor._version:
            return cached[1]
        measured = measure(tensor)
        self._measured[tensor] = (tensor._version, measured)
        return measured

    def _record(self, module: str, phase: str, op: str, dtype: torch.dtype,
                tensor: torch.Tensor | None) -> None:
        key = (module, phase, op, dtype)
        stat = self._stats.get(key)
        if stat is None:
            stat = self._stats[key] = Stat()
        if tensor is None or not tensor.numel():
            stat.add(0, None)
            return
        # The modes see the statistics' own ops; _quiet makes them pass those by.
        self._quiet += 1
        try:
            with torch.no_grad(), torch.autocast(tensor.device.type, enabled=False):
                stat.add(tensor.numel(), self._measure(tensor))
        finally:
            self._quiet -= 1

    def _record_values(self, module: str, phase: str, what: str, values: Any) -> None:
        for value in tree_leaves(values):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and _plain(value):
                self._record(module, phase, what, value.dtype, value)

    def _pre_hook(self, name: str) -> Callable[[torch.nn.Module, tuple[Any, ...]], None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if self._quiet:
                return
            if not self._stack:
                self._root_start = self._segments.next_number()
            self._stack.append(name)
            self._mark()
            self._record_values(name, "forward", "input", args)
        return hook

    def _post_hook(self, name: str) -> Callable[[torch.nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._quiet or not self._stack or self._stack[-1] != name:
                return None
            self._stack.pop()
            self._mark()
            if not self._stack and self._root_start is not None:
                leaves = tree_leaves(output) if output is not None else []
                self._segments.release_with(self._root_start, leaves)
                self._root_start = None
            if output is None:
                return None  # the forward raised
            self._record_values(name, "forward", "output", output)
            if torch.is_grad_enabled():
                for value in tree_leaves(output):
                    if (isinstance(value, torch.Tensor) and value.is_floating_point()
                            and value.requires_grad):
                        value.register_hook(self._grad_hook(name))
            return None
        return hook

    def _grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self._installed is not None and grad is not None and _plain(grad):
                self._record_values(name, "backward", "grad", grad)
        return hook

    # ---- reading -------------------------------------------------------------------------------

    def _read(self) -> dict[StatKey, Counts]:
        """key -> Counts, with one transfer per device."""
        by_device: dict[torch.device, list[StatKey]] = {}
        for key, stat in self._stats.items():
            if stat.absmax is not None:
                by_device.setdefault(stat.absmax.device, []).append(key)
        values: dict[StatKey, tuple[float, list[int]]] = {}
        for keys in by_device.values():
            stats = [self._stats[k] for k in keys]  # measured ones: absmax and hist are set
            absmax = torch.stack([s.absmax for s in stats]).cpu().tolist()  # type: ignore[misc]
            hists = torch.stack([s.hist for s in stats]).cpu().tolist()  # type: ignore[misc]
            values.update(zip(keys, zip(absmax, hists)))
        return {key: Counts(stat.calls, stat.numel, *values.get(key, (math.nan, None)))
                for key, stat in self._stats.items()}

    def report(self) -> Report:
        """One Row per (module, phase, op or "output"/"grad", dtype), in the order first seen.
        Reads the statistics back from the device (this syncs)."""
        rows = Report()
        for (module, phase, op, dtype), c in self._read().items():
            if op == "input":
                continue
            rows.append(Row(module, phase, op, dtype, c.calls, c.absmax, c.below(FP16_TINY),
                            _fp16_headroom(c.absmax)))
        return rows

    def format(self) -> str:
        """report() as a table."""
        return format_rows(self.report())

    def flags(self, dtype: torch.dtype = torch.float16, loss_scale: float | torch.Tensor = 1.0,
              underflow: float = 0.01) -> list[Flag]:
        """The modules whose values would overflow or underflow in `dtype`: forward outputs as
        they are, gradients times `loss_scale`. An output counts when it is beyond the limit and
        the module's input was not (the module made it so: a ReLU after an overflowing layer is
        not flagged); underflow means more than `underflow` of the values are nonzero and below
        dtype's smallest normal."""
        dtype, loss_scale, underflow = check_limits(dtype, loss_scale, underflow)
        return find_flags(self._read(), self._called, dtype, loss_scale, underflow)

    def suggest_black_list(self, dtype: torch.dtype = torch.float16,
                           loss_scale: float | torch.Tensor = 1.0,
                           underflow: float = 0.01) -> list[str]:
        """Names of the functions called by the modules flags() finds, ready for
        amp.initialize(custom_black_list=...): at O1 they then run in fp32. Lists are
        model-wide: a name runs in fp32 wherever the model calls it."""
        names = {n for flag in self.flags(dtype, loss_scale, underflow) for n in flag.names}
        return sorted(names)


def watch(model: torch.nn.Module) -> Watch:
    """A context manager that records, per module, the dtype each op ran in and how close the
    values and gradients come to fp16's limits. See the module's documentation."""
    return Watch(model)
