"""ampfuse's ops: typed Python wrappers over ``torch.ops.ampfuse.*``, one module per op family.

Importing this package loads the native library (``_library``), which registers every op with
the dispatcher, and each family module registers its op's fake (meta) kernel, so
torch.compile, FakeTensor and ``torch.library.opcheck`` can trace them. This package is the
bottom layer of ampfuse's Python side: it imports nothing of ampfuse but the native library,
and every other module calls the ops through it.

=================  ==========================================================================
module             ops
=================  ==========================================================================
``scale``          ``multi_tensor_unscale_``, ``multi_tensor_scale_``,
                   ``multi_tensor_nonfinite_check_``
``l2norm``         ``multi_tensor_l2norm``
``update_scale``   ``update_scale_``
``adam``           ``fused_adam_``, ``fused_adam_coded_``
``sgd``            ``fused_sgd_``
``adagrad``        ``fused_adagrad_``
``lamb``           ``fused_lamb_``, ``fused_lamb_coded_``
``novograd``       ``fused_novograd_``
``fp8``            ``fp8_cast_amax``, ``fp8_update_scales_``, ``fp8_gemm``, ``fp8_transpose``,
                   ``fp8_tensor_scale``, ``fp8_cast_transpose``, ``fp8_cast_transpose_dbias``,
                   ``fp8_quantize_rowwise``
``dtensor``        the DTensor rules of the list ops (FSDP2), registered on first use
``step_scan``      the fused optimizers' host-side helpers (not ops)
=================  ==========================================================================
"""

from ampfuse.ops._checks import HELD_INF, HELD_NAN
from ampfuse.ops._library import OP_NAMES, cuda_available, cuda_status
from ampfuse.ops.adagrad import fused_adagrad_
from ampfuse.ops.adam import fused_adam_, fused_adam_coded_
from ampfuse.ops.fp8 import (
    fp8_cast_amax,
    fp8_cast_transpose,
    fp8_cast_transpose_dbias,
    fp8_gemm,
    fp8_quantize_rowwise,
    fp8_tensor_scale,
    fp8_transpose,
    fp8_update_scales_,
)
from ampfuse.ops.l2norm import multi_tensor_l2norm
from ampfuse.ops.lamb import fused_lamb_, fused_lamb_coded_
from ampfuse.ops.novograd import fused_novograd_
from ampfuse.ops.scale import (
    multi_tensor_nonfinite_check_,
    multi_tensor_scale_,
    multi_tensor_unscale_,
)
from ampfuse.ops.sgd import fused_sgd_
from ampfuse.ops.update_scale import update_scale_

__all__ = [
    # multi-tensor list ops
    "multi_tensor_unscale_",
    "multi_tensor_scale_",
    "multi_tensor_nonfinite_check_",
    "multi_tensor_l2norm",
    # dynamic loss scale
    "update_scale_",
    # fused optimizer steps
    "fused_adam_",
    "fused_adam_coded_",
    "fused_sgd_",
    "fused_adagrad_",
    "fused_lamb_",
    "fused_lamb_coded_",
    "fused_novograd_",
    # FP8
    "fp8_cast_amax",
    "fp8_update_scales_",
    "fp8_gemm",
    "fp8_transpose",
    "fp8_tensor_scale",
    "fp8_cast_transpose",
    "fp8_cast_transpose_dbias",
    "fp8_quantize_rowwise",
    # the bits of tensor_flags
    "HELD_INF",
    "HELD_NAN",
    # what the native library holds
    "OP_NAMES",
    "cuda_available",
    "cuda_status",
]
