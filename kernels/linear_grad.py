"""On-chip fused-linear gradients: ``d loss / d hidden``, ``d loss / d weight`` and ``d loss / d bias``
with the logits and their gradient existing only in registers (Cut Cross-Entropy's backward).

Grid ``(token blocks, vocabulary blocks)``. A program recomputes its ``BLOCK_N x BLOCK_V`` logits
tile (``linear_logits.projected_logits``), forms the gradient tile from the forward's planes as the
row backward does,

    d loss / d x_j = g (onehot_j - p_j) - h p_j (log p_j + H),   p_j = exp(x_j - max - log S)

(``g = DLOSS_DLOGP s_b`` or a scaled coefficient, ``h = -entropy_coef s_b`` or a per-token one, one exp per element,
``1 - p`` of the target once per row), takes it through the chain rule to ``y = hidden @ weight^T +
bias`` (times ``out_scale``, and ``(1 - t^2) tanh_scale`` with softcap), rounds it to the compute
dtype and multiplies it in the same program: ``dH[rows] += G @ W[cols]`` and ``dW[cols] += G^T @
H[rows]`` slice by slice of H, added into fp32 accumulators with relaxed atomics (a sum needs no
ordering with other memory operations). The order of those fp32
additions varies between runs on a GPU (as in Cut Cross-Entropy): the gradients are not bitwise
reproducible there, unlike the tile path's GEMMs.
"""

import torch
import triton
import triton.language as tl

from . import codes
from .interface import cdiv
from .linear_logits import bias_stride, check_hidden_strides, dot_operand, linear_grad_shape, projected_logits
from .logits_grad import _one_minus_exp


