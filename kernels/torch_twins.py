"""Torch twins of the row kernels for CPU tensors: the same per-token outputs and gradient,
computed one chunk of rows at a time so no (N, V) fp32 temporary exists beyond one chunk."""

from __future__ import annotations

import torch

from .row_io import RowForward

CHUNK_ELEMENTS = 1 << 22  # fp32 elements of one chunk (16 MiB)


def _row_chunks(tensors: list[torch.Tensor], chunk_rows: int | None):
    """Yield (flat token slice, [(rows, V) view of each tensor]) over same-shaped ``(B, T, V)``
    tensors, without copying them."""
    B, T, V = tensors[0].shape
    chunk_rows = chunk_rows or max(1, CHUNK_ELEMENTS // max(V, 1))
    try:
        flats = [t.view(B * T, V) for t in tensors]
    except RuntimeError:  # rows not evenly strided (e.g. a [:, :-1] slice): walk each response
        for b in range(B):
            for start in range(0, T, chunk_rows):
                stop = min(start + chunk_rows, T)
                yield slice(b * T + start, b * T + stop), [t[b, start:stop] for t in tensors]
        return
    for start in range(0, B * T, chunk_rows):
        stop = min(start + chunk_rows, B * T)
        yield slice(start, stop), [f[start:stop] for f in flats]


def _compute_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def logprob_entropy_torch(logits, target_ids, mask, inv_temperature, chunk_rows=None) -> RowForward:
    B, T, _ = logits.shape
    dtype = _compute_dtype(logits)
    row_max, log_norm, logp, entropy = (torch.zeros(B * T, dtype=dtype, device=logits.device) for _ in range(4))
    targets, valid = target_ids.reshape(-1), mask.reshape(-1)
    for rows, (chunk,) in _row_chunks([logits], chunk_rows):
        x = chunk.to(dtype) * inv_temperature
        log_probs = torch.log_softmax(x, dim=-1)  # one fused, vectorised pass family: the fastest CPU path
        index = targets[rows, None]
        top = x.amax(dim=-1, keepdim=True)
        top = torch.where(top == float("-inf"), 0.0, top)
        logp[rows] = log_probs.gather(1, index)[:, 0]
        row_max[rows] = top[:, 0]
        # log S = (x_t - max) - log p_t: the pair (max, log S) the backward needs.
        log_norm[rows] = (x.gather(1, index) - top)[:, 0] - logp[rows]
        # p log p is 0 where p is 0 (a -inf logit), not 0 * -inf.
        entropy[rows] = -log_probs.exp().mul_(torch.where(log_probs > float("-inf"), log_probs, 0.0)).sum(dim=-1)
    outputs = (torch.where(valid, v, 0.0).view(B, T) for v in (row_max, log_norm, logp, entropy))
    return RowForward(*outputs, None)


def logits_grad_torch(logits, grad_logits, target_ids, row_max, log_norm, entropy, dloss_dlogp, dloss_dentropy,
                      inv_temperature, chunk_rows=None):
    dtype = _compute_dtype(logits)
    targets = target_ids.reshape(-1)
    g, entropy = dloss_dlogp.reshape(-1), entropy.reshape(-1)
    row_max, log_norm = row_max.reshape(-1), log_norm.reshape(-1)
    h = None if dloss_dentropy is None else dloss_dentropy.reshape(-1)
    active = g != 0 if h is None else (g != 0) | (h != 0)  # masked rows: zeros, whatever their logits
    for rows, (chunk, grad_chunk) in _row_chunks([logits, grad_logits], chunk_rows):
        coef = (g[rows] * inv_temperature)[:, None]
        x = chunk.to(dtype) * inv_temperature
        p = torch.softmax(x, dim=-1)
        index = targets[rows, None]
        # 1 - p_target as -expm1(log p_target): no cancellation for confident tokens.
        target_log_p = (x.gather(1, index) - row_max[rows, None]) - log_norm[rows, None]
        if h is not None:
            log_p = x.sub_(row_max[rows, None]).sub_(log_norm[rows, None])
            entropy_term = p * torch.where(p > 0, log_p + entropy[rows, None], 0.0) * (h[rows] * inv_temperature)[:, None]
        grad = p.mul_(-coef)
        grad.scatter_(1, index, -coef * torch.expm1(target_log_p))
        if h is not None:
            grad.sub_(entropy_term)
        inactive = ~active[rows]
        if inactive.any():
            grad.masked_fill_(inactive[:, None], 0.0)
        grad_chunk.copy_(grad)
    return grad_logits
