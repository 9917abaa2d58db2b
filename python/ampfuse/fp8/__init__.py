"""FP8 training for nn.Linear layers.

Recipes: ``CurrentScaling`` (the default: each tensor's scale from its own amax, this step),
``RowwiseScaling`` (one scale per row) and ``DelayedScaling`` (scales from an amax history).
``convert(model, ...)`` turns the Linears worth it into ``Linear`` (FP8 GEMMs) and says why for
each; ``update_scales`` moves delayed scaling's scales once per optimizer step; ``invalidate``
drops cached FP8 weights after a write through ``.data``.

On CUDA the GEMMs run through cuBLASLt (compute capability 8.9 or newer; rowwise scaling falls
back to torch._scaled_mm where ampfuse's cuBLASLt path cannot run, see
``RowwiseScaling.gemm_backend``); on the CPU the same quantization is emulated in fp32, so FP8
numerics are testable anywhere.
"""

from ampfuse.fp8.convert import AUTO_MIN_FEATURES, convert
from ampfuse.fp8.linear import Linear
from ampfuse.fp8.recipe import CurrentScaling, DelayedScaling, Recipe, RowwiseScaling
from ampfuse.fp8.scaling import fp8_modules, invalidate, update_scales

__all__ = ["AUTO_MIN_FEATURES", "CurrentScaling", "DelayedScaling", "Linear", "Recipe",
           "RowwiseScaling", "convert", "fp8_modules", "invalidate", "update_scales"]
