"""Backward row kernel: d loss / d logits from the saved log-sum-exp, one tile at a time.

    d loss / d x_j = g (onehot_j - p_j) - h p_j (log p_j + H),   x = logits / temperature

with per-token coefficients g = d loss / d l and h = d loss / d H. Both are formed here from the
per-token planes: ``g = DLOSS_DLOGP * s_b * grad_loss`` (``s_b`` the response's aggregation scale,
unless the coefficient already carries it) and ``h = -entropy_coef * s_b * grad_loss``, with the
incoming gradient read on the device, so backward launches nothing else. A caller whose loss is not
the package's (verl's, through ``dgpo_ops.ops.linear_logprobs``) passes both per token instead.

The hot loop does one exp per element and no other special function: ``1 - p`` of the target
(``-expm1(log p)``, exact for confident tokens) is computed once per row from the saved log-prob
and selected at the target's position. Rows with g = h = 0 (tokens not scored) read nothing and
write zeros. The gradient may be written into the logits' own storage (same strides).
"""

import triton
import triton.language as tl

from . import codes
from .logprob_entropy import BACKWARD_SHAPE, check_vocab_stride, default_block_v, launch_shape, logits_rows


@triton.jit
def _one_minus_exp(log_p):
    # 1 - exp(log p) = -expm1(log p) without the cancellation near 0 (Kahan's expm1): once per row.
    # Where exp underflows to 0 (log p below about -87 to -104, or -inf) the answer is 1, not 0/0.
    u = tl.exp(log_p)
    kahan = (1.0 - u) * log_p / tl.log(tl.where(u == 0.0, 0.5, u))
    return tl.where(u == 1.0, -log_p, tl.where(u == 0.0, 1.0, kahan))


@triton.jit
def logits_grad_kernel(
    logits_ptr,
    grad_logits_ptr,
    target_index_ptr,
    per_token_ptr,
    dloss_dlogp_ptr,
    dloss_dentropy_ptr,
    seq_scale_ptr,
    grad_loss_ptr,
    entropy_coef,
    inv_temperature,
    token_offset,
    n_tokens,
    grid_seq_len,
    rows_per_seq,
    vocab,
    stride_b,
    stride_t,
    stride_v,
    grad_stride_b,
    grad_stride_t,
    grad_stride_v,
    COEF_IS_SCALED: tl.constexpr,
    HAS_GRAD_LOSS: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    ENTROPY_GRAD_PER_TOKEN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token = token_offset + row
    seq, pos = row // rows_per_seq, row % rows_per_seq
    row_ptr = logits_ptr + seq * stride_b + pos * stride_t
    grad_row_ptr = grad_logits_ptr + seq * grad_stride_b + pos * grad_stride_t
    target = tl.load(target_index_ptr + token)
    valid = target >= 0
    seq_scale = tl.load(seq_scale_ptr + token // grid_seq_len)
    grad_loss = 1.0
    if HAS_GRAD_LOSS:
        grad_loss = tl.load(grad_loss_ptr).to(tl.float32)
    if COEF_IS_SCALED:
        g = tl.load(dloss_dlogp_ptr + token) * grad_loss
    else:
        g = tl.load(per_token_ptr + codes.PLANE_DLOSS_DLOGP * n_tokens + token) * seq_scale * grad_loss
    g = tl.where(valid, g * inv_temperature, 0.0)
    active = g != 0.0
    if HAS_ENTROPY_GRAD:
        if ENTROPY_GRAD_PER_TOKEN:
            h = tl.load(dloss_dentropy_ptr + token) * grad_loss
        else:
            h = -entropy_coef * seq_scale * grad_loss
        h = tl.where(valid, h * inv_temperature, 0.0)
        entropy = tl.load(per_token_ptr + codes.PLANE_ENTROPY * n_tokens + token)
        active = active | (h != 0.0)
    row_max = tl.load(per_token_ptr + codes.PLANE_ROW_MAX * n_tokens + token)
    log_norm = tl.load(per_token_ptr + codes.PLANE_LOG_NORM * n_tokens + token)
    target_coef = g * _one_minus_exp(tl.load(per_token_ptr + codes.PLANE_LOGP * n_tokens + token))
    read_end = tl.where(active, vocab, 0)  # inactive rows read nothing
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offsets * stride_v, mask=offsets < read_end, other=-float("inf")).to(tl.float32)
        log_p = (x * inv_temperature - row_max) - log_norm
        p = tl.exp(log_p)
        grad = tl.where(offsets == target, target_coef, -g * p)
        if HAS_ENTROPY_GRAD:
            # p log p is 0 where p is 0 (a -inf logit), not 0 * -inf.
            grad -= h * tl.where(p > 0.0, p * (log_p + entropy), 0.0)
        grad = tl.where(active, grad, 0.0)
        tl.store(grad_row_ptr + offsets * grad_stride_v, grad.to(grad_logits_ptr.dtype.element_ty), mask=offsets < vocab)


def logits_grad(logits, grad_logits, workspace, grid_seq_len: int, inv_temperature: float, entropy_coef: float,
                grad_loss=None, dloss_dlogp=None, token_offset: int = 0, block_v=None, dloss_dentropy=None):
    """Write d loss / d logits into ``grad_logits`` (same shape as ``logits``, any strides; may be
    ``logits`` itself) from the forward's ``workspace`` (a ``RowWorkspace``).

    ``dloss_dlogp`` defaults to the epilogue's unscaled plane; a per-token tensor passed instead
    already carries the aggregation scale (the torch objective's coefficients). ``grad_loss`` is
    the incoming gradient (a 0-dim tensor, read on the device) or None for 1. ``dloss_dentropy``, a
    per-token tensor (``(n_tokens,)``, fp32), replaces ``-entropy_coef`` times the scale: pass it with
    ``dloss_dlogp`` for a loss of the log-probs and entropies that is not the package's.
    """
    check_vocab_stride(logits)
    check_vocab_stride(grad_logits)
    rows, rows_per_seq, stride_b, stride_t, stride_v = logits_rows(logits)
    _, _, grad_stride_b, grad_stride_t, grad_stride_v = logits_rows(grad_logits)
    if rows == 0:
        return grad_logits
    vocab = logits.shape[-1]
    n_tokens = workspace.n_tokens
    block_v = block_v or default_block_v(vocab, BACKWARD_SHAPE)
    logits_grad_kernel[(rows,)](
        logits, grad_logits, workspace.target_index, workspace.per_token,
        workspace.per_token if dloss_dlogp is None else dloss_dlogp,
        workspace.per_token if dloss_dentropy is None else dloss_dentropy, workspace.seq_scale,
        workspace.seq_scale if grad_loss is None else grad_loss,
        float(entropy_coef), inv_temperature, token_offset, n_tokens, grid_seq_len, rows_per_seq, vocab,
        stride_b, stride_t, stride_v, grad_stride_b, grad_stride_t, grad_stride_v,
        COEF_IS_SCALED=dloss_dlogp is not None,
        HAS_GRAD_LOSS=grad_loss is not None,
        HAS_ENTROPY_GRAD=entropy_coef != 0.0 or dloss_dentropy is not None,
        ENTROPY_GRAD_PER_TOKEN=dloss_dentropy is not None,
        BLOCK_V=block_v,
        **launch_shape(block_v, BACKWARD_SHAPE),
    )
    return grad_logits
