"""The trust-region pieces several methods share: the clip parameters, region codes, PPO's clipped ratio, the
capped importance weight and the unclipped ratio. Each method's own terms are in its file."""

from __future__ import annotations

import math

import torch

from dgpo_ops.kernels.interface import KernelParam, Region
from dgpo_ops.methods.base import TokenInputs, TokenTerms, param


# The parameters several methods share: one definition each.
def eps_low_param(default=0.2):
    return param(default, "lower clip: the trust region starts at 1 - eps_low", low=0.0, high=1.0)


def eps_high_param(default=0.2):
    return param(default, "upper clip: the trust region ends at 1 + eps_high", low=0.0)


def dual_clip_param(default, optional=True):
    return param(default, "dual clip c > 1 for A < 0", low=1.0, low_open=True, optional=optional)


def symmetric_bounds(cfg) -> dict[KernelParam, float]:
    return {
        KernelParam.LOW_POS: 1.0 - cfg.eps_low,
        KernelParam.HIGH_POS: 1.0 + cfg.eps_high,
        KernelParam.LOW_NEG: 1.0 - cfg.eps_low,
        KernelParam.HIGH_NEG: 1.0 + cfg.eps_high,
    }


def full_like(value, like):
    return value if torch.is_tensor(value) else torch.full_like(like, value)


def regions(rd, adv, low, high):
    """Region codes from the trust region [low, high] (tensors or floats) and the sign of A."""
    pos, neg = adv > 0, adv < 0
    below, above = rd < low, rd > high
    region = torch.full_like(rd, Region.M.value, dtype=torch.int8)
    region = torch.where(below & neg, Region.LN.value, region)
    region = torch.where(above & pos, Region.HP.value, region)
    region = torch.where(below & pos, Region.LP.value, region)
    return torch.where(above & neg, Region.HN.value, region).to(torch.int8)


def ppo_clip(x: TokenInputs, low, high, dual_clip, delta=math.inf) -> TokenTerms:
    rd, adv = x.ratio_detached, x.advantage
    region = regions(rd, adv, low, high)
    in_ln = region == Region.LN.value
    clipped = in_ln | (region == Region.HP.value)
    loss = torch.where(clipped, -adv * torch.where(in_ln, full_like(low, rd), full_like(high, rd)), -adv * x.ratio)
    # TRL's delta, -min(min(r, delta) A, clip(r) A): for A > 0 the value is -A min(r, delta, high); for A < 0 a
    # ratio above both high and delta gives -A max(delta, high). Where it fires the gradient is 0 (DUAL, HP stays HP).
    capped_pos = (adv > 0) & (rd > delta)
    capped_neg = (adv < 0) & (rd > high) & (rd > delta)
    loss = torch.where(capped_pos, -adv * torch.minimum(full_like(delta, rd), full_like(high, rd)), loss)
    loss = torch.where(capped_neg, -adv * torch.maximum(full_like(delta, rd), full_like(high, rd)), loss)
    capped = capped_pos | capped_neg
    region = torch.where(capped & (region != Region.HP.value), Region.DUAL.value, region)
    dual = (adv < 0) & (rd > dual_clip)
    loss = torch.where(dual, -adv * dual_clip, loss)
    psi = torch.where(clipped | capped | dual, torch.zeros_like(rd), rd)
    return TokenTerms(loss, psi, torch.where(dual, Region.DUAL.value, region).to(torch.int8))


def capped_is(x: TokenInputs, low, high) -> TokenTerms:
    rd, adv = x.ratio_detached, x.advantage
    weight = torch.minimum(torch.maximum(rd, full_like(low, rd)), full_like(high, rd))
    return TokenTerms(-adv * weight * x.logp, weight, regions(rd, adv, low, high))


def unclipped_ratio(cfg, x: TokenInputs) -> TokenTerms:
    # -A r with nothing clipped: geo_mean at its clipped geometric mean, kl_cov's tokens before its selection
    rd = x.ratio_detached
    return TokenTerms(-x.advantage * x.ratio, rd, torch.zeros_like(rd, dtype=torch.int8))
