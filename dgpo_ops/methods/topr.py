"""TOPR (ROLL's ``pg_variant="topr"``): REINFORCE on the positive samples, the ratio truncated at 1 as a detached
weight on the negative ones; a sample's sign is its response's score (the ``scores`` input), not its advantage's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import Region
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms, param


@dataclass(frozen=True)
class ToprConfig(MethodConfig):
    name: ClassVar[str] = "topr"
    positive_weight: float = param(1.0, "weight of the positive samples' (score > 0) -A l", low=0.0)
    negative_weight: float = param(1.0, "weight of the negative samples' -A min(r, 1) l", low=0.0)


def _topr(cfg: ToprConfig, x: TokenInputs) -> TokenTerms:
    # ROLL's _compute_topr_loss: w_pos (-A l) where the score is > 0, else w_neg (-sg(clamp(r, 0, 1)) A l). Without
    # scores the advantage's sign stands in (docs/math.md).
    rd, adv = x.ratio_detached, x.advantage
    positive = (adv if x.score is None else x.score) > 0
    truncated = torch.minimum(rd, torch.ones_like(rd))
    weight = torch.where(positive, torch.full_like(rd, cfg.positive_weight), cfg.negative_weight * truncated)
    # A negative sample's token whose ratio the truncation cut (r > 1) is DUAL, as a capped weight; A = 0 is M.
    region = torch.where(~positive & (rd > 1.0) & (adv != 0), Region.DUAL.value, Region.M.value).to(torch.int8)
    return TokenTerms(-adv * weight * x.logp, weight, region)


SPECS = (
    MethodSpec(ToprConfig, _topr, "REINFORCE on positive samples, ratio truncated at 1 on negative ones; the sign "
               "is the response's score (scores)",
               "TOPR: Tapered Off-Policy REINFORCE, Le Roux et al. 2025, arXiv:2503.14286 (ROLL's pg_variant "
               "'topr')",
               variants=({}, {"positive_weight": 0.5, "negative_weight": 2.0}), reads_scores=True),
)
