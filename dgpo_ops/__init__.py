"""dgpo-ops: fused, exact RL policy losses for LLM reasoning."""

from typing import TYPE_CHECKING

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
from dgpo_ops.methods.aspo import AspoConfig
from dgpo_ops.methods.base import MethodConfig, TokenTerms
from dgpo_ops.methods.cispo import CispoConfig, DispoConfig, RolloutIsConfig
from dgpo_ops.methods.covariance import ClipCovConfig, KlCovConfig
from dgpo_ops.methods.dcpo import DcpoConfig
from dgpo_ops.methods.dgpo import DgpoConfig
from dgpo_ops.methods.dppo import DppoKlConfig, DppoTvConfig, PrimeDppoConfig, PrimeIpoConfig
from dgpo_ops.methods.dro import DroConfig
from dgpo_ops.methods.fipo import FipoConfig
from dgpo_ops.methods.geo_mean import GeoMeanConfig
from dgpo_ops.methods.gpg import GpgConfig
from dgpo_ops.methods.gppo import CeGppoConfig, GppoConfig
from dgpo_ops.methods.grpo import GrpoConfig
from dgpo_ops.methods.sapo import SapoConfig
from dgpo_ops.methods.table import METHODS, method_config, token_terms
from dgpo_ops.methods.topr import ToprConfig
from dgpo_ops.methods.vespo import VespoConfig

if TYPE_CHECKING:  # bound on first access at run time (__getattr__ below); tools read its definition there
    from dgpo_ops.ops.linear_logprobs import linear_logprob_entropy


def _version() -> str:
    """The installed distribution's version; "0+unknown" where none is installed (the library reads no file of a
    checkout: tests/package/test_no_checkout_paths.py)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("dgpo-ops")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()


def __getattr__(name: str):
    # linear_logprob_entropy is made on first access (dgpo_ops.ops.linear_logprobs.__getattr__ says why)
    if name == "linear_logprob_entropy":
        from dgpo_ops.ops import linear_logprobs

        return linear_logprobs.linear_logprob_entropy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Every method's config class first, in the table's order (tests/package/test_exports.py checks the list
# against the table: a new method's config class is exported here by name), then the rest.
__all__ = [
    "GrpoConfig",
    "CispoConfig",
    "DispoConfig",
    "RolloutIsConfig",
    "GppoConfig",
    "CeGppoConfig",
    "AspoConfig",
    "DgpoConfig",
    "DcpoConfig",
    "SapoConfig",
    "GpgConfig",
    "ToprConfig",
    "DppoTvConfig",
    "DppoKlConfig",
    "PrimeDppoConfig",
    "PrimeIpoConfig",
    "VespoConfig",
    "FipoConfig",
    "DroConfig",
    "GeoMeanConfig",
    "ClipCovConfig",
    "KlCovConfig",
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
