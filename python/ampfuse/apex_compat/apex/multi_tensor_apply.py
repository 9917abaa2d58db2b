"""apex.multi_tensor_apply on ampfuse: ``multi_tensor_applier``, the launcher of apex's amp_C
kernels. ampfuse has no amp_C, so, as in an apex built without its CUDA extensions, it reports
``available = False`` (the check scripts make before importing amp_C) and calling it raises,
naming ampfuse's fused ops instead. apex's ImageNet example imports it among its apex imports
without using it; with this module that import no longer fails.
"""

from __future__ import annotations

__all__ = ["MultiTensorApply", "multi_tensor_applier"]

# A package to the import system, as apex.contrib.optimizers is (see there): an apex submodule
# the alias lacks then gets the alias's message, not "is not a package".
__path__ = []


class MultiTensorApply:
    available = False
    warned = False
    import_err = ModuleNotFoundError("No module named 'amp_C' (apex here is ampfuse's alias)")

    def __init__(self, chunk_size):
        self.chunk_size = chunk_size

    def check_avail(self):
        raise RuntimeError(
            "apex.multi_tensor_apply.multi_tensor_applier: apex here is ampfuse's compatibility "
            "alias, which has no amp_C kernels to apply. Use ampfuse's fused list ops instead "
            "(ampfuse.multi_tensor_scale_, multi_tensor_unscale_, multi_tensor_l2norm, ...).")

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        self.check_avail()


multi_tensor_applier = MultiTensorApply(2048 * 32)
