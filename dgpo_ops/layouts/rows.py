"""Where one call's rows lie, for the row pipeline (``dgpo_ops.ops.pipeline``): the rows the kernels read
(one per token of the logits or hidden states, as the caller passed them), the ``(B, T)`` grid the
objective is defined on, and the vocabulary's columns. One object answers for every layout:

* padded ``(B, T, V)`` or flat ``(N, V)``: the rows are the grid;
* packed ``(N, V)`` with ``cu_seqlens``: the rows are in packed order, the grid is ``(B, max_seqlen)``
  (``dgpo_ops.layouts.packed``);
* a vocabulary split across a process group: this process's columns, the rows' partials merged with one
  all-reduce (``dgpo_ops.layouts.vocab``);

and both of the last two at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed

from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.kernels.row_io import RowWorkspace, RowInputs
from dgpo_ops.layouts.packed import PackedLayout
from dgpo_ops.layouts.vocab import VocabShard, merge_row_partials, vocab_shard


@dataclass(frozen=True)
class CallLayout:
    """The caller's description of a call's layout beyond the tensors' shapes: the process group over which
    the vocabulary is split, and the boundaries of packed sequences."""

    vocab_parallel_group: object = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None

    def __post_init__(self):
        if self.max_seqlen is not None and self.cu_seqlens is None:
            raise ValueError("max_seqlen goes with cu_seqlens (packed sequences)")

    @property
    def is_default(self) -> bool:
        """One process's whole vocabulary, the tokens on the grid as passed."""
        return self.vocab_parallel_group is None and self.cu_seqlens is None


@dataclass(frozen=True)
class RowLayout:
    token_shape: torch.Size  # the rows' token shape as the caller passed them: (B, T) or (N,)
    columns: int  # the vocabulary columns this process's rows hold
    packed: PackedLayout | None = None
    shard: VocabShard | None = None

    @classmethod
    def build(cls, layout: CallLayout, token_shape, columns: int, device, check: bool) -> "RowLayout":
        """``check``: immediate validation (host reads allowed); without it every check stays on the device."""
        token_shape = torch.Size(token_shape)
        packed = shard = None
        if layout.cu_seqlens is not None:
            if len(token_shape) != 1:
                raise ValueError(f"packed tokens (cu_seqlens) are (total_tokens, V) logits or (total_tokens, H) "
                                 f"hidden states, got token shape {tuple(token_shape)}")
            packed = PackedLayout.build(layout.cu_seqlens, token_shape[0], device, layout.max_seqlen, check)
        if layout.vocab_parallel_group is not None:
            shard = vocab_shard(layout.vocab_parallel_group, columns, token_shape.numel(), device, check)
        return cls(token_shape, columns, packed, shard)

    @property
    def vocab(self) -> int:
        """The whole vocabulary's size."""
        return self.columns if self.shard is None else self.shard.vocab

    @property
    def vocab_split(self) -> tuple[int, int] | None:
        """``(vocab_start, vocab_total)`` for the row forward, or None for a whole vocabulary."""
        return None if self.shard is None else self.shard.split

    @property
    def finishes_rows_in_kernel(self) -> bool:
        """The row forward finishes each row (and may evaluate the method in its epilogue) only when its
        columns are the whole vocabulary and its rows are the grid's tokens."""
        return self.packed is None and self.shard is None

    def grid_logits_shape(self) -> torch.Size:
        """The shape the loss inputs are checked against: ``(*grid, V)``."""
        tokens = self.token_shape if self.packed is None else self.packed.grid
        return torch.Size((*tokens, self.vocab))

    def grid_batch(self, batch: LossInputs) -> LossInputs:
        """The per-token inputs on the objective's grid (packed ones padded, O(tokens))."""
        return batch if self.packed is None else self.packed.padded_batch(batch)

    def row_inputs(self, batch: LossInputs, grid_inputs: RowInputs) -> RowInputs:
        """What the row forward reads per row: the grid's inputs, or for packed rows the caller's flat target ids
        and mask in packed order (its other inputs are not read: a packed call has no epilogue)."""
        if self.packed is None:
            return grid_inputs
        return RowInputs((1, self.packed.n_tokens), True, batch.target_ids.detach(), grid_inputs.advantages,
                         None if batch.mask is None else batch.mask.detach(),
                         objective_inputs=dict.fromkeys(grid_inputs.objective_inputs))

    def merge(self, workspace: RowWorkspace) -> None:
        """After the row forward: a split vocabulary's partials merged over the group (nothing otherwise)."""
        if self.shard is not None and self.shard.agreed:
            merge_row_partials(workspace.planes(), workspace.target_index, self.shard.group)
        elif self.shard is not None:  # sizes that disagree (deferred validation): NaN rows, nothing sent
            workspace.planes().fill_(float("nan"))

    def reduce_hidden_grad(self, grad_hidden: torch.Tensor | None) -> None:
        """From hidden states, every process's columns add to the hidden state's gradient: sum it over the group
        (in place; nothing for a whole vocabulary)."""
        if self.shard is not None and self.shard.agreed and grad_hidden is not None:
            torch.distributed.all_reduce(grad_hidden, op=torch.distributed.ReduceOp.SUM, group=self.shard.group)

    def errors(self) -> torch.Tensor | None:
        """InputError bits the layout found on the device (int64 scalar), or None."""
        if self.packed is None and self.shard is None:  # the tokens as passed: nothing to find
            return None
        found = [bits for bits in (self.packed and self.packed.errors, self.shard and self.shard.errors)
                 if bits is not None]
        if not found:
            return None
        return found[0] if len(found) == 1 else found[0] | found[1]

    def to_grid(self, values: torch.Tensor, fill) -> torch.Tensor:
        """Per-row values ``(n_rows,)`` on the ``(B, T)`` grid (differentiable)."""
        if self.packed is None:
            return values
        return self.packed.pad(values, fill)

    def backward_workspace(self, workspace: RowWorkspace, grid_seq_len: int) -> tuple[RowWorkspace, int]:
        """``(workspace, grid_seq_len)`` for the gradient kernel, which reads a row's aggregation scale at
        ``seq_scale[row // grid_seq_len]``: packed rows get one scale per row."""
        if self.packed is None:
            return workspace, grid_seq_len
        row_scale = workspace.seq_scale[self.packed.sequence_of_token]
        return dataclasses.replace(workspace, seq_scale=row_scale), 1
