"""GMPO (verl's geo_mean): -A R at each response's geometric mean R of its token ratios, each clipped in log
space, a sequence statistic of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.methods.base import MethodConfig, MethodSpec, SequenceInputs, param
from dgpo_ops.methods.clip import unclipped_ratio


@dataclass(frozen=True)
class GeoMeanConfig(MethodConfig):
    name: ClassVar[str] = "geo_mean"
    # GMPO clips each token's log-ratio before the mean, in log space (verl reads its clip_ratio_* as these)
    eps_low: float = param(0.2, "for A < 0 a token's log-ratio is clipped below at -eps_low", low=0.0)
    eps_high: float = param(0.2, "for A > 0 a token's log-ratio is clipped above at eps_high", low=0.0)


def clipped_log_ratio_mean(cfg: GeoMeanConfig, x: SequenceInputs) -> torch.Tensor:
    """GMPO's log geometric mean as verl's geo_mean forms it, broadcast back to its tokens (differentiable):
    each token's log-ratio clipped in log space by the sign of its advantage (A > 0: at most ``eps_high``;
    A < 0: at least ``-eps_low``; A = 0: 0), averaged over the response (its length plus 1e-8), plus the mean
    of the rollout weights' logs (verl's geometric mean of ``rollout_is_weights``, each plus 1e-10)."""
    sign = torch.sign(x.advantage)
    clipped = x.log_ratio.clamp(-cfg.eps_low, cfg.eps_high)
    signed_min = sign * torch.minimum(sign * x.log_ratio, sign * clipped)
    lengths = x.mask.sum(dim=1, keepdim=True).to(x.log_ratio.dtype) + 1e-8
    mean = torch.where(x.mask, signed_min, 0.0).sum(dim=1, keepdim=True) / lengths
    if x.rollout_weights is not None:
        mean = mean + torch.where(x.mask, torch.log(x.rollout_weights + 1e-10), 0.0).sum(dim=1, keepdim=True) / lengths
    return mean.expand_as(x.log_ratio)


SPECS = (
    MethodSpec(GeoMeanConfig, unclipped_ratio, "the geometric mean of each response's token ratios, "
               "clipped per token in log space",
               "GMPO: Geometric-Mean Policy Optimization, Zhao et al. 2025, arXiv:2507.20673",
               # (not 0.4, GMPO's own: tests/helpers.py's log-ratio grid holds -0.4, a tie in log space)
               variants=({}, {"eps_low": 0.3, "eps_high": 0.35}),
               sequence_statistic=clipped_log_ratio_mean, aggregation="seq_mean_token_mean"),
)
