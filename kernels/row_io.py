"""Per-token inputs and outputs of the row kernels (and of their torch twins)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpo_ops.methods import MethodConfig


@dataclass
class EpilogueInputs:
    """What the forward epilogue needs to evaluate a token-level method: contiguous fp32 (B, T)."""

    method: MethodConfig | None
    method_params: torch.Tensor | None  # fp32 KernelParam vector
    advantages: torch.Tensor | None
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None  # only with a KL term
    rollout_weights: torch.Tensor | None
    beta: float
    kl_ratio_correction: bool = False

    @classmethod
    def absent(cls) -> "EpilogueInputs":
        return cls(None, None, None, None, None, None, 0.0)

    @property
    def method_id(self) -> int:
        return 0 if self.method is None else int(self.method.method_id)

    @property
    def gate_id(self) -> int:
        return 0 if self.method is None else int(self.method.gate_id)


@dataclass
class EpilogueOutputs:
    token_loss: torch.Tensor  # w L + beta KL (unscaled by the aggregation)
    dloss_dlogp: torch.Tensor  # its derivative in l
    psi: torch.Tensor
    region: torch.Tensor  # int8
    kl: torch.Tensor | None

    @classmethod
    def empty(cls, inputs: EpilogueInputs, shape, device) -> "EpilogueOutputs":
        def fp32():
            return torch.empty(shape, device=device, dtype=torch.float32)

        kl = fp32() if inputs.ref_logps is not None else None
        return cls(fp32(), fp32(), fp32(), torch.empty(shape, device=device, dtype=torch.int8), kl)


@dataclass
class RowForward:
    """Per-token results of the forward pass; log-sum-exp = row_max + log_norm (kept apart for precision)."""

    row_max: torch.Tensor
    log_norm: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    epilogue: EpilogueOutputs | None
