"""AReaL 1.0.4: its one aggregation over the engine's step (each micro-batch's token mean scaled by its share of
the step's tokens over every dp rank, times dp_size), and its decoupled-PPO behaviour weight and M2PO."""

from __future__ import annotations

from dgpo_ops.corrections.areal import ArealCorrection
from dgpo_ops.frameworks.core import AggregationRow, FrameworkSpec, Scope
from dgpo_ops.kernels.interface import Denominator

SOURCE = ("areal 1.0.4 areal/utils/functional/functional.py ppo_actor_loss_fn L479-483, L542; "
          "areal/trainer/ppo/actor.py L336-364, L446-448; areal/engine/fsdp_engine.py train_batch L760-797 "
          "(loss_multiplier = dp_size), _compute_logprobs_and_loss L2120")

SPEC = FrameworkSpec(
    name="areal", title="AReaL",
    aggregations=(
        AggregationRow("token-mean", False, Denominator.TOKENS, Scope.STEP,
                       "the mini-batch's loss_mask tokens over every dp rank, counted before rejection sampling, "
                       "after M2PO per micro-batch (AReaL's one aggregation, no config field)", SOURCE),
    ),
    correction=ArealCorrection, correction_config="PPOActorConfig (rejection_sampling, m2_threshold)",
)
