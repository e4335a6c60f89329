"""GSPO's sequence ratio (``importance_sampling_level="sequence"``): any per-token method evaluated at its
response's mean log-ratio. A sequence statistic of the same kind as a method's own (``MethodSpec.sequence_statistic``),
chosen by the option instead of by the method."""

from __future__ import annotations

import torch

from dgpo_ops.methods.base import MethodConfig, SequenceInputs


def mean_log_ratio(cfg: MethodConfig, x: SequenceInputs) -> torch.Tensor:
    """Masked mean of the log-ratios over each response, broadcast back to its tokens (differentiable)."""
    lengths = x.mask.sum(dim=1, keepdim=True).clamp(min=1)
    return (torch.where(x.mask, x.log_ratio, 0.0).sum(dim=1, keepdim=True) / lengths).expand_as(x.log_ratio)
