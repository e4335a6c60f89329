"""dgpo-ops: fused, exact RL policy losses for LLM reasoning."""

from dgpo_ops.api import (
    DGPOLoss,
    fused_dgpo_loss,
    fused_linear_dgpo_loss,
    fused_linear_logprobs,
    policy_loss,
    reference_loss,
)
from dgpo_ops.core.aggregation import AGGREGATIONS, FRAMEWORK_AGGREGATIONS, token_scales
from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.core.metrics import LossMetrics
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.core.validation import raise_deferred_errors
from dgpo_ops.kernels.interface import Region
from dgpo_ops.methods.base import MethodConfig, TokenTerms
from dgpo_ops.methods.table import METHODS, method_config, token_terms


def _version() -> str:
    """The installed distribution's version; "0+unknown" where none is installed (the library reads no file of a
    checkout: tests/package/test_no_checkout_paths.py)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("dgpo-ops")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

# Every method's config class (GrpoConfig, DgpoConfig, ...), from the table: a new method's row exports it.
METHOD_CONFIGS = {spec.config.__name__: spec.config for spec in METHODS.values()}
globals().update(METHOD_CONFIGS)


def __getattr__(name: str):
    # linear_logprob_entropy is made on first access (dgpo_ops.ops.linear_logprobs.__getattr__ says why)
    if name == "linear_logprob_entropy":
        from dgpo_ops.ops import linear_logprobs

        return linear_logprobs.linear_logprob_entropy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    *METHOD_CONFIGS,
    "AGGREGATIONS",
    "FRAMEWORK_AGGREGATIONS",
    "METHODS",
    "DGPOLoss",
    "LossInputs",
    "LossMetrics",
    "LossOptions",
    "MethodConfig",
    "PolicyLossOutput",
    "Region",
    "TokenTerms",
    "fused_dgpo_loss",
    "fused_linear_dgpo_loss",
    "fused_linear_logprobs",
    "linear_logprob_entropy",
    "method_config",
    "policy_loss",
    "raise_deferred_errors",
    "reference_loss",
    "token_scales",
    "token_terms",
]
