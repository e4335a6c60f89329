"""The frameworks dgpo-ops gives the numbers of, one module each (docs/design.md, "Adding a framework"): a
``FrameworkSpec`` of its aggregation rows, the config fields it reads method parameters from, its correction
family and its own loss names (``core.py``). Everything else is derived from them: ``FRAMEWORK_AGGREGATIONS``
(``aggregation="framework:mode"``), ``DGPOTrainer``'s loss types and divisors, the verl and SkyRL plugins'
field mappings and divisors, and docs/normalization.md's and docs/integrations.md's tables."""

from dgpo_ops.frameworks import areal, ms_swift, nemo_rl, openrlhf, roll, skyrl, trl, verl
from dgpo_ops.frameworks.core import AggregationRow, FrameworkSpec, Scope, step_normalizer

# In docs/normalization.md's order.
MODULES = (trl, verl, roll, openrlhf, nemo_rl, areal, skyrl, ms_swift)
FRAMEWORKS: dict[str, FrameworkSpec] = {module.SPEC.name: module.SPEC for module in MODULES}
# "framework:mode" -> the row; the mode is the framework's own config value (TRL's loss_type, verl's, ROLL's and
# OpenRLHF's loss_agg_mode, NeMo-RL's token_level_loss, SkyRL's loss_reduction; AReaL has one aggregation).
def aggregation_table(specs) -> dict[str, AggregationRow]:
    """``"name:mode"`` -> row, for every row of every spec of ``specs``, in their order."""
    return {f"{spec.name}:{row.mode}": row for spec in specs for row in spec.aggregations}


FRAMEWORK_AGGREGATIONS: dict[str, AggregationRow] = aggregation_table(FRAMEWORKS.values())

__all__ = ["FRAMEWORKS", "FRAMEWORK_AGGREGATIONS", "MODULES", "AggregationRow", "FrameworkSpec", "Scope",
           "aggregation_table", "step_normalizer"]
