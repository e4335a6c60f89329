"""CISPO and DISPO: the clipped importance weight times the log-prob (DISPO's bounds by the sign of A)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import KernelParam, MethodId
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import capped_is, full_like, symmetric_bounds


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


def _cispo(cfg: CispoConfig, x: TokenInputs) -> TokenTerms:
    return capped_is(x, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)


def _dispo(cfg: DispoConfig, x: TokenInputs) -> TokenTerms:
    neg, rd = x.advantage < 0, x.ratio_detached
    low = torch.where(neg, full_like(1.0 - cfg.eps_low_neg, rd), full_like(1.0 - cfg.eps_low_pos, rd))
    high = torch.where(neg, full_like(1.0 + cfg.eps_high_neg, rd), full_like(1.0 + cfg.eps_high_pos, rd))
    return capped_is(x, low, high)


SPECS = (
    MethodSpec(CispoConfig, _cispo, "clipped IS weight times log-prob",
               "CISPO: MiniMax-M1, arXiv:2506.13585", variants=({}, {"eps_low": 0.2, "eps_high": 0.28})),
    MethodSpec(DispoConfig, _dispo, "CISPO with bounds by sign of A",
               "DISPO: Rawal et al. 2026, arXiv:2602.00983"),
)
