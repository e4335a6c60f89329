"""OpenRLHF 0.11.2: ``loss_agg_mode``'s modes over OpenRLHF's step (``aggregate_loss`` divides by the accumulation
window's counts over every dp rank and multiplies by dp_size), and its IS correction."""

from __future__ import annotations

from dgpo_ops.corrections.tis import OpenRLHFCorrection
from dgpo_ops.frameworks.core import AggregationRow, FrameworkSpec, Scope
from dgpo_ops.kernels.interface import Denominator

SOURCE = ("openrlhf 0.11.2 openrlhf/models/loss.py aggregate_loss L11-39 (loss_agg_mode, "
          "openrlhf/trainer/ray/ppo_actor.py L76-86); openrlhf/utils/loss_utils.py L54-105")

SPEC = FrameworkSpec(
    name="openrlhf", title="OpenRLHF",
    aggregations=(
        AggregationRow("token-mean", False, Denominator.TOKENS, Scope.STEP,
                       "the accumulation window's action tokens over every dp rank, counted before the IS mask",
                       SOURCE),
        AggregationRow("seq-mean-token-mean", True, Denominator.SCORED_RESPONSES, Scope.STEP,
                       "the window's responses with an action token over every dp rank", SOURCE),
    ),
    correction=OpenRLHFCorrection, correction_config="--algo.advantage.is_correction_*",
)
