"""TRL 1.16's vLLM importance sampling (``GRPOConfig.vllm_importance_sampling_mode``, the ratio block of
``GRPOTrainer._generate_and_score_completions``): the ratio of the trainer's to the engine's probabilities, per
token or as the product over the response, truncated or masked to ``[vllm_importance_sampling_clip_min,
vllm_importance_sampling_clip_max]``. The fields are ``GRPOConfig``'s own, so a TRL config's values copy over.

As TRL: the log difference is taken on the scored tokens only and NaN in it (an engine that gave no log-prob)
becomes 0 (``nan_to_num``, which also maps +-inf to the dtype's extremes); no clamp before the exponential; the
mask modes zero the weight (the normaliser still counts the token) and keep the bounds themselves."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dgpo_ops.corrections.core import (CorrectionInputs, CorrectionResult, RolloutCorrection, check_branches,
                                       check_number, min_mean_max)

TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class ModeMath(NamedTuple):
    """What a mode computes, stated per mode rather than read off its name."""

    per_response: bool  # the product of the ratios over the response, not the token's own ratio
    truncates: bool  # clamped into the bounds; else zeroed outside them


MODE_MATH = {"token_truncate": ModeMath(per_response=False, truncates=True),
             "token_mask": ModeMath(per_response=False, truncates=False),
             "sequence_truncate": ModeMath(per_response=True, truncates=True),
             "sequence_mask": ModeMath(per_response=True, truncates=False)}


def check_dispatch() -> None:
    """Every mode has its row of ``MODE_MATH`` (run at import)."""
    check_branches("vllm_importance_sampling_mode", TRL_MODES, MODE_MATH)


check_dispatch()


@dataclass(frozen=True)
class TrlCorrection(RolloutCorrection):
    """``GRPOConfig.vllm_importance_sampling_mode`` with ``vllm_importance_sampling_clip_min`` / ``_clip_max``
    (TRL's defaults: sequence_mask, None, 3.0)."""

    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0

    def __post_init__(self):
        mode, low, high = self.bounds()
        if mode not in TRL_MODES:
            raise ValueError(f"vllm_importance_sampling_mode must be one of {TRL_MODES}, got {mode!r}")
        # None: no bound on that side, as TRL
        check_number("vllm_importance_sampling_clip_min", low, optional=True)
        check_number("vllm_importance_sampling_clip_max", high, optional=True)
        if low is not None and high is not None and low >= high:
            raise ValueError(f"vllm_importance_sampling_clip_min ({low}) must be less than "
                             f"vllm_importance_sampling_clip_max ({high}), as TRL requires")
        if MODE_MATH[mode].truncates and low is None and high is None:
            raise ValueError("a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_min or "
                             "_clip_max, as TRL requires")

    def bounds(self) -> tuple[str, float | None, float | None]:
        """``(mode, clip_min, clip_max)``."""
        return (self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                self.vllm_importance_sampling_clip_max)

    @property
    def sequence_level(self) -> bool:
        """The product over the response (the ``sequence_*`` modes), not the token's own ratio."""
        return MODE_MATH[self.vllm_importance_sampling_mode].per_response

    def check_options(self, options) -> None:
        # TRL's GRPOTrainer refuses a sequence mode where the method folds the token weights into its own
        # sequence statistic (vespo): the product would be folded once per token
        if self.sequence_level and options.folds_rollout_weights:
            raise ValueError(f"{options.method.name} folds the rollout weights into its sequence statistic and needs "
                             "a token_* vllm_importance_sampling_mode, as TRL requires; got "
                             f"{self.vllm_importance_sampling_mode!r}")

    def __call__(self, x: CorrectionInputs) -> CorrectionResult:
        mode, low, high = self.bounds()
        log_diff = torch.nan_to_num(x.masked(x.log_ratio), nan=0.0)
        if self.sequence_level:
            ratio = torch.exp(x.sequence_sum(log_diff, f"TRL's {mode}"))  # (n_sequences,): the product
        else:
            ratio = torch.exp(log_diff)
        if MODE_MATH[mode].truncates:
            ratio = torch.clamp(ratio, min=low, max=high)
        else:
            low = -math.inf if low is None else low
            high = math.inf if high is None else high
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
