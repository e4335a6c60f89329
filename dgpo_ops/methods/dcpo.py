"""DCPO: PPO's clip with bounds that depend on the old probability."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import KernelParam, MethodId
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import eps_high_param, eps_low_param, ppo_clip


@dataclass(frozen=True)
class DcpoConfig(MethodConfig):
    name: ClassVar[str] = "dcpo"
    method_id: ClassVar[MethodId] = MethodId.DCPO
    # DCPO's eps set a bound that depends on the old probability, not PPO's clip.
    eps_low: float = eps_low_param(0.16)
    eps_high: float = eps_high_param(0.2)
    r_max: float = param(10.0, "ratio cap (and dual clip)", low=1.0, low_open=True)

    def _kernel_slots(self):
        return {KernelParam.THRESHOLD_LOW: self.eps_low, KernelParam.THRESHOLD_HIGH: self.eps_high, KernelParam.RATIO_CAP: self.r_max}


def dcpo_bounds(cfg: DcpoConfig, old_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DCPO's trust region [lower(q), upper(q)] from the old probability q."""
    q = old_logp.exp()
    low = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * cfg.eps_low / q, min=0.0))
    high = torch.clamp(0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * cfg.eps_high / q), max=cfg.r_max)
    return low, high


def _dcpo(cfg: DcpoConfig, x: TokenInputs) -> TokenTerms:
    low, high = dcpo_bounds(cfg, x.old_logp)
    return ppo_clip(x, low, high, cfg.r_max)


SPECS = (
    MethodSpec(DcpoConfig, _dcpo, "PPO clip with bounds from the old probability",
               "DCPO: Yang et al. (Baichuan), 'Dynamic Clipping Policy Optimization'",
               aggregation="seq_sum_token_mean"),  # DCPO's "only token mean"
)
