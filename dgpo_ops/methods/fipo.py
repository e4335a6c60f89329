"""FIPO (ms-swift's loss_type 'fipo', Future-KL Influenced Policy Optimization): PPO's clipped ratio (with TRL's
delta) weighed by a detached influence weight, the exponential of the token's discounted future sum of log-ratios
within its response, clipped; a sequence scan, FIPO's own sequence statistic."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import LOG_RATIO_CLAMP
from dgpo_ops.methods.base import (
    MethodConfig,
    MethodSpec,
    SequenceInputs,
    TokenInputs,
    TokenTerms,
    param,
    straight_through_clamp,
)
from dgpo_ops.methods.clip import eps_high_param, eps_low_param, ppo_clip

# ms-swift's cap of a negative-advantage token's influence weight where its ratio passed the safety threshold
SAFETY_BAND = (0.8, 1.0)


@dataclass(frozen=True)
class FipoConfig(MethodConfig):
    name: ClassVar[str] = "fipo"
    eps_low: float = eps_low_param()
    eps_high: float = eps_high_param()
    delta: float | None = param(None, "TRL's cap on the ratio, as ms-swift's delta; tokens above it also leave the "
                                      "future sum", low=0.0, low_open=True, optional=True)
    decay_rate: float = param(32.0, "the future sum's discount halves every decay_rate tokens (gamma = "
                                    "2^(-1 / decay_rate))", low=0.0, low_open=True)
    clip_range: float | None = param(0.2, "the influence weight is clipped to [1 (clip_side 'high') or "
                                          "1 - clip_range, 1 + clip_range]; None or 0: not clipped", low=0.0,
                                     optional=True)
    clip_side: str = param("high", "'high': the influence weight is floored at 1 (ms-swift's fipo_clip_high_only); "
                                   "'both': at 1 - clip_range", choices=("high", "both"))
    safety_threshold: float | None = param(4.0, "for A < 0, a token whose ratio is above it has its influence weight "
                                                "clamped to [0.8, 1]", low=0.0, low_open=True, optional=True)

    @property
    def influence_bounds(self) -> tuple[float, float]:
        """The influence weight's clip (0 and +inf where ``clip_range`` is None or 0, as ms-swift's truthiness)."""
        if not self.clip_range:
            return 0.0, math.inf
        return (1.0 if self.clip_side == "high" else 1.0 - self.clip_range), 1.0 + self.clip_range


def discounted_future_sum(values: torch.Tensor, gamma: float) -> torch.Tensor:
    """``y_t = sum_{k >= t} gamma^(k - t) values_k`` along the last axis, by doubling: after the step of stride ``s``
    each ``y_t`` holds its ``2 s`` next terms, so ``ceil(log2 T)`` steps of ``O(B T)`` give every term, with no
    power of ``1 / gamma`` to overflow (ms-swift multiplies by the ``T x T`` decay matrix in chunks)."""
    total, stride = values, 1
    length = values.shape[-1]
    while stride < length:
        shifted = torch.nn.functional.pad(total[..., stride:], (0, stride))
        total = total + gamma ** stride * shifted
        stride *= 2
    return total


def future_log_ratio(cfg: FipoConfig, x: SequenceInputs) -> torch.Tensor:
    """ms-swift's _compute_fipo_influence up to its exponential, detached: each scored token's discounted sum of its
    own and its later tokens' log-ratios within its row (masked tokens, and with ``delta`` tokens whose ratio is
    above it, add 0; no reset inside a row), 0 on tokens not scored. Each row of the grid is one response (packed
    sequences are laid one per row), so the sum stops at the response's end."""
    log_ratio = x.log_ratio.detach()
    kept = x.mask
    if cfg.delta is not None:
        ratio = torch.exp(straight_through_clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        kept = kept & ~(ratio > cfg.delta)
    future = discounted_future_sum(torch.where(kept, log_ratio, 0.0), 2.0 ** (-1.0 / cfg.decay_rate))
    return torch.where(x.mask, future, 0.0)


def _fipo(cfg: FipoConfig, x: TokenInputs) -> TokenTerms:
    # x.log_ratio is the token's future sum (future_log_ratio, the statistic); the PPO term uses its own ratio
    own_log_ratio = straight_through_clamp(x.logp - x.old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(own_log_ratio)
    own = TokenInputs(own_log_ratio, ratio, ratio.detach(), x.advantage, x.logp, x.old_logp)
    terms = ppo_clip(own, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, math.inf,
                     math.inf if cfg.delta is None else cfg.delta)
    low, high = cfg.influence_bounds
    influence = x.log_ratio.detach().exp().clamp(low, high)
    if cfg.safety_threshold is not None:  # on the uncapped ratio, as ms-swift (before delta)
        unsafe = (x.advantage < 0) & (ratio.detach() > cfg.safety_threshold)
        influence = torch.where(unsafe, influence.clamp(*SAFETY_BAND), influence)
    return TokenTerms(influence * terms.loss, influence * terms.psi, terms.region)


SPECS = (
    MethodSpec(FipoConfig, _fipo, "PPO's clipped ratio weighed by exp(discounted future sum of log-ratios), clipped",
               "FIPO: Future-KL Influenced Policy Optimization, arXiv:2603.19835 (ms-swift's loss_type 'fipo')",
               variants=({}, {"eps_high": 0.28, "delta": 2.5, "decay_rate": 2.0, "clip_range": 0.5,
                              "clip_side": "both", "safety_threshold": 1.5},
                         {"clip_range": None, "safety_threshold": None, "decay_rate": 0.5}),
               sequence_statistic=future_log_ratio, statistic_folds_rollout_weights=False),
)
