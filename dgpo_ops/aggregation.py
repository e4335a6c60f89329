"""Aggregations: the per-token scale ``s_t`` with loss = sum_t s_t L_t over unmasked tokens.

Each aggregation is a within-response weight (1 or 1/|o_i|) divided by a denominator; the
denominator can be supplied from outside (``loss_normalizer``), e.g. the global token or
response count across gradient-accumulation steps and processes.
"""

from __future__ import annotations

import math

import torch

# name -> (divide each token by its response length?, default denominator as a function of (mask))
AGGREGATIONS = {
    "token_mean": (False, lambda mask: mask.sum()),
    "seq_mean_token_mean": (True, lambda mask: mask.shape[0]),
    "seq_mean_token_sum_norm": (False, lambda mask: mask.shape[0] * mask.shape[1]),
    "seq_sum_token_mean": (True, lambda mask: 1),
}

TOKEN_LEVEL_AGGREGATIONS = ("token_mean",)


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")


def check_loss_normalizer(loss_normalizer) -> None:
    if loss_normalizer is None:
        return
    value = float(loss_normalizer)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"loss_normalizer must be a finite number > 0, got {loss_normalizer!r}")


def token_scales(mask: torch.Tensor, aggregation: str, loss_normalizer: float | torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token scale s_t (zero on masked tokens) for a boolean ``(B, T)`` mask."""
    check_aggregation(aggregation)
    check_loss_normalizer(loss_normalizer)
    per_response, default_denominator = AGGREGATIONS[aggregation]
    scale = mask.to(dtype)
    if per_response:
        scale = scale / mask.sum(dim=1, keepdim=True).clamp(min=1)
    if loss_normalizer is not None:
        return scale / loss_normalizer
    # An all-masked batch gives a zero loss, not 0/0.
    denominator = default_denominator(mask)
    if torch.is_tensor(denominator):
        return scale / denominator.to(dtype).clamp(min=1)
    return scale / max(denominator, 1)
