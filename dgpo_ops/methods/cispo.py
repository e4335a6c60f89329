"""CISPO and DISPO: the clipped importance weight times the log-prob (DISPO's bounds by the sign of A); SkyRL's
rollout_is: the weight inside an open band, 0 outside it instead of clipped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import KernelParam, MethodId
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import (
    capped_is,
    eps_high_param,
    eps_low_param,
    full_like,
    regions,
    symmetric_bounds,
)


@dataclass(frozen=True)
class CispoConfig(MethodConfig):
    name: ClassVar[str] = "cispo"
    method_id: ClassVar[MethodId] = MethodId.CAPPED_IS
    # TRL's CISPO has no lower bound on the weight (eps_low = 1) and calls the cap itself epsilon_high.
    eps_low: float = param(1.0, "the weight is floored at 1 - eps_low (1: no floor)", low=0.0, high=1.0)
    eps_high: float = param(4.0, "the weight is capped at 1 + eps_high", low=0.0)

    def _kernel_slots(self):
        return symmetric_bounds(self)


def _dispo_bound(default, sign: str, side: str):
    low, high = (0.0, 1.0) if side == "low" else (0.0, None)
    what = "floored at 1 - " if side == "low" else "capped at 1 + "
    return param(default, f"for A {sign} 0 the weight is {what}eps_{side}_{'pos' if sign == '>' else 'neg'}",
                 low=low, high=high)


@dataclass(frozen=True)
class DispoConfig(MethodConfig):
    name: ClassVar[str] = "dispo"
    method_id: ClassVar[MethodId] = MethodId.CAPPED_IS
    eps_low_pos: float = _dispo_bound(0.2, ">", "low")
    eps_high_pos: float = _dispo_bound(10.0, ">", "high")
    eps_low_neg: float = _dispo_bound(1.0, "<", "low")
    eps_high_neg: float = _dispo_bound(100.0, "<", "high")

    def _kernel_slots(self):
        return {
            KernelParam.LOW_POS: 1.0 - self.eps_low_pos,
            KernelParam.HIGH_POS: 1.0 + self.eps_high_pos,
            KernelParam.LOW_NEG: 1.0 - self.eps_low_neg,
            KernelParam.HIGH_NEG: 1.0 + self.eps_high_neg,
        }


@dataclass(frozen=True)
class RolloutIsConfig(MethodConfig):
    name: ClassVar[str] = "rollout_is"
    method_id: ClassVar[MethodId] = MethodId.BANDED_IS
    # SkyRL reads eps_clip_low / eps_clip_high as the band (1 - eps_low, 1 + eps_high)
    eps_low: float = eps_low_param()
    eps_high: float = eps_high_param()

    def _kernel_slots(self):
        return symmetric_bounds(self)


def _cispo(cfg: CispoConfig, x: TokenInputs) -> TokenTerms:
    return capped_is(x, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)


def _dispo(cfg: DispoConfig, x: TokenInputs) -> TokenTerms:
    neg, rd = x.advantage < 0, x.ratio_detached
    low = torch.where(neg, full_like(1.0 - cfg.eps_low_neg, rd), full_like(1.0 - cfg.eps_low_pos, rd))
    high = torch.where(neg, full_like(1.0 + cfg.eps_high_neg, rd), full_like(1.0 + cfg.eps_high_pos, rd))
    return capped_is(x, low, high)


def _rollout_is(cfg: RolloutIsConfig, x: TokenInputs) -> TokenTerms:
    # SkyRL's compute_policy_loss_rollout_is: -sg(w) A l with w = r inside the open band, 0 on and beyond its ends.
    # Written as "not outside" so that a NaN ratio reaches the loss; an outside token's value is 0 (not 0 * -inf).
    rd, adv = x.ratio_detached, x.advantage
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    inside = ~((rd <= low) | (rd >= high))
    weight = torch.where(inside, rd, 0.0)
    return TokenTerms(torch.where(inside, -adv * weight * x.logp, 0.0), weight, regions(rd, adv, low, high))


SPECS = (
    MethodSpec(CispoConfig, _cispo, "clipped IS weight times log-prob",
               "CISPO: MiniMax-M1, arXiv:2506.13585", variants=({}, {"eps_low": 0.2, "eps_high": 0.28})),
    MethodSpec(DispoConfig, _dispo, "CISPO with bounds by sign of A",
               "DISPO: Rawal et al. 2026, arXiv:2602.00983"),
    MethodSpec(RolloutIsConfig, _rollout_is, "the importance weight times the log-prob inside an open band, "
               "0 outside (old_logps: the rollout's)",
               "SkyRL's policy_loss_type 'rollout_is' (GLM-5 tech report, section 4.1.2)",
               variants=({}, {"eps_low": 0.5, "eps_high": 1.0})),
)
