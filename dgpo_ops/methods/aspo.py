"""ASPO: the flipped ratio for A > 0 and a soft dual clip."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import KernelParam, MethodId, Region
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms
from dgpo_ops.methods.clip import (
    dual_clip_param,
    eps_high_param,
    eps_low_param,
    full_like,
    regions,
    symmetric_bounds,
)


@dataclass(frozen=True)
class AspoConfig(MethodConfig):
    name: ClassVar[str] = "aspo"
    method_id: ClassVar[MethodId] = MethodId.ASPO
    eps_low: float = eps_low_param()
    eps_high: float = eps_high_param()
    dual_clip: float = dual_clip_param(3.0, optional=False)  # aspo's soft dual clip cannot be turned off

    def _kernel_slots(self):
        return {**symmetric_bounds(self), KernelParam.DUAL_CLIP: self.dual_clip}


def _aspo(cfg: AspoConfig, x: TokenInputs) -> TokenTerms:
    r, rd, adv, logp = x.ratio, x.ratio_detached, x.advantage, x.logp
    low, high, c = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, cfg.dual_clip
    zero = torch.zeros_like(rd)
    pos = adv >= 0
    # A >= 0: flipped ratio 1/p with p = min(r, high); soft dual clip where 1/p > c.
    # Selects written so that a NaN ratio takes the ratio's branch: NaN must reach the loss.
    p = torch.where(rd > high, full_like(high, rd), r)
    pd = p.detach()
    pos_dual = 1.0 / pd > c
    pos_loss = torch.where(pos_dual, -adv * c * logp, -adv * (p / pd) / pd)
    pos_psi = torch.where(pos_dual, full_like(c, rd), torch.where(rd > high, zero, 1.0 / rd))
    # A < 0: u = max(r, low); soft dual clip where u > c.
    u = torch.where(rd < low, full_like(low, rd), r)
    neg_dual = u.detach() > c
    neg_loss = torch.where(neg_dual, -adv * c * logp, -adv * u)
    neg_psi = torch.where(neg_dual, full_like(c, rd), torch.where(rd < low, zero, rd))
    dual = torch.where(pos, pos_dual, neg_dual) & (adv != 0)
    region = torch.where(dual, Region.DUAL.value, regions(rd, adv, low, high)).to(torch.int8)
    return TokenTerms(
        torch.where(pos, pos_loss, neg_loss), torch.where(pos, pos_psi, neg_psi), region
    )


SPECS = (
    MethodSpec(AspoConfig, _aspo, "flipped ratio for A>0, soft dual clip",
               "ASPO: asymmetric importance sampling policy optimization (2025)"),
)
