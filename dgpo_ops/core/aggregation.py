"""Aggregations: the per-token scale ``s_t`` with loss = sum_t s_t L_t over unmasked tokens.

Each aggregation is a within-response weight (1 or 1/|o_i|) divided by a denominator; the
denominator can be supplied from outside (``loss_normalizer``), e.g. the global token or
response count across gradient-accumulation steps and processes.
"""

from __future__ import annotations

import math

import torch

from dgpo_ops import frameworks
from dgpo_ops.core.validation import FLOAT32_MAX, FLOAT32_TINY, MESSAGES
from dgpo_ops.kernels.interface import Denominator, InputError
from dgpo_ops.kernels.torch_twins import denominator_of

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


# "framework:mode" -> the row: each framework's rows are in its spec (``dgpo_ops.frameworks``).
FRAMEWORK_AGGREGATIONS = frameworks.FRAMEWORK_AGGREGATIONS


def aggregation_codes(aggregation: str) -> tuple[bool, Denominator]:
    """``(per_response, Denominator)`` of one of ours (``AGGREGATIONS``) or a framework's row
    (``"framework:mode"``, ``FRAMEWORK_AGGREGATIONS``): what the kernels, their twins and the reference read."""
    if aggregation in AGGREGATIONS:
        return AGGREGATIONS[aggregation]
    if aggregation in FRAMEWORK_AGGREGATIONS:
        row = FRAMEWORK_AGGREGATIONS[aggregation]
        return row.per_response, row.denominator
    check_aggregation(aggregation)
    raise AssertionError("unreachable")


def token_level(aggregation: str) -> bool:
    """The aggregation needs no response structure (flat ``(N, V)`` logits may use it)."""
    per_response, denominator = aggregation_codes(aggregation)
    return not per_response and denominator in (Denominator.TOKENS, Denominator.ONE)


def check_aggregation(aggregation: str) -> None:
    if not isinstance(aggregation, str) or (aggregation not in AGGREGATIONS
                                            and aggregation not in FRAMEWORK_AGGREGATIONS):
        framework = aggregation.split(":", 1)[0] if isinstance(aggregation, str) and ":" in aggregation else None
        frameworks = sorted({name.split(":", 1)[0] for name in FRAMEWORK_AGGREGATIONS})
        if framework is not None and framework in frameworks:
            modes = [name for name in FRAMEWORK_AGGREGATIONS if name.startswith(framework + ":")]
            raise ValueError(f"unknown aggregation {aggregation!r}; {framework}'s: {', '.join(modes)}")
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}, or a framework's "
                         f"mode as 'framework:mode' ({', '.join(frameworks)}; dgpo_ops.FRAMEWORK_AGGREGATIONS)")


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
    per_response, default_denominator = aggregation_codes(aggregation)
    scale = mask.to(dtype)
    if per_response:
        scale = scale / mask.sum(dim=1, keepdim=True).clamp(min=1)
    if loss_normalizer is not None:
        if torch.is_tensor(loss_normalizer):
            loss_normalizer = loss_normalizer.reshape(())
        return scale / loss_normalizer
    return scale / denominator_of(default_denominator, mask.sum(dim=1), mask.shape[1], dtype)
