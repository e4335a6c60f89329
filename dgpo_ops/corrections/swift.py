"""ms-swift's rollout importance sampling (``GRPOTrainer._apply_rollout_importance_sampling``,
``rollout_importance_sampling_mode`` with one ``rollout_importance_sampling_threshold`` C): TRL's four mode names,
other math. The log-ratio is clamped to +-20 before the exponential; the ``sequence_*`` modes use the response's
geometric-mean ratio (``exp(mean(log(max(ratio, 1e-10))))``), not TRL's product; only the upper side is bounded
(``*_mask`` keeps ``ratio <= C``); ``sequence_mask`` keeps the raw token ratios of the responses it keeps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpo_ops.corrections.core import (CorrectionInputs, CorrectionResult, RolloutCorrection, check_branches,
                                       check_number, clamped_exp)

# ms-swift's Literal for rollout_importance_sampling_mode (swift/rlhf_trainers/args_mixin.py)
SWIFT_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _geometric(x: CorrectionInputs, ratio: torch.Tensor, mode: str) -> torch.Tensor:
    """Each token's response's geometric-mean ratio."""
    return x.to_tokens(torch.exp(x.sequence_mean(torch.log(ratio.clamp(min=1e-10)), f"ms-swift's {mode}")))


# each mode's weights from (inputs, the token ratio, C)
MODE_WEIGHTS = {
    "token_truncate": lambda x, ratio, threshold: ratio.clamp(max=threshold),
    "token_mask": lambda x, ratio, threshold: torch.where(ratio <= threshold, ratio, 0.0),
    "sequence_truncate": lambda x, ratio, threshold: _geometric(x, ratio, "sequence_truncate").clamp(max=threshold),
    # the raw token ratios of the responses kept, as a product: a NaN ratio stays NaN in a dropped response too
    "sequence_mask": lambda x, ratio, threshold: ratio * (_geometric(x, ratio, "sequence_mask") <= threshold),
}


def check_dispatch() -> None:
    """Every mode has its weights (run at import)."""
    check_branches("rollout_importance_sampling_mode", SWIFT_MODES, MODE_WEIGHTS)


check_dispatch()


@dataclass(frozen=True)
class SwiftCorrection(RolloutCorrection):
    """``rollout_importance_sampling_mode`` and ``rollout_importance_sampling_threshold`` (ms-swift's default
    threshold: 2.0)."""

    rollout_importance_sampling_mode: str = "token_truncate"
    rollout_importance_sampling_threshold: float = 2.0

    def __post_init__(self):
        self.mode_weights()
        # a threshold <= 0 truncates every weight to it (a negative one flips the loss) or masks every token
        check_number("rollout_importance_sampling_threshold", self.rollout_importance_sampling_threshold,
                     positive=True)

    def check_options(self, options) -> None:
        if options.beta != 0:  # SWIFT's _compute_loss: per_token_loss = (policy + beta * KL) * rollout_is_weights
            raise ValueError("ms-swift multiplies the KL term by its rollout importance weights too, where this "
                             "stage weights the policy term only: SwiftCorrection takes beta=0 (got "
                             f"beta={options.beta})")

    def __call__(self, x: CorrectionInputs) -> CorrectionResult:
        weights = self.mode_weights()(x, clamped_exp(x.log_ratio), self.rollout_importance_sampling_threshold)
        return CorrectionResult(weights=weights)

    def mode_weights(self):
        """The mode's weights function, or the refusal of a mode there is none for (a call checks it again: a
        frozen dataclass changed by hand is not computed as another mode)."""
        if self.rollout_importance_sampling_mode not in MODE_WEIGHTS:
            raise ValueError(f"rollout_importance_sampling_mode must be one of {SWIFT_MODES}, got "
                             f"{self.rollout_importance_sampling_mode!r}")
        return MODE_WEIGHTS[self.rollout_importance_sampling_mode]
