"""FP8 training with delayed scaling: ``DelayedScaling`` (the recipe), ``Linear`` (an
nn.Linear whose GEMMs run in FP8) and ``update_scales`` (once per optimizer step).

On CUDA the GEMMs run through cuBLASLt (compute capability 8.9 or newer); on the CPU the same
quantization is emulated in fp32, so FP8 numerics are testable anywhere.
"""

from ampfuse.fp8.linear import Linear
from ampfuse.fp8.recipe import DelayedScaling
from ampfuse.fp8.scaling import fp8_modules, update_scales

__all__ = ["DelayedScaling", "Linear", "fp8_modules", "update_scales"]
