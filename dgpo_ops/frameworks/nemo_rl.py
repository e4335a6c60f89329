"""NeMo-RL (NVIDIA-NeMo/RL 7ea279a): ``token_level_loss``'s two aggregations over NeMo-RL's global batch, and its
truncated importance sampling."""

from __future__ import annotations

from dgpo_ops.corrections.tis import NemoRLCorrection
from dgpo_ops.frameworks.core import AggregationRow, FrameworkSpec, Scope
from dgpo_ops.kernels.interface import Denominator

SOURCE = ("NVIDIA-NeMo/RL 7ea279a nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn L678-693; "
          "nemo_rl/models/automodel/data.py process_global_batch L381-420; nemo_rl/models/automodel/train.py L547 (the "
          "loss x dp_size)")

SPEC = FrameworkSpec(
    name="nemo_rl", title="NeMo-RL",
    aggregations=(
        AggregationRow("token_level_loss=true", False, Denominator.TOKENS, Scope.STEP,
                       "global_valid_toks: the global batch's tokens over every dp rank, counted before TIS / icepop",
                       SOURCE),
        AggregationRow("token_level_loss=false", True, Denominator.RESPONSES, Scope.STEP,
                       "global_valid_seqs: the global batch's sample_mask sum over every dp rank", SOURCE),
    ),
    correction=NemoRLCorrection, correction_config="ClippedPGLossConfig (truncated_importance_sampling_*)",
)
