"""TRL 1.16's vLLM importance sampling (``GRPOConfig.vllm_importance_sampling_mode``, the ratio block of
``GRPOTrainer._generate_and_score_completions``): the ratio of the trainer's to the engine's probabilities, per
token or as the product over the response, truncated or masked to ``[clip_min, clip_max]``.

As TRL: the log difference is taken on the scored tokens only and NaN in it (an engine that gave no log-prob)
becomes 0 (``nan_to_num``, which also maps +-inf to the dtype's extremes); no clamp before the exponential; the
mask modes zero the weight (the normaliser still counts the token) and keep the bounds themselves."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dgpo_ops.corrections.core import CorrectionInputs, CorrectionResult, RolloutCorrection, check_number, min_mean_max

TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class TrlCorrection(RolloutCorrection):
    """``vllm_importance_sampling_mode`` with ``vllm_importance_sampling_clip_min`` / ``_clip_max`` (TRL's
    defaults: sequence_mask, None, 3.0)."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    def __post_init__(self):
        if self.mode not in TRL_MODES:
            raise ValueError(f"TRL's vllm_importance_sampling_mode must be one of {TRL_MODES}, got {self.mode!r}")
        check_number("clip_min", self.clip_min, optional=True)  # None: no bound on that side, as TRL
        check_number("clip_max", self.clip_max, optional=True)
        if self.clip_min is not None and self.clip_max is not None and self.clip_min >= self.clip_max:
            raise ValueError(f"clip_min ({self.clip_min}) must be less than clip_max ({self.clip_max}), as TRL "
                             "requires")
        if self.mode.endswith("truncate") and self.clip_min is None and self.clip_max is None:
            raise ValueError("a *_truncate mode needs clip_min or clip_max, as TRL requires")

    @property
    def sequence_level(self) -> bool:
        """The product over the response (the ``sequence_*`` modes), not the token's own ratio."""
        return self.mode.startswith("sequence")

    def check_options(self, options) -> None:
        method = options.method.name
        if method == "vespo" and self.sequence_level:  # TRL's GRPOTrainer refuses it: vespo folds token weights
            raise ValueError(f"vespo needs a token_* vllm_importance_sampling_mode, as TRL requires; got {self.mode!r}")

    def __call__(self, x: CorrectionInputs) -> CorrectionResult:
        log_diff = torch.nan_to_num(x.masked(x.log_ratio), nan=0.0)
        if self.sequence_level:
            ratio = torch.exp(x.sequence_sum(log_diff, f"TRL's {self.mode}"))  # (n_sequences,): the product
        else:
            ratio = torch.exp(log_diff)
        if self.mode.endswith("truncate"):
            ratio = torch.clamp(ratio, min=self.clip_min, max=self.clip_max)
        else:
            low = self.clip_min if self.clip_min is not None else -math.inf
            high = self.clip_max if self.clip_max is not None else math.inf
            ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
        weights = x.to_tokens(ratio) if self.sequence_level else ratio
        return CorrectionResult(weights=weights, metrics=self.logged(x, ratio))

    def logged(self, x: CorrectionInputs, ratio: torch.Tensor) -> dict:
        """TRL's sampling/importance_sampling_ratio min, mean and max: over every response for the sequence
        modes (fully masked ones included, at ratio 1), over the scored tokens for the token modes."""
        where = torch.ones_like(ratio, dtype=torch.bool) if self.sequence_level else x.mask
        smallest, mean, biggest = min_mean_max(ratio, where)
        return {"importance_sampling_ratio_min": smallest, "importance_sampling_ratio_mean": mean,
                "importance_sampling_ratio_max": biggest}
