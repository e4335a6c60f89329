"""``PolicyLossOutput``: what every policy-loss entry point returns (the loss, per-token log-probs and
entropies, the call's metrics)."""

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

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, logps, entropy, metrics vector)``: the output as plain tensors, for a module's forward
        whose hooks (FSDP2, DeepSpeed) look for tensors in tuples (``dgpo_ops.distributed.head``)."""
        return self.loss, self.logps, self.entropy, self.metrics.as_tensor()

    @classmethod
    def from_tensors(cls, tensors) -> "PolicyLossOutput":
        from dgpo_ops.core.metrics import LossMetrics

        loss, logps, entropy, stats = tensors
        return cls(loss, logps, entropy, LossMetrics(stats))
