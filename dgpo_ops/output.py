from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch


class PolicyLossOutput(NamedTuple):
    """What every policy-loss entry point returns."""

    loss: torch.Tensor  # scalar, differentiable
    logps: torch.Tensor  # per-token log-probs of the targets, fp32, detached; (B, T) or (N,)
    entropy: torch.Tensor  # per-token entropy, fp32, detached
    metrics: Mapping[str, torch.Tensor]  # a LossMetrics: name -> 0-dim fp32 tensor, read lazily
