"""Backward row kernel: d loss / d logits from the saved log-sum-exp, one tile at a time.

    d loss / d x_j = g (onehot_j - p_j) - h p_j (log p_j + H),   x = logits / temperature

with per-token coefficients g = d loss / d l and h = d loss / d H already scaled by the
aggregation and the incoming gradient. Rows with g = h = 0 (masked tokens) read nothing and
write zeros. The gradient may be written into the logits' own storage (same strides).
"""

import triton
import triton.language as tl

from .logprob_entropy import check_vocab_stride, default_block_v


@triton.jit
def _expm1(x):
    # exp(x) - 1 without the cancellation near 0 (Kahan): the target's 1 - p for confident tokens.
    u = tl.exp(x)
    return tl.where(u == 1.0, x, (u - 1.0) * x / tl.log(u))


@triton.jit
def logits_grad_kernel(
    logits_ptr,
    grad_logits_ptr,
    target_ids_ptr,
    row_max_ptr,
    log_norm_ptr,
    entropy_ptr,
    dloss_dlogp_ptr,
    dloss_dentropy_ptr,
    inv_temperature,
    seq_len,
    vocab,
    stride_b,
    stride_t,
    stride_v,
    grad_stride_b,
    grad_stride_t,
    grad_stride_v,
    HAS_ENTROPY_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    b = token // seq_len
    t = token % seq_len
    row_ptr = logits_ptr + b * stride_b + t * stride_t
    grad_row_ptr = grad_logits_ptr + b * grad_stride_b + t * grad_stride_t
    target = tl.load(target_ids_ptr + token)
    row_max = tl.load(row_max_ptr + token)
    log_norm = tl.load(log_norm_ptr + token)
    g = tl.load(dloss_dlogp_ptr + token)
    active = g != 0.0
    if HAS_ENTROPY_GRAD:
        h = tl.load(dloss_dentropy_ptr + token)
        entropy = tl.load(entropy_ptr + token)
        active = active | (h != 0.0)
    read_end = tl.where(active, vocab, 0)  # inactive rows read nothing
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offsets * stride_v, mask=offsets < read_end, other=-float("inf")).to(tl.float32)
        log_p = (x * inv_temperature - row_max) - log_norm
        p = tl.exp(log_p)
        # onehot - p, with 1 - p_target as -expm1(log p_target): exact to fp32 even when p_target ~ 1.
        grad = g * tl.where(offsets == target, -_expm1(log_p), -p)
        if HAS_ENTROPY_GRAD:
            grad -= h * tl.where(p > 0.0, p * (log_p + entropy), 0.0)
        grad = tl.where(active, grad * inv_temperature, 0.0)
        tl.store(grad_row_ptr + offsets * grad_stride_v, grad.to(grad_logits_ptr.dtype.element_ty), mask=offsets < vocab)


def logits_grad(logits, grad_logits, target_ids, row_max, log_norm, entropy, dloss_dlogp, dloss_dentropy, inv_temperature,
                block_v=None):
    """Write d loss / d logits into ``grad_logits`` (``(B, T, V)``, any strides; may be ``logits``).

    ``dloss_dentropy`` is ``None`` when no entropy term is differentiated.
    """
    check_vocab_stride(logits)
    check_vocab_stride(grad_logits)
    B, T, V = logits.shape
    block_v = block_v or default_block_v(V)
    logits_grad_kernel[(B * T,)](
        logits, grad_logits, target_ids, row_max, log_norm, entropy, dloss_dlogp,
        dloss_dlogp if dloss_dentropy is None else dloss_dentropy,
        inv_temperature, T, V,
        logits.stride(0), logits.stride(1), logits.stride(2),
        grad_logits.stride(0), grad_logits.stride(1), grad_logits.stride(2),
        HAS_ENTROPY_GRAD=dloss_dentropy is not None,
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 4096 else 4,
    )
    return grad_logits
