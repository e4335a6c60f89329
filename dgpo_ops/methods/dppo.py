"""DPPO-TV and DPPO-KL: a capped importance weight; tokens whose probability moved further than a divergence
threshold are dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import KernelParam, MethodId, Region
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import full_like


def _dppo_threshold(default, side: str):
    sign = "<=" if side == "low" else ">"
    return param(default, f"divergence threshold for A {sign} 0: a token whose probability moved further is dropped",
                 low=0.0)


@dataclass(frozen=True)
class DppoTvConfig(MethodConfig):
    name: ClassVar[str] = "dppo_tv"
    method_id: ClassVar[MethodId] = MethodId.DPPO_TV
    # verl reads its clip fields as the divergence thresholds and clip_ratio_c as the weight's cap.
    delta_low: float = _dppo_threshold(0.2, "low")
    delta_high: float = _dppo_threshold(0.2, "high")
    is_cap: float = param(3.0, "the importance weight is capped at is_cap", low=0.0, low_open=True)

    def _kernel_slots(self):
        return {KernelParam.THRESHOLD_LOW: self.delta_low, KernelParam.THRESHOLD_HIGH: self.delta_high,
                KernelParam.RATIO_CAP: self.is_cap}


@dataclass(frozen=True)
class DppoKlConfig(DppoTvConfig):
    name: ClassVar[str] = "dppo_kl"
    method_id: ClassVar[MethodId] = MethodId.DPPO_KL


def dppo_kept(cfg: DppoTvConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor):
    """DPPO's trust region in probability space: whether the token's probability ``p = e^l`` stayed within
    the divergence thresholds of ``q = e^l_old`` (A > 0 against ``delta_high``, A <= 0 against ``delta_low``).
    Written as "not dropped", so that a NaN log-prob keeps its token and reaches the loss."""
    p, q = logp.detach().exp(), old_logp.exp()
    pos = advantage > 0
    if cfg.method_id == MethodId.DPPO_TV:
        return ~torch.where(pos, p - q > cfg.delta_high, p - q < -cfg.delta_low)
    # binary KL(q || p) of the token's own probability; a move towards the advantage's side is always kept
    binary_kl = q * (old_logp - logp.detach()) + (1.0 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    return ~torch.where(pos, (binary_kl > cfg.delta_high) & (p > q), (binary_kl > cfg.delta_low) & (p < q))


def _dppo(cfg: DppoTvConfig, x: TokenInputs) -> TokenTerms:
    rd, adv = x.ratio_detached, x.advantage
    kept = dppo_kept(cfg, x.logp, x.old_logp, adv)
    weight = torch.where(kept, torch.minimum(rd, full_like(cfg.is_cap, rd)), torch.zeros_like(rd))
    # Dropped tokens are LN (A < 0) or HP (A > 0); kept ones whose weight the cap truncated are DUAL; A = 0 is M.
    region = torch.where(kept, torch.where(rd > cfg.is_cap, Region.DUAL.value, Region.M.value),
                         torch.where(adv > 0, Region.HP.value, Region.LN.value))
    region = torch.where(adv == 0, Region.M.value, region).to(torch.int8)
    # A dropped token's value is 0, also where its log-prob is -inf (not 0 * -inf).
    return TokenTerms(torch.where(kept, -adv * weight * x.logp, 0.0), weight, region)


SPECS = (
    MethodSpec(DppoTvConfig, _dppo, "capped IS weight; drops tokens whose probability moved more "
               "than delta (total variation)",
               "DPPO: Divergence-Proximal Policy Optimization, arXiv:2602.04879",
               variants=({}, {"delta_low": 0.05, "delta_high": 0.1, "is_cap": 1.5})),
    MethodSpec(DppoKlConfig, _dppo, "DPPO with the binary KL of the token's probability as the divergence",
               "DPPO: Divergence-Proximal Policy Optimization, arXiv:2602.04879",
               variants=({}, {"delta_low": 0.01, "delta_high": 0.02, "is_cap": 1.5})),
)
