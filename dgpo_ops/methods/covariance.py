"""Clip-Cov and KL-Cov (verl's clip_cov, kl_cov): tokens picked by the covariance of advantage and log-prob over
the call, a batch-level token selection after the per-token terms."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import Region
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import eps_high_param, eps_low_param, ppo_clip, unclipped_ratio
from dgpo_ops.methods.selection import random_subset, selection_size, token_covariance, top_subset


@dataclass(frozen=True)
class ClipCovConfig(MethodConfig):
    name: ClassVar[str] = "clip_cov"
    eps_low: float = eps_low_param()
    eps_high: float = eps_high_param()
    clip_cov_ratio: float = param(2e-4, "fraction of the scored tokens whose gradient is cut (at least one)",
                                  low=0.0, low_open=True, high=1.0)
    clip_cov_lb: float = param(1.0, "a cut token's covariance is above clip_cov_lb")
    clip_cov_ub: float = param(5.0, "a cut token's covariance is below clip_cov_ub")


@dataclass(frozen=True)
class KlCovConfig(MethodConfig):
    name: ClassVar[str] = "kl_cov"
    kl_cov_ratio: float = param(2e-4, "fraction of the scored tokens (the largest covariances, at least one) that "
                                "get the penalty", low=0.0, low_open=True, high=1.0)
    ppo_kl_coef: float = param(0.1, "weight of the penalty abs(l - l_old) on the chosen tokens", low=0.0)


def _clip_cov(cfg: ClipCovConfig, x: TokenInputs) -> TokenTerms:
    return ppo_clip(x, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, math.inf)


def _clip_cov_selection(cfg: ClipCovConfig, terms: TokenTerms, x: TokenInputs, scored, generator) -> TokenTerms:
    """verl's clip_cov: of the scored tokens PPO did not clip whose covariance lies in (lb, ub), a random
    ``clip_cov_ratio`` of the scored count (at least one) get no loss and no gradient (region DUAL)."""
    covariance = token_covariance(x.advantage, x.logp.detach(), scored, eps=1e-8)
    ppo_clipped = (terms.region == Region.LN.value) | (terms.region == Region.HP.value)
    candidates = scored & ~ppo_clipped & (covariance > cfg.clip_cov_lb) & (covariance < cfg.clip_cov_ub)
    cut = random_subset(candidates, selection_size(scored, cfg.clip_cov_ratio), generator)
    return TokenTerms(torch.where(cut, 0.0, terms.loss), torch.where(cut, 0.0, terms.psi),
                      torch.where(cut, Region.DUAL.value, terms.region).to(torch.int8), terms.penalty_slope)


def _kl_cov_selection(cfg: KlCovConfig, terms: TokenTerms, x: TokenInputs, scored, generator) -> TokenTerms:
    """verl's kl_cov: the ``kl_cov_ratio`` of the scored tokens (at least one) with the largest covariance get
    ``ppo_kl_coef |l - l_old|`` on top of -A r."""
    covariance = token_covariance(x.advantage, x.logp.detach(), scored, eps=0.0)
    chosen = top_subset(covariance, scored, selection_size(scored, cfg.kl_cov_ratio))
    drift = x.logp - x.old_logp
    loss = torch.where(chosen, terms.loss + cfg.ppo_kl_coef * drift.abs(), terms.loss)
    slope = torch.where(chosen, cfg.ppo_kl_coef * torch.sign(drift.detach()), 0.0)  # |x|' at 0 is 0, as torch's
    return TokenTerms(loss, terms.psi, terms.region, slope)


SPECS = (
    MethodSpec(ClipCovConfig, _clip_cov, "PPO clip; a random few tokens of high covariance of A and "
               "log-prob get no gradient",
               "Clip-Cov: Cui et al. 2025, 'The Entropy Mechanism of Reinforcement Learning for "
               "Reasoning Language Models', arXiv:2505.22617",
               # ratio 1 cuts every candidate: tests comparing two paths then cut the same tokens
               # (tests/methods/test_token_selection.py draws at the default ratio)
               variants=({"clip_cov_ratio": 1.0}, {"clip_cov_ratio": 1.0, "clip_cov_lb": -1.0,
                                                   "clip_cov_ub": 1.0}),
               token_selection=_clip_cov_selection),
    MethodSpec(KlCovConfig, unclipped_ratio, "unclipped ratio; the tokens of highest covariance of A and "
               "log-prob get a penalty on the log-ratio's absolute value",
               "KL-Cov: Cui et al. 2025, arXiv:2505.22617",
               variants=({}, {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}), token_selection=_kl_cov_selection),
)