@triton.jit
def linear_grad_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    target_index_ptr,
    per_token_ptr,
    dloss_dlogp_ptr,
    dloss_dentropy_ptr,
    seq_scale_ptr,
    grad_hidden_ptr,
    grad_weight_ptr,
    grad_bias_ptr,
    tanh_scale,
    out_scale,
    entropy_coef,
    n_tokens,
    grid_seq_len,
    vocab,
    hidden_dim,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    stride_bias,
    OPERAND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    COEF_IS_SCALED: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    ENTROPY_GRAD_PER_TOKEN: tl.constexpr,
    HAS_GRAD_HIDDEN: tl.constexpr,
    HAS_GRAD_WEIGHT: tl.constexpr,
    HAS_GRAD_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    inside = rows < n_tokens
    target = tl.load(target_index_ptr + rows, mask=inside, other=-1)
    valid = target >= 0
    seq_scale = tl.load(seq_scale_ptr + rows // grid_seq_len, mask=valid, other=0.0)
    if COEF_IS_SCALED:
        g = tl.load(dloss_dlogp_ptr + rows, mask=valid, other=0.0)
    else:
        g = tl.load(per_token_ptr + codes.PLANE_DLOSS_DLOGP * n_tokens + rows, mask=valid, other=0.0) * seq_scale
    g = tl.where(valid, g, 0.0)
    row_max = tl.load(per_token_ptr + codes.PLANE_ROW_MAX * n_tokens + rows, mask=valid, other=0.0)
    log_norm = tl.load(per_token_ptr + codes.PLANE_LOG_NORM * n_tokens + rows, mask=valid, other=0.0)
    target_coef = g * _one_minus_exp(tl.load(per_token_ptr + codes.PLANE_LOGP * n_tokens + rows, mask=valid,
                                             other=0.0))
    active = g != 0.0  # NaN (poisoned scales) counts as active: it must reach the gradients
    if HAS_ENTROPY_GRAD:
        if ENTROPY_GRAD_PER_TOKEN:
            h = tl.load(dloss_dentropy_ptr + rows, mask=valid, other=0.0)
        else:
            h = -entropy_coef * seq_scale
        h = tl.where(valid, h, 0.0)
        active = active | (h != 0.0)
    # A block without an active row (tokens not scored, or A = 0 without entropy bonus: whole
    # responses of an all-equal reward group) multiplies nothing: its loops run to 0, not to H.
    k_end = tl.where(tl.max(active.to(tl.int32), axis=0) > 0, hidden_dim, 0)

    x, t = projected_logits(hidden_ptr, weight_ptr, bias_ptr, rows, cols, n_tokens, vocab, k_end, stride_hn,
                            stride_hk, stride_wv, stride_wk, stride_bias, tanh_scale, out_scale, OPERAND, HAS_BIAS,
                            HAS_SOFTCAP, DOT_PRECISION, DOT_IN_FP32, BLOCK_N, BLOCK_V, BLOCK_K)
    log_p = (x - row_max[:, None]) - log_norm[:, None]
    p = tl.exp(log_p)
    grad = tl.where(cols[None, :] == target[:, None], target_coef[:, None], -g[:, None] * p)
    if HAS_ENTROPY_GRAD:
        entropy = tl.load(per_token_ptr + codes.PLANE_ENTROPY * n_tokens + rows, mask=valid, other=0.0)
        grad -= h[:, None] * tl.where(p > 0.0, p * (log_p + entropy[:, None]), 0.0)
    # d x / d y: out_scale, and with softcap x = out_scale tanh(tanh_scale y).
    if HAS_SOFTCAP:
        grad = grad * (out_scale * tanh_scale) * (1.0 - t * t)
    else:
        grad = grad * out_scale
    grad = tl.where(valid[:, None] & (cols[None, :] < vocab), grad, 0.0)
    grad_tile = dot_operand(grad, OPERAND, DOT_IN_FP32)  # rounded as the tile path's gradient tile

    if HAS_GRAD_BIAS:
        if k_end > 0:
            tl.atomic_add(grad_bias_ptr + cols, tl.sum(grad_tile.to(tl.float32), axis=0), mask=cols < vocab,
                          sem="relaxed")
    for k_start in range(0, k_end, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        if HAS_GRAD_HIDDEN:
            w = tl.load(weight_ptr + cols[:, None] * stride_wv + ks[None, :] * stride_wk,
                        mask=(cols[:, None] < vocab) & (ks[None, :] < hidden_dim), other=0.0)
            partial = tl.dot(grad_tile, dot_operand(w, OPERAND, DOT_IN_FP32), input_precision=DOT_PRECISION)
            tl.atomic_add(grad_hidden_ptr + rows[:, None] * hidden_dim + ks[None, :], partial,
                          mask=inside[:, None] & (ks[None, :] < hidden_dim), sem="relaxed")
        if HAS_GRAD_WEIGHT:
            # rows not scored read as 0: their zero gradient rows must not meet a padded position's NaN
            h_tile = tl.load(hidden_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hk,
                             mask=valid[:, None] & (ks[None, :] < hidden_dim), other=0.0)
            partial = tl.dot(tl.trans(grad_tile), dot_operand(h_tile, OPERAND, DOT_IN_FP32),
                             input_precision=DOT_PRECISION)
            tl.atomic_add(grad_weight_ptr + cols[:, None] * hidden_dim + ks[None, :], partial,
                          mask=(cols[:, None] < vocab) & (ks[None, :] < hidden_dim), sem="relaxed")


def linear_grads(hidden, weight, bias, workspace, grid_seq_len: int, projection, entropy_coef: float,
                 grad_hidden=None, grad_weight=None, grad_bias=None, dloss_dlogp=None, dloss_dentropy=None) -> None:
    """Add ``d loss / d hidden``, ``d loss / d weight`` and ``d loss / d bias`` into the fp32
    accumulators given (contiguous, zero-initialised by the caller), from the forward's planes in
    ``workspace``. ``dloss_dlogp``: per-token coefficients that already carry the aggregation scale
    (the torch objective's), instead of the epilogue's plane; ``dloss_dentropy``: per-token d loss / d H
    (``(n_tokens,)`` fp32, entropy weights), instead of ``-entropy_coef`` times the scale."""
    n_tokens, hidden_dim = hidden.shape
    vocab = weight.shape[0]
    check_hidden_strides(hidden, weight)
    if n_tokens == 0 or all(g is None for g in (grad_hidden, grad_weight, grad_bias)):
        return
    for accumulator in (grad_hidden, grad_weight, grad_bias):
        if accumulator is not None and (accumulator.dtype != torch.float32 or not accumulator.is_contiguous()):
            raise ValueError("the on-chip gradients accumulate into contiguous fp32 tensors")
    shape = linear_grad_shape(hidden, weight).fitted(n_tokens, vocab, hidden_dim)
    anchor = workspace.per_token

    def pointer(tensor):
        return anchor if tensor is None else tensor

    linear_grad_kernel[(cdiv(n_tokens, shape.block_n), cdiv(vocab, shape.block_v))](
        hidden, weight, pointer(bias), workspace.target_index, workspace.per_token, pointer(dloss_dlogp),
        pointer(dloss_dentropy), workspace.seq_scale, pointer(grad_hidden), pointer(grad_weight), pointer(grad_bias),
        projection.tanh_scale, projection.out_scale, float(entropy_coef), n_tokens, grid_seq_len, vocab, hidden_dim,
        *hidden.stride(), *weight.stride(), bias_stride(bias),
        COEF_IS_SCALED=dloss_dlogp is not None,
        HAS_ENTROPY_GRAD=entropy_coef != 0.0 or dloss_dentropy is not None,
        ENTROPY_GRAD_PER_TOKEN=dloss_dentropy is not None,
        HAS_GRAD_HIDDEN=grad_hidden is not None,
        HAS_GRAD_WEIGHT=grad_weight is not None,
        HAS_GRAD_BIAS=grad_bias is not None,
        BLOCK_N=shape.block_n, BLOCK_V=shape.block_v, BLOCK_K=shape.block_k,
        num_warps=shape.num_warps, num_stages=shape.num_stages, **projection.constexprs(bias),
    )
