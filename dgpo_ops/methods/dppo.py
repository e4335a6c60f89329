"""DPPO-TV and DPPO-KL: a capped importance weight; tokens whose probability moved further than a divergence
threshold are dropped. prime-rl's default loss and its ``ipo`` keep tokens by the same total variation and add a
squared log-ratio penalty to the plain ratio (``prime_dppo``, ``prime_ipo``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import KernelParam, MethodId, Region
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import full_like
from dgpo_ops.methods.dro import proximal_penalty


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


def _prime_param(default, help: str):
    return param(default, help, low=0.0)


def _adv_tau():
    return _prime_param(1.0, "the advantage is scaled by adv_tau")


def _kl_tau():
    return _prime_param(1e-3, "weight of the penalty kl_tau (l - l_old)^2 on every scored token, dropped ones too")


@dataclass(frozen=True)
class PrimeDppoConfig(MethodConfig):
    name: ClassVar[str] = "prime_dppo"
    method_id: ClassVar[MethodId] = MethodId.PRIME_DPPO
    # prime-rl's dppo_mask_low / dppo_mask_high: DPPO-TV's thresholds
    delta_low: float = _dppo_threshold(0.2, "low")
    delta_high: float = _dppo_threshold(0.2, "high")
    adv_tau: float = _adv_tau()
    kl_tau: float = _kl_tau()

    def _kernel_slots(self):
        return {KernelParam.THRESHOLD_LOW: self.delta_low, KernelParam.THRESHOLD_HIGH: self.delta_high,
                KernelParam.ADV_SCALE: self.adv_tau, KernelParam.PROXIMAL_BETA: 2.0 * self.kl_tau}


@dataclass(frozen=True)
class PrimeIpoConfig(MethodConfig):
    name: ClassVar[str] = "prime_ipo"
    method_id: ClassVar[MethodId] = MethodId.PRIME_IPO
    threshold: float = _prime_param(0.1, "a token whose probability moved further than threshold, either way and "
                                         "whatever the sign of A, is dropped")
    adv_tau: float = _adv_tau()
    kl_tau: float = _kl_tau()

    @property
    def delta_low(self) -> float:  # the symmetric band is DPPO-TV's with both thresholds at ``threshold``
        return self.threshold

    @property
    def delta_high(self) -> float:
        return self.threshold

    _kernel_slots = PrimeDppoConfig._kernel_slots  # the band's thresholds through delta_low / delta_high


def dppo_kept(cfg: DppoTvConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor):
    """DPPO's trust region in probability space: whether the token's probability ``p = e^l`` stayed within
    the divergence thresholds of ``q = e^l_old`` (A > 0 against ``delta_high``, A <= 0 against ``delta_low``;
    prime_ipo: both, whatever A). Written as "not dropped", so that a NaN log-prob keeps its token and reaches
    the loss."""
    p, q = logp.detach().exp(), old_logp.exp()
    pos = advantage > 0
    if cfg.method_id != MethodId.DPPO_KL:
        rose, fell = p - q > cfg.delta_high, p - q < -cfg.delta_low
        return ~(rose | fell) if cfg.method_id == MethodId.PRIME_IPO else ~torch.where(pos, rose, fell)
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


def _prime(cfg: PrimeDppoConfig | PrimeIpoConfig, x: TokenInputs) -> TokenTerms:
    # prime-rl's default_loss_fn / ipo_loss_fn: -(adv_tau A) r on the kept tokens (r with its gradient, unclipped)
    # plus kl_tau (l - l_old)^2 on every token, the dropped ones too.
    rd, adv = x.ratio_detached, x.advantage
    kept = dppo_kept(cfg, x.logp, x.old_logp, adv)
    psi = torch.where(kept, cfg.adv_tau * rd, 0.0)
    penalty, slope = proximal_penalty(2.0 * cfg.kl_tau, x)
    loss = torch.where(kept, -cfg.adv_tau * adv * x.ratio, 0.0) + penalty
    # A dropped token is on the side its probability moved to (HP / LP for A > 0, HN / LN for A < 0); A = 0 is M.
    rose = x.logp.detach() > x.old_logp
    region = torch.where(rose, torch.where(adv > 0, Region.HP.value, Region.HN.value),
                         torch.where(adv > 0, Region.LP.value, Region.LN.value))
    region = torch.where(kept | (adv == 0), Region.M.value, region).to(torch.int8)
    return TokenTerms(loss, psi, region, slope)


SPECS = (
    MethodSpec(DppoTvConfig, _dppo, "capped IS weight; drops tokens whose probability moved more "
               "than delta (total variation)",
               "DPPO: Divergence-Proximal Policy Optimization, arXiv:2602.04879",
               variants=({}, {"delta_low": 0.05, "delta_high": 0.1, "is_cap": 1.5})),
    MethodSpec(DppoKlConfig, _dppo, "DPPO with the binary KL of the token's probability as the divergence",
               "DPPO: Divergence-Proximal Policy Optimization, arXiv:2602.04879",
               variants=({}, {"delta_low": 0.01, "delta_high": 0.02, "is_cap": 1.5})),
    MethodSpec(PrimeDppoConfig, _prime, "prime-rl's default: the ratio on DPPO-TV's kept tokens plus kl_tau (log r)^2",
               "prime-rl's default loss (DPPO-Binary-TV, arXiv:2602.04879, with Kimi K2.5's KL term, "
               "arXiv:2602.02276)",
               variants=({}, {"delta_low": 0.05, "delta_high": 0.1, "adv_tau": 0.5, "kl_tau": 0.3})),
    MethodSpec(PrimeIpoConfig, _prime, "prime-rl's ipo: prime_dppo with a keep band symmetric in p - q",
               "prime-rl's loss type 'ipo' (src/prime_rl/trainer/rl/loss.py, ipo_loss_fn)",
               variants=({}, {"threshold": 0.05, "adv_tau": 2.0, "kl_tau": 0.2})),
)
