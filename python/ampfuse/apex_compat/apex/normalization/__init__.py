"""apex.normalization: FusedLayerNorm and FusedRMSNorm (and the Mixed variants) on torch."""

from ampfuse.apex_compat.apex.normalization import fused_layer_norm
from ampfuse.apex_compat.apex.normalization.fused_layer_norm import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
)

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm",
           "fused_layer_norm"]
