"""ms-swift's rollout importance sampling (``GRPOTrainer._apply_rollout_importance_sampling``,
``rollout_importance_sampling_mode`` with one ``rollout_importance_sampling_threshold`` C): TRL's four mode names,
other math. The log-ratio is clamped to +-20 before the exponential; the ``sequence_*`` modes use the response's
geometric-mean ratio (``exp(mean(log(max(ratio, 1e-10))))``), not TRL's product; only the upper side is bounded
(``*_mask`` keeps ``ratio <= C``); ``sequence_mask`` keeps the raw token ratios of the responses it keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dgpo_ops.corrections.core import CorrectionInputs, CorrectionResult, RolloutCorrection
from dgpo_ops.corrections.trl import TRL_MODES

SAFETY_BOUND = 20.0


@dataclass(frozen=True)
class SwiftCorrection(RolloutCorrection):
    """``rollout_importance_sampling_mode`` and ``rollout_importance_sampling_threshold`` (ms-swift's default
    threshold: 2.0)."""

    rollout_importance_sampling_mode: str = "token_truncate"
    rollout_importance_sampling_threshold: float = 2.0


    def __post_init__(self):
        if self.rollout_importance_sampling_mode not in TRL_MODES:
            raise ValueError(f"rollout_importance_sampling_mode must be one of {TRL_MODES}, got "
                             f"{self.rollout_importance_sampling_mode!r}")
        threshold = self.rollout_importance_sampling_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ValueError(f"rollout_importance_sampling_threshold must be a finite number, got {threshold!r}")

    def __call__(self, x: CorrectionInputs) -> CorrectionResult:
        mode, threshold = self.rollout_importance_sampling_mode, self.rollout_importance_sampling_threshold
        ratio = torch.exp(x.log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        if mode == "token_truncate":
            return CorrectionResult(weights=ratio.clamp(max=threshold))
        if mode == "token_mask":
            return CorrectionResult(weights=torch.where(ratio <= threshold, ratio, 0.0))
        log_sum = x.sequence_sum(torch.log(ratio.clamp(min=1e-10)), f"ms-swift's {mode}")
        geometric = x.to_tokens(torch.exp(log_sum / x.sequence_count().clamp(min=1.0)))
        if mode == "sequence_truncate":
            return CorrectionResult(weights=geometric.clamp(max=threshold))
        return CorrectionResult(weights=ratio * (geometric <= threshold))
