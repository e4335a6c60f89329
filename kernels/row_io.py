"""Per-token inputs and outputs of the row kernels (and of their torch twins)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .interface import NUM_PLANES, NUM_SEQUENCE_STATS, NUM_STATS, NUM_STATUS


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the per-token math and the workspace for inputs of ``dtype``: fp32, or fp64 for fp64 inputs
    (gradcheck). The one home of this rule: every op and kernel set reads it here."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def on_token_grid(value: torch.Tensor, flat: bool, grid: tuple[int, int]) -> torch.Tensor:
    """A per-token input on the ``(B, T)`` grid, without a copy: a per-response ``(B,)`` value expanded over its
    tokens, a flat call's ``(N,)`` reshaped onto its grid. The one place this rule is written."""
    if flat:
        return value.reshape(grid)
    return value[:, None].expand(grid) if value.dim() == 1 else value


@dataclass
class RowInputs:
    """The per-token inputs of one call on its ``(B, T)`` grid, as the caller passed them.

    Nothing is converted or copied: the kernels read each tensor with its own dtype and strides.
    ``advantages`` may be per response (``(B,)``, read with a zero time stride). For flat ``(N, V)``
    logits the grid is ``(1, N)`` and every tensor is ``(N,)``.
    """

    grid: tuple[int, int]
    flat: bool
    target_ids: torch.Tensor  # int64 or int32; IGNORE_INDEX marks a token that is not scored
    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    rollout_weights: torch.Tensor | None = None
    # the per-token floats the kernels do not read (each response's score), by their LossInputs name, None
    # where not passed or not carried: what the torch objective reads beside the fields above
    objective_inputs: dict[str, torch.Tensor | None] = field(kw_only=True)

    def strides(self, tensor: torch.Tensor) -> tuple[int, int]:
        """(response stride, time stride) of a per-token or per-response tensor on the grid."""
        if self.flat:
            return 0, tensor.stride(0)
        if tensor.dim() == 1:  # per response
            return tensor.stride(0), 0
        return tensor.stride(0), tensor.stride(1)


@dataclass
class EpilogueInputs:
    """What the forward epilogue needs to evaluate a token-level method."""

    method_id: int
    gate_id: int
    method_params: torch.Tensor  # fp32 KernelParam vector on the device
    beta: float  # 0 leaves the KL out (ref_logps are then not read)
    entropy_coef: float
    kl_ratio_correction: bool = False


@dataclass
class RowWorkspace:
    """What one call's kernels write: per-token planes, per-response and per-call results.

    The host reads none of it on the hot path; ``status`` is read lazily (``dgpo_ops.core.validation``). A
    workspace made by ``allocate_rows`` holds only what the row forward writes until ``complete`` makes the rest.
    """

    per_token: torch.Tensor  # fp32 (NUM_PLANES, *token_shape), planes named by Plane
    target_index: torch.Tensor  # int64 (n_tokens,): the target id, or -1 for a token not scored
    # the per-call buffers, None between allocate_rows and complete:
    sequence_stats: torch.Tensor  # int64 (NUM_SEQUENCE_STATS, B)
    seq_scale: torch.Tensor  # fp32 (B,): the aggregation scale of each response
    status: torch.Tensor  # int64 (NUM_STATUS,), zeros before the prologue
    stats: torch.Tensor  # fp32 (NUM_STATS,): the metrics
    loss: torch.Tensor  # fp32 ()

    @classmethod
    def allocate(cls, token_shape, n_seqs: int, device, dtype=torch.float32, zero_planes=False) -> "RowWorkspace":
        """Buffers for the tokens of ``token_shape`` (``(B, T)`` or ``(N,)``): the planes take that
        shape too, so a plane is the per-token output as it is. ``dtype`` is fp64 only for the
        torch twins on fp64 logits. Planes a route does not write stay uninitialised unless
        ``zero_planes`` (a custom op hands every plane out, and its outputs must be deterministic)."""
        return cls.allocate_rows(token_shape, device, dtype, zero_planes).complete(n_seqs)

    @classmethod
    def allocate_rows(cls, token_shape, device, dtype=torch.float32, zero_planes=False) -> "RowWorkspace":
        """``allocate``'s planes and target index only, what the row forward writes: the logits op launches its row
        forward, the long pass over the logits, before it makes the other buffers (``complete``), so that launch
        waits on the host for two allocations, not seven (and not for the status's zero-fill kernel)."""
        planes = (torch.zeros if zero_planes else torch.empty)((NUM_PLANES, *token_shape), dtype=dtype, device=device)
        target_index = torch.empty((math.prod(token_shape),), dtype=torch.int64, device=device)
        return cls(planes, target_index, None, None, None, None, None)

    def complete(self, n_seqs: int) -> "RowWorkspace":
        """The per-call buffers for ``n_seqs`` responses where ``allocate_rows`` left them out (nothing otherwise):
        the prologue's counts and scales, the status, the metrics and the loss. Returns the workspace."""
        if self.status is None:
            floats, int64 = dict(dtype=self.per_token.dtype, device=self.per_token.device), dict(
                dtype=torch.int64, device=self.per_token.device)
            self.sequence_stats = torch.empty((NUM_SEQUENCE_STATS, n_seqs), **int64)
            self.seq_scale = torch.empty((n_seqs,), **floats)
            self.status = torch.zeros((NUM_STATUS,), **int64)
            self.stats = torch.empty((NUM_STATS,), dtype=torch.float32, device=self.per_token.device)  # every route
            self.loss = torch.empty((), **floats)
        return self

    def for_backward(self) -> "RowWorkspace":
        """The buffers the gradient kernel reads, for the autograd context: this workspace without the loss, which
        is the op's output. The output's ``grad_fn`` holds the context, so a context holding the output would be a
        reference cycle, freed (with the logits it saved) only when Python's garbage collector next runs."""
        return RowWorkspace(self.per_token, self.target_index, self.sequence_stats, self.seq_scale, self.status,
                            self.stats, None)

    @property
    def n_tokens(self) -> int:
        return self.target_index.shape[0]

    def planes(self) -> torch.Tensor:
        """The per-token planes as ``(NUM_PLANES, n_tokens)`` (a view)."""
        return self.per_token.view(NUM_PLANES, self.n_tokens)
