"""Global and per-tensor L2 norms over tensor lists: typed wrapper and fake kernel (C++ in
csrc/ops/l2norm.cpp).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ampfuse.ops._checks import check_list
from ampfuse.ops._dtensor_hook import register_dtensor_rules
from ampfuse.ops import _library  # noqa: F401  (registers the ops first)


def multi_tensor_l2norm(tensors: Iterable[torch.Tensor],
                        per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(global_norm, per_tensor_norms)`` in fp32. For DTensors (e.g. FSDP2 grads)
    both are the norms of the whole tensors, as Replicate DTensors (see ampfuse.ops.dtensor)."""
    register_dtensor_rules()
    return torch.ops.ampfuse.multi_tensor_l2norm(list(tensors), per_tensor)


@torch.library.register_fake("ampfuse::multi_tensor_l2norm")
def _l2norm_fake(tensors: Sequence[torch.Tensor],
                 per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    device = check_list("multi_tensor_l2norm", "tensors", tensors) or torch.device("cpu")
    global_norm = torch.empty((), dtype=torch.float32, device=device)
    per_tensor_norms = torch.empty(
        (len(tensors) if per_tensor else 0,), dtype=torch.float32, device=device
    )
    return global_norm, per_tensor_norms
