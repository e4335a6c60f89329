"""Packed (padding-free) token layouts: the tokens of ``B`` responses back to back, ``(total_tokens, ...)``,
with boundaries ``cu_seqlens = [0, len_0, len_0 + len_1, ..., total_tokens]`` as flash-attention's
varlen kernels and verl's remove-padding take them.

The row kernels read packed logits (or hidden states) where they are, one row per token, as flat ``(N, V)``
rows. Only O(tokens) vectors ever change layout: the per-token inputs are laid on the padded
``(B, max_seqlen)`` grid the prologue's counts, the aggregations, per-response advantages and GSPO's sequence
ratio are defined on, and the per-token results stay in packed order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpo_ops.core.inputs import TOKEN_FLOATS, LossInputs
from dgpo_ops.kernels.interface import IGNORE_INDEX, InputError


@dataclass(frozen=True)
class PackedLayout:
    n_tokens: int
    n_seqs: int
    max_seqlen: int
    grid_index: torch.Tensor  # int64 (n_tokens,): each packed token's flat index on the (B, max_seqlen) grid
    errors: torch.Tensor  # int64 (): InputError.CU_SEQLENS where cu_seqlens does not describe the tokens (device)

    @classmethod
    def build(cls, cu_seqlens, n_tokens: int, device, max_seqlen: int | None = None,
              check: bool = True) -> "PackedLayout":
        """Checks ``cu_seqlens`` against the ``n_tokens`` packed tokens: with ``check`` (immediate
        validation) on the host, raising ``ValueError``; always on the device into ``errors`` (deferred
        validation makes the loss and gradient NaN with it and raises the error later). Without ``max_seqlen`` the longest sequence is read on
        the host (a synchronisation on CUDA; pass it, as to flash-attention, to avoid one)."""
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
        if check:
            if int(cu[0]) != 0 or int(cu[-1]) != n_tokens:
                raise ValueError(f"cu_seqlens must start at 0 and end at the number of packed tokens ({n_tokens}), "
                                 f"got {int(cu[0])} ... {int(cu[-1])}")
            if bool((lengths < 0).any()):
                raise ValueError("cu_seqlens must be non-decreasing")
        if max_seqlen is None:
            max_seqlen = max(int(lengths.max()), 1)
        elif check and int(lengths.max()) > max_seqlen:
            raise ValueError(f"max_seqlen ({max_seqlen}) is shorter than the longest sequence in cu_seqlens "
                             f"({int(lengths.max())})")
        invalid = (cu[0] != 0) | (cu[-1] != n_tokens) | (lengths < 0).any() | (lengths > max_seqlen).any()
        errors = torch.where(invalid, int(InputError.CU_SEQLENS), 0)
        n_seqs = lengths.numel()
        token = torch.arange(n_tokens, device=device)
        seq = torch.searchsorted(cu[1:], token, right=True).clamp(max=n_seqs - 1)
        # Tokens a bad cu_seqlens would put outside the grid go to its last cell (the loss is NaN anyway).
        grid_index = (seq * max_seqlen + (token - cu[seq])).clamp(0, n_seqs * max_seqlen - 1)
        return cls(n_tokens, n_seqs, max_seqlen, grid_index, errors)

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

    @property
    def sequence_of_token(self) -> torch.Tensor:
        """int64 ``(n_tokens,)``: the sequence each packed token belongs to."""
        return self.grid_index // self.max_seqlen

    def per_sequence(self, name: str, value) -> bool:
        """Whether the per-response float ``name`` (``TokenFloat(per_response=True)``: the advantages, the
        scores) holds one value per sequence: shape ``(B, 1)``, or ``(B,)`` where that is not also the number
        of tokens. Shape ``(n,)`` with ``n`` sequences over ``n`` tokens (empty sequences allow it with
        lengths other than 1) has two readings that differ: an error."""
        if not torch.is_tensor(value):
            return False
        if value.shape == (self.n_seqs, 1):
            return True
        if value.shape == (self.n_seqs,) and self.n_seqs == self.n_tokens:
            raise ValueError(
                f"{name} of shape ({self.n_seqs},) are ambiguous: cu_seqlens holds {self.n_seqs} sequences "
                f"over {self.n_tokens} packed tokens. Pass {name}[:, None] (shape ({self.n_seqs}, 1)) for "
                f"one value per sequence, or {name}[None] (shape (1, {self.n_tokens})) for one per token")
        return value.shape == (self.n_seqs,)

    def padded_batch(self, batch: LossInputs) -> LossInputs:
        """The per-token inputs on the padded grid: target ids -100 and the mask 0 where there is no
        token. A per-response float given per sequence (``per_sequence``) stays ``(B,)``; given per token it
        may also be ``(1, n_tokens)``, the spelling that is never ambiguous."""
        def check_token_shape(name, value, per_sequence=False):
            if torch.is_tensor(value) and value.shape != (self.n_tokens,):
                also = f" or ({self.n_seqs},) per sequence" if per_sequence else ""
                raise ValueError(f"{name} must have shape ({self.n_tokens},){also} for packed tokens (cu_seqlens), "
                                 f"got {tuple(value.shape)}")

        check_token_shape("target_ids", batch.target_ids)
        padded = {"target_ids": self.pad(batch.target_ids, IGNORE_INDEX)}
        if batch.mask is not None:
            check_token_shape("mask", batch.mask)
            padded["mask"] = self.pad(batch.mask, 0)
        for name, mark in TOKEN_FLOATS.items():
            value = getattr(batch, name)
            if value is None or not torch.is_tensor(value):
                continue
            if mark.per_response:
                if self.per_sequence(name, value):
                    padded[name] = value.reshape(self.n_seqs)
                    continue
                if value.shape == (1, self.n_tokens):
                    value = value.reshape(self.n_tokens)
            check_token_shape(name, value, per_sequence=mark.per_response)
            padded[name] = self.pad(value.detach(), 0.0)
        return batch._replace(**padded, cu_seqlens=None, max_seqlen=None)  # padded: no longer packed
