"""A probe at the dispatcher for the amp casting tests: which aten ops ran, on which dtypes."""

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class AtenDtypes(TorchDispatchMode):
    """Records every aten op that runs with the set of dtypes of its floating tensor inputs.

    A TorchDispatchMode sits under autocast and amp's TorchFunctionMode, so it sees the dtypes
    the ops really received after every cast was applied."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtypes = frozenset(
            t.dtype for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        )
        self.calls.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **kwargs)

    def dtypes_of(self, *names):
        """The input dtypes of each call of the named ops, in order; fails if none ran."""
        found = [dtypes for name, dtypes in self.calls if name in names]
        assert found, f"no {names} call ran; the ops were {[n for n, _ in self.calls]}"
        return found
