"""Which module's forward created an autograd node, for numerics.watch's backward attribution.

Autograd numbers the nodes it creates on a thread in order (the sequence number). Marking the
next number each time the innermost running module changes splits that count into segments,
one module each; a node belongs to the segment its number falls in.

The segments of a forward are kept only while its graph can still be run backward. A root
forward's outputs carry a token in their nodes' metadata; when the last of those nodes is freed
(the user dropped the outputs and the loss after the backward), no node of that forward is
left to look up, and its segments go. Marks made while no node was created (under no_grad, in
eval) share a number and replace one another, and a mark that names the module of the
one before it is not made. So a watch left on for a long run holds the
segments of the graphs alive now, not two per module call since it began.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable

import torch

_NO_SEQUENCE_NR = 2**64 - 1  # an AccumulateGrad node's sequence number
_TOKEN_KEY = "ampfuse.numerics.watch"


class _Token:
    """Lives in the metadata of a root forward's output nodes; dies with the last of them."""


class ForwardSegments:
    def __init__(self, outside: str) -> None:
        self._outside = outside
        # (sequence number, module), sorted by the number
        self._marks: list[tuple[int, str]] = []

    def __len__(self) -> int:
        return len(self._marks)

    @staticmethod
    def next_number() -> int:
        return torch._C._autograd._get_sequence_nr()

    def mark(self, module: str) -> None:
        """Nodes created from now on belong to `module`."""
        mark = (self.next_number(), module)
        marks = self._marks
        if marks and marks[-1][0] == mark[0]:
            marks.pop()  # no node was created since: the old mark covers nothing
        if not marks or marks[-1][1] != module:
            marks.append(mark)

    def module_of(self, node: torch.autograd.graph.Node) -> str:
        seq = node._sequence_nr()
        if seq == _NO_SEQUENCE_NR:
            return self._outside  # AccumulateGrad, which has no forward
        # Nodes count on the forward's thread; the backward may run on another (CUDA's).
        at = bisect.bisect_right(self._marks, seq, key=_number) - 1
        return self._marks[at][1] if at >= 0 else self._outside

    def release_with(self, start: int, outputs: Iterable[object]) -> None:
        """The segments from sequence number `start` to now belong to one root forward whose
        outputs are `outputs` (tensors): they are dropped once the nodes of those outputs are
        all freed. A forward whose outputs need no gradient made no node to look up later."""
        nodes = {id(t.grad_fn): t.grad_fn for t in outputs
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        end = self.next_number()
        if not nodes:
            self._forget(start, end)
            return
        token = _Token()
        for node in nodes.values():
            # (torch's stubs declare Node.metadata a method; it is a dict property)
            node.metadata[_TOKEN_KEY + f".{id(self)}.{start}"] = token  # type: ignore[index]
        this = weakref.ref(self)
        weakref.finalize(token, ForwardSegments._forget_if_alive, this, start, end)

    @staticmethod
    def _forget_if_alive(this: weakref.ref[ForwardSegments], start: int, end: int) -> None:
        segments = this()
        if segments is not None:
            segments._forget(start, end)

    def _forget(self, start: int, end: int) -> None:
        """Drops the marks in [start, end). The root forward's closing mark, at `end`, stays:
        the nodes made after the forward fall in it."""
        marks = self._marks
        lo = bisect.bisect_left(marks, start, key=_number)
        hi = bisect.bisect_left(marks, end, key=_number)
        del marks[lo:hi]
        if 0 < lo < len(marks) and marks[lo - 1][1] == marks[lo][1]:
            del marks[lo]  # the marks now side by side say the same


def _number(mark: tuple[int, str]) -> int:
    return mark[0]
