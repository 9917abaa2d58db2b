"""ampfuse: fused mixed-precision training for PyTorch.

Importing ampfuse loads its op library, which registers the fused ops as
``torch.ops.ampfuse.*``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ampfuse.ops import (
    _library,
    cuda_available,
    cuda_status,
    fused_adam_,
    fused_sgd_,
    multi_tensor_l2norm,
    multi_tensor_scale_,
    multi_tensor_unscale_,
    update_scale_,
)

from ampfuse import optimizers  # noqa: E402  (needs the ops registered above)
from ampfuse.apex_compat import install_apex_alias, uninstall_apex_alias  # noqa: E402
from ampfuse import amp  # noqa: E402
from ampfuse.scaling import GradScaler, LossScaler  # noqa: E402

# "0.2.0+pt211cu130": the torch and CUDA the op library was built against, as the wheel names it.
__version__: str = _library.BUILD_INFO["version"]

if TYPE_CHECKING:
    from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    # ampfuse.numerics on first use: its dispatch-mode machinery is not needed to train.
    if name == "numerics":
        import importlib

        return importlib.import_module("ampfuse.numerics")
    raise AttributeError(f"module 'ampfuse' has no attribute {name!r}")

__all__ = [
    "GradScaler",
    "LossScaler",
    "amp",
    "cuda_available",
    "cuda_status",
    "fused_adam_",
    "fused_sgd_",
    "install_apex_alias",
    "multi_tensor_l2norm",
    "multi_tensor_scale_",
    "multi_tensor_unscale_",
    "numerics",
    "optimizers",
    "uninstall_apex_alias",
    "update_scale_",
]
