"""ms-swift's rollout importance sampling (``GRPOTrainer._apply_rollout_importance_sampling``,
``rollout_importance_sampling_mode`` with one ``rollout_importance_sampling_threshold`` C): TRL's four mode names,
other math. The log-ratio is clamped to +-20 before the exponential; the ``sequence_*`` modes use the response's
geometric-mean ratio (``exp(mean(log(max(ratio, 1e-10))))``), not TRL's product; only the upper side is bounded
(``*_mask`` keeps ``ratio <= C``); ``sequence_mask`` keeps the raw token ratios of the responses it keeps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpo_ops.corrections.core import CorrectionInputs, CorrectionResult, RolloutCorrection, check_number, clamped_exp

# ms-swift's Literal for rollout_importance_sampling_mode (swift/rlhf_trainers/args_mixin.py)
SWIFT_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class SwiftCorrection(RolloutCorrection):
    """``rollout_importance_sampling_mode`` and ``rollout_importance_sampling_threshold`` (ms-swift's default
    threshold: 2.0)."""

    rollout_importance_sampling_mode: str = "token_truncate"
    rollout_importance_sampling_threshold: float = 2.0

    def __post_init__(self):
        if self.rollout_importance_sampling_mode not in SWIFT_MODES:
            raise ValueError(f"rollout_importance_sampling_mode must be one of {SWIFT_MODES}, got "
                             f"{self.rollout_importance_sampling_mode!r}")
        # a threshold <= 0 truncates every weight to it (a negative one flips the loss) or masks every token
        check_number("rollout_importance_sampling_threshold", self.rollout_importance_sampling_threshold,
                     positive=True)

    def check_options(self, options) -> None:
        if options.beta != 0:  # SWIFT's _compute_loss: per_token_loss = (policy + beta * KL) * rollout_is_weights
            raise ValueError("ms-swift multiplies the KL term by its rollout importance weights too, where this "
                             "stage weights the policy term only: SwiftCorrection takes beta=0 (got "
                             f"beta={options.beta})")

    def __call__(self, x: CorrectionInputs) -> CorrectionResult:
        mode, threshold = self.rollout_importance_sampling_mode, self.rollout_importance_sampling_threshold
        ratio = clamped_exp(x.log_ratio)
        if mode == "token_truncate":
            return CorrectionResult(weights=ratio.clamp(max=threshold))
        if mode == "token_mask":
            return CorrectionResult(weights=torch.where(ratio <= threshold, ratio, 0.0))
        if mode not in ("sequence_truncate", "sequence_mask"):
            raise ValueError(f"rollout_importance_sampling_mode must be one of {SWIFT_MODES}, got {mode!r}")
        geometric = x.to_tokens(torch.exp(x.sequence_mean(torch.log(ratio.clamp(min=1e-10)), f"ms-swift's {mode}")))
        if mode == "sequence_truncate":
            return CorrectionResult(weights=geometric.clamp(max=threshold))
        return CorrectionResult(weights=ratio * (geometric <= threshold))
