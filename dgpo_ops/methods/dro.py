"""DRO (verl's dro): the plain policy gradient plus a quadratic penalty on the log-ratio; Kimi k1.5's loss (ROLL's
``pg_variant="kimi15"``) is the same with the penalty's weight ``tau = 0.1``, an alias."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import KernelParam, MethodId
from dgpo_ops.methods.base import MethodAlias, MethodConfig, MethodSpec, TokenInputs, TokenTerms, param


@dataclass(frozen=True)
class DroConfig(MethodConfig):
    name: ClassVar[str] = "dro"
    method_id: ClassVar[MethodId] = MethodId.DRO
    # No default, as verl's policy_loss.dro_beta (None raises there too): DRO is its penalty.
    dro_beta: float | None = param(None, "weight of the penalty (dro_beta / 2) (l - l_old)^2; required", low=0.0,
                                   low_open=True)

    def _kernel_slots(self):
        return {KernelParam.PROXIMAL_BETA: self.dro_beta}


def proximal_penalty(beta: float, x: TokenInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(beta / 2) (l - l_old)^2`` on the unclamped log-ratio (as verl's dro and prime-rl's kl_tau term) and its
    slope ``beta (l - l_old)``, detached: ``TokenTerms.penalty_slope``, apart from psi."""
    drift = x.logp - x.old_logp
    return 0.5 * beta * drift * drift, beta * drift.detach()


def _dro(cfg: DroConfig, x: TokenInputs) -> TokenTerms:
    # REINFORCE plus the penalty, as verl's dro; psi is the policy-gradient part (1)
    rd = x.ratio_detached
    penalty, slope = proximal_penalty(cfg.dro_beta, x)
    return TokenTerms(-x.advantage * x.logp + penalty, torch.ones_like(rd), torch.zeros_like(rd, dtype=torch.int8),
                      slope)


SPECS = (
    MethodSpec(DroConfig, _dro, "plain policy gradient with a quadratic penalty on the log-ratio",
               "DRO as verl's policy_loss dro (Direct Reward Optimisation: Richemond et al. 2024, "
               "arXiv:2405.19107)", variants=({"dro_beta": 0.1}, {"dro_beta": 2.0})),
)
# ROLL's kimi15 (Kimi k1.5, arXiv:2501.12599, eq. 3): -A l + (tau / 2) (l - l_old)^2 with kimi15_tau = 0.1, dro's loss
ALIASES = (MethodAlias("kimi15", "dro", {"dro_beta": 0.1}, "Kimi k1.5's squared log-ratio penalty (ROLL's kimi15)"),)
