"""ROLL (alibaba/ROLL 8eb27cc): ``agg_loss``'s modes over ROLL's step (its strategy counts over every dp rank and
multiplies each micro-batch's loss by micro-batches x dp, cancelling the backend's mean)."""

from __future__ import annotations

from dgpo_ops.frameworks.core import AggregationRow, FrameworkSpec, Scope
from dgpo_ops.kernels.interface import Denominator

SOURCE = ("alibaba/ROLL 8eb27cc roll/utils/functionals.py agg_loss L229-282; roll/distributed/strategy/strategy.py "
          "_get_batch_num_tokens / _get_global_valid_samples L355-431; loss_scale = micro-batches x dp "
          "(apply_loss_scale, roll/configs/worker_config.py L230)")

SPEC = FrameworkSpec(
    name="roll", title="ROLL",
    aggregations=(
        AggregationRow("token-mean", False, Denominator.TOKENS, Scope.STEP,
                       "batch_num_tokens: the step's scored tokens over every dp rank", SOURCE),
        AggregationRow("seq-mean-token-mean", True, Denominator.SCORED_RESPONSES, Scope.STEP,
                       "global_valid_samples: the step's responses with a scored token over every dp rank", SOURCE),
        AggregationRow("seq-mean-token-sum", False, Denominator.SCORED_RESPONSES, Scope.STEP, "global_valid_samples",
                       SOURCE),
        AggregationRow("seq-mean-token-sum-norm", False, Denominator.HORIZON, Scope.MICRO_BATCH_SUM,
                       "T, the micro-batch's padded width (ROLL's loss_mask spans prompt and response: its width - 1 "
                       "where the call holds responses only); the step sums every response's token sum / T", SOURCE),
    ),
)
