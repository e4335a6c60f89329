"""Batch-level token selection: the stage between the per-token terms and the gradient weights that picks
tokens by a statistic over every scored token of the call (verl's clip_cov and kl_cov pick tokens by the
covariance of advantage and log-prob). Everything stays on the device: the counts are device tensors and a
subset is read off a ranking, so a call makes no host read (verl's own code reads the counts and runs
``torch.randperm`` / ``torch.topk`` on the CPU).
"""

from __future__ import annotations

import torch


def token_covariance(advantage: torch.Tensor, logp: torch.Tensor, scored: torch.Tensor, eps: float) -> torch.Tensor:
    """``(A - mean A) (l - mean l)`` per token, the means over the scored tokens, each divided by the scored
    count plus ``eps`` (verl's ``masked_mean`` adds 1e-8, its kl_cov divides by the count itself: eps 0 with a
    count of at least 1)."""
    count = scored.sum().to(advantage.dtype)
    denominator = count + eps if eps else count.clamp(min=1)
    mean_a = torch.where(scored, advantage, 0.0).sum() / denominator
    mean_l = torch.where(scored, logp, 0.0).sum() / denominator
    return (advantage - mean_a) * (logp - mean_l)


def selection_size(scored: torch.Tensor, fraction: float) -> torch.Tensor:
    """``max(floor(fraction * scored tokens), 1)`` as a device tensor (in float64, as Python's
    ``int(fraction * n)`` computes it), 0 when no token is scored."""
    count = scored.sum().to(torch.float64)
    return torch.where(count > 0, torch.floor(count * fraction).clamp(min=1.0), 0.0)


def _ranks(keys: torch.Tensor) -> torch.Tensor:
    """Each element's position in the ascending (stable) order of ``keys``, shaped like ``keys``."""
    order = keys.reshape(-1).argsort(stable=True)
    ranks = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return ranks.reshape(keys.shape)


def random_subset(candidates: torch.Tensor, size: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``min(size, candidates)`` of the ``candidates`` (bool), uniformly at random: each token of the grid draws
    a key from ``generator`` (torch's default generator of the tensors' device when None; the callers check it is
    on that device) and the smallest keys win."""
    keys = torch.rand(candidates.shape, generator=generator, device=candidates.device, dtype=torch.float32)
    keys = torch.where(candidates, keys, 2.0)  # every non-candidate after every candidate
    return candidates & (_ranks(keys) < size)


def top_subset(scores: torch.Tensor, eligible: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """The ``size`` eligible tokens of the largest ``scores`` (ties: the first in row-major order)."""
    keys = torch.where(eligible, -scores, float("inf"))
    return eligible & (_ranks(keys) < size)
