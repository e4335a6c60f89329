"""VESPO (TRL's loss_type='vespo'): a response's gamma weight of its ratio product times the log-prob, evaluated
at its own sequence statistic, the summed log-ratio."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import LOG_RATIO_CLAMP
from dgpo_ops.methods.base import MethodConfig, MethodSpec, SequenceInputs, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import full_like

LOG_W_MIN = math.log(1e-8)  # TRL's floor of the log-weight (get_gamma_weights)


def _vespo_param(default, what: str, sign: str):
    return param(default, f"gamma {what} for A {sign} 0", low=0.0)


@dataclass(frozen=True)
class VespoConfig(MethodConfig):
    name: ClassVar[str] = "vespo"
    k_pos: float = _vespo_param(2.0, "shape", ">=")
    lambda_pos: float = _vespo_param(3.0, "rate", ">=")
    k_neg: float = _vespo_param(3.0, "shape", "<")
    lambda_neg: float = _vespo_param(2.0, "rate", "<")


def summed_log_ratio(cfg: VespoConfig, x: SequenceInputs) -> torch.Tensor:
    """Each response's summed token log-ratios, each clamped to +-20, plus its rollout weights' logs (floored at
    log 1e-8, at most 20), broadcast back to its tokens, detached: TRL's vespo log-weight (get_gamma_weights,
    where the rollout weights are vLLM's importance ratio)."""
    mask = x.mask
    total = torch.where(mask, x.log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0).sum(1, keepdim=True)
    if x.rollout_weights is not None:
        log_weights = torch.log(x.rollout_weights).clamp(LOG_W_MIN, LOG_RATIO_CLAMP)
        total = total + torch.where(mask, log_weights, 0.0).sum(1, keepdim=True)
    return total.expand_as(x.log_ratio)


def _vespo(cfg: VespoConfig, x: TokenInputs) -> TokenTerms:
    # x.log_ratio is the response's summed token log-ratios (summed_log_ratio, its sequence statistic): w is the product of
    # its ratios, phi = w^k e^(lambda (1 - w)) its gamma weight (phi(1) = 1), detached as in TRL's get_gamma_weights.
    rd, adv = x.ratio_detached, x.advantage
    pos = adv >= 0
    k = torch.where(pos, full_like(cfg.k_pos, rd), full_like(cfg.k_neg, rd))
    rate = torch.where(pos, full_like(max(cfg.lambda_pos, 1e-4), rd), full_like(max(cfg.lambda_neg, 1e-4), rd))
    log_w = x.log_ratio.detach().clamp(LOG_W_MIN, LOG_RATIO_CLAMP)
    phi = torch.exp(rate + k * log_w - rate * log_w.exp())
    # A weight beyond the dtype's range (k = 10, lambda = 0, log w = 10: 3e42 in float32) is 0, as TRL's
    # nan_to_num(posinf=0): it drops that response. A NaN stays NaN (a bad input must reach the loss).
    phi = torch.where(phi == math.inf, 0.0, phi)
    # A weight of exactly 0 (w far above its peak) silences the token, also where l is infinite (not 0 * inf)
    silenced = (phi == 0) & x.logp.detach().isinf()
    return TokenTerms(torch.where(silenced, 0.0, -adv * phi * x.logp), phi, torch.zeros_like(rd, dtype=torch.int8))


SPECS = (
    MethodSpec(VespoConfig, _vespo, "a sequence's gamma weight of its ratio product times the log-prob",
               "VESPO: TRL 1.16's loss_type='vespo' (GRPOTrainer.get_gamma_weights)",
               variants=({}, {"k_pos": 1.0, "lambda_pos": 0.5, "k_neg": 4.0, "lambda_neg": 1.0}),
               sequence_statistic=summed_log_ratio),
)
