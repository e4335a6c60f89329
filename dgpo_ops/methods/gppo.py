"""GPPO and CE-GPPO: the gradient-preserving clip (a constant weight on the clip boundary)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import KernelParam, MethodId, Region
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import (
    dual_clip_param,
    eps_high_param,
    eps_low_param,
    full_like,
    regions,
    symmetric_bounds,
)


@dataclass(frozen=True)
class GppoConfig(MethodConfig):
    name: ClassVar[str] = "gppo"
    method_id: ClassVar[MethodId] = MethodId.GRADIENT_PRESERVING
    eps_low: float = eps_low_param()
    eps_high: float = eps_high_param()
    dual_clip: float | None = dual_clip_param(3.0)

    beta1: ClassVar[float] = 1.0
    beta2: ClassVar[float] = 1.0

    def _kernel_slots(self):
        return {
            **symmetric_bounds(self),
            KernelParam.DUAL_CLIP: self.dual_clip,
            KernelParam.LN_WEIGHT: self.beta1 * (1.0 - self.eps_low),
            KernelParam.HP_WEIGHT: self.beta2 * (1.0 + self.eps_high),
        }


@dataclass(frozen=True)
class CeGppoConfig(MethodConfig):
    name: ClassVar[str] = "ce_gppo"
    method_id: ClassVar[MethodId] = MethodId.GRADIENT_PRESERVING
    eps_low: float = eps_low_param()
    eps_high: float = eps_high_param()
    dual_clip: float | None = dual_clip_param(3.0)
    beta1: float = param(0.75, "scale of the left-boundary gradient", low=0.0)
    beta2: float = param(1.0, "scale of the right-boundary gradient", low=0.0)

    _kernel_slots = GppoConfig._kernel_slots


def _gppo(cfg: GppoConfig | CeGppoConfig, x: TokenInputs) -> TokenTerms:
    r, rd, adv = x.ratio, x.ratio_detached, x.advantage
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    dual_clip = math.inf if cfg.dual_clip is None else cfg.dual_clip
    region = regions(rd, adv, low, high)
    in_ln, in_hp = region == Region.LN.value, region == Region.HP.value
    unit = r / rd  # value 1, gradient r/sg(r): the gradient-preserving trick
    loss = torch.where(in_ln, -adv * cfg.beta1 * low * unit, -adv * r)
    loss = torch.where(in_hp, -adv * cfg.beta2 * high * unit, loss)
    psi = torch.where(in_ln, full_like(cfg.beta1 * low, rd), rd)
    psi = torch.where(in_hp, full_like(cfg.beta2 * high, rd), psi)
    dual = (adv < 0) & (-adv * dual_clip < loss.detach())
    loss = torch.where(dual, -adv * dual_clip, loss)
    psi = torch.where(dual, torch.zeros_like(rd), psi)
    return TokenTerms(loss, psi, torch.where(dual, Region.DUAL.value, region).to(torch.int8))


SPECS = (
    MethodSpec(GppoConfig, _gppo, "gradient-preserving clip, constant boundary weight",
               "GPPO: Klear-Reasoner (Kuaishou, 2025)"),
    MethodSpec(CeGppoConfig, _gppo, "GPPO with boundary scales beta1, beta2", "CE-GPPO (Kuaishou, 2025)"),
)
