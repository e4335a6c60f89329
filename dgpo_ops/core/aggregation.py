"""Aggregations: the per-token scale ``s_t`` with loss = sum_t s_t L_t over unmasked tokens.

Each aggregation is a within-response weight (1 or 1/|o_i|) divided by a denominator; the
denominator can be supplied from outside (``loss_normalizer``), e.g. the global token or
response count across gradient-accumulation steps and processes.
"""

from __future__ import annotations

import math

import torch

from dgpo_ops.core.validation import FLOAT32_MAX, FLOAT32_TINY, MESSAGES
from dgpo_ops.kernels.interface import Denominator, InputError

# name -> (divide each token by its response length?, default denominator): the prologue kernel
# reads the same two codes.
AGGREGATIONS: dict[str, tuple[bool, Denominator]] = {
    "token_mean": (False, Denominator.TOKENS),
    "seq_mean_token_mean": (True, Denominator.RESPONSES),
    "seq_mean_token_sum_norm": (False, Denominator.GRID),
    "seq_sum_token_mean": (True, Denominator.ONE),
    "seq_mean_token_sum": (False, Denominator.RESPONSES),  # TRL's luspo: mean over responses of |o_i| l_i
    "token_sum": (False, Denominator.ONE),  # verl's token-sum: the plain sum over scored tokens
}

TOKEN_LEVEL_AGGREGATIONS = ("token_mean", "token_sum")  # no response structure needed


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")


def check_normalizer_form(loss_normalizer) -> None:
    """A number or a one-element real tensor (its value is not read here)."""
    if torch.is_tensor(loss_normalizer):
        if loss_normalizer.numel() != 1 or loss_normalizer.dtype == torch.bool or loss_normalizer.is_complex():
            raise ValueError("loss_normalizer must be a number or a one-element real tensor, got a tensor of "
                             f"shape {tuple(loss_normalizer.shape)} and dtype {loss_normalizer.dtype}")
    elif isinstance(loss_normalizer, bool) or not isinstance(loss_normalizer, (int, float)):
        raise ValueError(f"loss_normalizer must be a number or a one-element tensor, got {loss_normalizer!r}")


def check_normalizer_value(value: float) -> None:
    if not math.isfinite(value) or not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise ValueError(MESSAGES[InputError.LOSS_NORMALIZER].format(normalizer=repr(value)))


def check_loss_normalizer(loss_normalizer) -> None:
    """A finite number > 0, or a one-element real tensor holding one (read here: host code only)."""
    if loss_normalizer is None:
        return
    check_normalizer_form(loss_normalizer)
    check_normalizer_value(float(loss_normalizer) if torch.is_tensor(loss_normalizer) else loss_normalizer)


def token_scales(mask: torch.Tensor, aggregation: str, loss_normalizer: float | torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token scale s_t (zero on masked tokens) for a boolean ``(B, T)`` mask."""
    check_aggregation(aggregation)
    if not torch.compiler.is_compiling():  # compiled, the reference checks it in dgpo_ops::checked_inputs
        check_loss_normalizer(loss_normalizer)
    per_response, default_denominator = AGGREGATIONS[aggregation]
    scale = mask.to(dtype)
    if per_response:
        scale = scale / mask.sum(dim=1, keepdim=True).clamp(min=1)
    if loss_normalizer is not None:
        if torch.is_tensor(loss_normalizer):
            loss_normalizer = loss_normalizer.reshape(())
        return scale / loss_normalizer
    # An all-masked batch gives a zero loss, not 0/0.
    if default_denominator == Denominator.TOKENS:
        return scale / mask.sum().to(dtype).clamp(min=1)
    sizes = {Denominator.RESPONSES: mask.shape[0], Denominator.GRID: mask.shape[0] * mask.shape[1], Denominator.ONE: 1}
    return scale / max(sizes[default_denominator], 1)
