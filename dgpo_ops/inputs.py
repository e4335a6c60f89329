"""Validation and canonical per-token layout of the loss inputs, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aggregation import TOKEN_LEVEL_AGGREGATIONS, token_scales

IGNORE_INDEX = -100
LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class TokenBatch:
    """Per-token inputs on a ``(B, T)`` grid (``(1, N)`` for flat ``(N, V)`` logits).

    Masked positions hold 0 in every per-token tensor, so nothing non-finite from a
    padded position can reach a loss or a gradient.
    """

    target_ids: torch.Tensor  # int64, -100 replaced by 0
    mask: torch.Tensor  # bool
    advantages: torch.Tensor  # fp32
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    rollout_weights: torch.Tensor | None
    scale: torch.Tensor  # fp32 s_t, 0 on masked tokens
    flat: bool  # the caller passed (N, V) logits: outputs are (N,)

    def unflatten(self, per_token: torch.Tensor) -> torch.Tensor:
        return per_token.reshape(-1) if self.flat else per_token.reshape(self.mask.shape)

    def select(self, indices: torch.Tensor) -> "TokenBatch":
        """The tokens at ``indices`` of the flattened grid, as a (1, n) batch (scales kept)."""

        def pick(values):
            return None if values is None else values.reshape(-1).index_select(0, indices)[None]

        return TokenBatch(
            target_ids=pick(self.target_ids), mask=pick(self.mask), advantages=pick(self.advantages),
            old_logps=pick(self.old_logps), ref_logps=pick(self.ref_logps),
            rollout_weights=pick(self.rollout_weights), scale=pick(self.scale), flat=True,
        )

    def token_slice(self, start: int, stop: int) -> "TokenBatch":
        """Tokens [start, stop) of the flattened grid as a (1, n) batch: enough for everything
        token-level (the scales were computed over the whole batch)."""

        def cut(values):
            return None if values is None else values.reshape(1, -1)[:, start:stop]

        return TokenBatch(
            target_ids=cut(self.target_ids), mask=cut(self.mask), advantages=cut(self.advantages),
            old_logps=cut(self.old_logps), ref_logps=cut(self.ref_logps),
            rollout_weights=cut(self.rollout_weights), scale=cut(self.scale), flat=True,
        )


def _per_token_float(name, value, grid_shape, mask, device, dtype, allow_per_response=False):
    if value is None:
        return None
    if not torch.is_tensor(value):
        raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but logits are on {device}")
    if allow_per_response and value.shape == grid_shape[:1]:
        value = value[:, None].expand(grid_shape)
    elif value.shape != grid_shape:
        wanted = f"{tuple(grid_shape)}" + (f" or {tuple(grid_shape[:1])}" if allow_per_response else "")
        raise ValueError(f"{name} must have shape {wanted}, got {tuple(value.shape)}")
    value = value.detach().to(dtype)
    if not torch.isfinite(value[mask]).all():
        raise ValueError(f"{name} has non-finite values on unmasked tokens")
    return torch.where(mask, value, 0.0).contiguous()  # the kernels index per-token data as ptr + token


def prepare_batch(
    logits_shape: torch.Size,
    logits_dtype: torch.dtype,
    device: torch.device,
    target_ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    rollout_weights: torch.Tensor | None,
    aggregation: str,
    loss_normalizer,
    needs_sequences: bool,
) -> TokenBatch:
    """Check every input against the logits' shape ``(B, T, V)`` or ``(N, V)`` and lay it out per token."""
    if len(logits_shape) not in (2, 3):
        raise ValueError(f"logits must have shape (B, T, V) or (N, V), got {tuple(logits_shape)}")
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits dtype must be one of float32, bfloat16, float16 (float64 on CPU), got {logits_dtype}")
    vocab = logits_shape[-1]
    if vocab == 0:
        raise ValueError("logits must have a non-empty vocabulary axis")
    flat = len(logits_shape) == 2
    if flat and (needs_sequences or aggregation not in TOKEN_LEVEL_AGGREGATIONS):
        raise ValueError(
            "flat (N, V) logits carry no response structure: use (B, T, V) logits for aggregation "
            f"{aggregation!r} or for importance_sampling_level='sequence'"
        )
    grid_shape = torch.Size((1, logits_shape[0])) if flat else torch.Size(logits_shape[:2])

    if not torch.is_tensor(target_ids) or target_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("target_ids must be an int64 or int32 tensor")
    if target_ids.shape != logits_shape[:-1]:
        raise ValueError(f"target_ids must have shape {tuple(logits_shape[:-1])}, got {tuple(target_ids.shape)}")
    if target_ids.device != device:
        raise ValueError(f"target_ids is on {target_ids.device} but logits are on {device}")
    target_ids = target_ids.reshape(grid_shape).to(torch.int64).contiguous()
    ignored = target_ids == IGNORE_INDEX
    out_of_range = ~ignored & ((target_ids < 0) | (target_ids >= vocab))
    if out_of_range.any():
        bad = target_ids[out_of_range][0].item()
        raise ValueError(f"target_ids must be in [0, {vocab}) or {IGNORE_INDEX}; found {bad}")

    token_mask = ~ignored
    if mask is not None:
        if not torch.is_tensor(mask) or mask.shape != logits_shape[:-1]:
            shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
            raise ValueError(f"mask must have shape {tuple(logits_shape[:-1])}, got {shape}")
        if mask.device != device:
            raise ValueError(f"mask is on {mask.device} but logits are on {device}")
        if mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():
            raise ValueError("mask must hold only 0 and 1 (or be boolean)")
        token_mask = token_mask & mask.reshape(grid_shape).bool()

    if advantages is None:
        raise ValueError("advantages are required")

    # Per-token math runs in fp32, or fp64 for fp64 logits (gradcheck).
    per_token_dtype = torch.float64 if logits_dtype == torch.float64 else torch.float32

    def per_token(name, value, allow_per_response=False):
        if flat and torch.is_tensor(value) and value.shape == logits_shape[:1]:
            value = value.reshape(grid_shape)
        return _per_token_float(name, value, grid_shape, token_mask, device, per_token_dtype, allow_per_response)

    return TokenBatch(
        target_ids=torch.where(token_mask, target_ids, 0).contiguous(),
        mask=token_mask.contiguous(),
        advantages=per_token("advantages", advantages, allow_per_response=not flat),
        old_logps=per_token("old_logps", old_logps),
        ref_logps=per_token("ref_logps", ref_logps),
        rollout_weights=per_token("rollout_weights", rollout_weights),
        scale=token_scales(token_mask, aggregation, loss_normalizer, per_token_dtype),
        flat=flat,
    )
