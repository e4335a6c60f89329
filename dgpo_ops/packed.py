"""Packed (padding-free) token layouts: the tokens of ``B`` responses back to back, ``(total_tokens, ...)``,
with boundaries ``cu_seqlens = [0, len_0, len_0 + len_1, ..., total_tokens]`` as flash-attention's
varlen kernels and verl's remove-padding take them.

Only O(tokens) vectors ever change layout: per-token inputs are laid on the padded ``(B, max_seqlen)``
grid the aggregations, per-response advantages and GSPO's sequence ratio are defined on, and per-token
results come back in packed order. The logits (or hidden states) are read where they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .inputs import PER_TOKEN_FLOATS, LossBatch
from .kernels.interface import IGNORE_INDEX


@dataclass(frozen=True)
class PackedLayout:
    n_tokens: int
    n_seqs: int
    max_seqlen: int
    grid_index: torch.Tensor  # int64 (n_tokens,): each packed token's flat index on the (B, max_seqlen) grid

    @classmethod
    def build(cls, cu_seqlens, n_tokens: int, device, max_seqlen: int | None = None) -> "PackedLayout":
        """Checks ``cu_seqlens`` against the ``n_tokens`` packed tokens. Without ``max_seqlen`` the
        longest sequence is read on the host (a synchronisation on CUDA; pass it, as to flash-attention,
        to avoid one). Boundary values are read on the host for the checks only on CPU tensors."""
        if not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32,
                                                                                                 torch.int64):
            raise ValueError("cu_seqlens must be a 1-D int32 or int64 tensor [0, len_0, len_0 + len_1, ..., "
                             "total_tokens]")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must hold at least two boundaries (one sequence), got {cu_seqlens.numel()}")
        if cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the tokens are on {device}")
        if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                       or max_seqlen < 1):
            raise ValueError(f"max_seqlen must be a positive integer, got {max_seqlen!r}")
        cu = cu_seqlens.to(torch.int64)
        lengths = cu[1:] - cu[:-1]
        if cu.device.type == "cpu":
            if int(cu[0]) != 0 or int(cu[-1]) != n_tokens:
                raise ValueError(f"cu_seqlens must start at 0 and end at the number of packed tokens ({n_tokens}), "
                                 f"got {int(cu[0])} ... {int(cu[-1])}")
            if bool((lengths < 0).any()):
                raise ValueError("cu_seqlens must be non-decreasing")
        if max_seqlen is None:
            max_seqlen = max(int(lengths.max()), 1)
        elif cu.device.type == "cpu" and int(lengths.max()) > max_seqlen:
            raise ValueError(f"max_seqlen ({max_seqlen}) is shorter than the longest sequence in cu_seqlens "
                             f"({int(lengths.max())})")
        n_seqs = lengths.numel()
        token = torch.arange(n_tokens, device=device)
        seq = torch.searchsorted(cu[1:], token, right=True).clamp(max=n_seqs - 1)
        grid_index = seq * max_seqlen + (token - cu[seq])
        return cls(n_tokens, n_seqs, max_seqlen, grid_index)

    @property
    def grid(self) -> tuple[int, int]:
        return self.n_seqs, self.max_seqlen

    def pad(self, values: torch.Tensor, fill) -> torch.Tensor:
        """``(n_tokens, ...)`` -> ``(B, max_seqlen, ...)``, ``fill`` where there is no token (differentiable)."""
        grid = values.new_full((self.n_seqs * self.max_seqlen, *values.shape[1:]), fill)
        return grid.index_copy(0, self.grid_index, values).reshape(*self.grid, *values.shape[1:])

    def unpad(self, values: torch.Tensor) -> torch.Tensor:
        """``(B, max_seqlen, ...)`` -> ``(n_tokens, ...)`` (differentiable)."""
        return values.reshape(-1, *values.shape[2:]).index_select(0, self.grid_index)

    def padded_batch(self, batch: LossBatch) -> LossBatch:
        """The per-token inputs on the padded grid: target ids -100 and the mask False where there is no
        token; per-response advantages ``(B,)`` stay as they are."""
        def check(name, value):
            if torch.is_tensor(value) and value.shape[:1] != (self.n_tokens,):
                raise ValueError(f"{name} must have shape ({self.n_tokens},) for packed tokens "
                                 f"(cu_seqlens), got {tuple(value.shape)}")

        target_ids = batch.target_ids
        check("target_ids", target_ids)
        padded = {"target_ids": self.pad(target_ids, IGNORE_INDEX)}
        if batch.mask is not None:
            check("mask", batch.mask)
            padded["mask"] = self.pad(batch.mask, 0)
        for name in PER_TOKEN_FLOATS:
            value = getattr(batch, name)
            if value is None or not torch.is_tensor(value):
                continue
            if name == "advantages" and value.dim() == 1 and value.shape[0] == self.n_seqs != self.n_tokens:
                continue  # per response
            check(name, value)
            padded[name] = self.pad(value.detach(), 0.0)
        return batch._replace(**padded)
