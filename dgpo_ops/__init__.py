"""dgpo-ops: fused, exact RL policy losses for LLM reasoning."""

from .aggregation import AGGREGATIONS, token_scales
from .fused import DGPOLoss, fused_dgpo_loss
from .fused_linear import fused_linear_dgpo_loss, fused_linear_logprobs
from .linear_logprobs import linear_logprob_entropy
from .methods import (
    METHODS,
    AspoConfig,
    CeGppoConfig,
    CispoConfig,
    DcpoConfig,
    DgpoConfig,
    DispoConfig,
    GppoConfig,
    GrpoConfig,
    MethodConfig,
    Region,
    SapoConfig,
    TokenTerms,
    method_config,
    token_terms,
)
from .metrics import LossMetrics
from .options import LossOptions
from .output import PolicyLossOutput
from .reference import reference_loss
from .validation import raise_deferred_errors

__all__ = [
    "AGGREGATIONS",
    "METHODS",
    "AspoConfig",
    "CeGppoConfig",
    "CispoConfig",
    "DGPOLoss",
    "DcpoConfig",
    "DgpoConfig",
    "DispoConfig",
    "GppoConfig",
    "GrpoConfig",
    "LossMetrics",
    "LossOptions",
    "MethodConfig",
    "PolicyLossOutput",
    "Region",
    "SapoConfig",
    "TokenTerms",
    "fused_dgpo_loss",
    "fused_linear_dgpo_loss",
    "fused_linear_logprobs",
    "linear_logprob_entropy",
    "method_config",
    "raise_deferred_errors",
    "reference_loss",
    "token_scales",
    "token_terms",
]
