"""Finalize: the loss and the metrics of a call, as one deterministic reduction on the device.

``reduce_loss_and_metrics`` is the reduction; the logits op runs it in the last program of the
prologue (one launch fewer per call), the fused-linear op, whose prologue runs before any logits
exist, in ``finalize_kernel`` after its last chunk. One program walks the per-token planes in
``BLOCK`` blocks and sums, over scored tokens,
``s_b TOKEN_LOSS`` (the loss) and the metric terms (region counts, ratio, psi / ratio, entropy,
KL), then divides the metrics by the scored-token count the prologue found. A fixed order of
summation gives the same bits on every run. Poisoned scales (input the prologue could not score)
make the loss NaN; a call whose errors hide no scored token gets a NaN loss too.
"""

import triton
import triton.language as tl

from . import codes
from .interface import next_power_of_2

MAX_BLOCK = 2048  # tokens per step of the reduction loop
FINALIZE_WARPS = 8


@triton.jit
def reduce_loss_and_metrics(per_token_ptr, target_index_ptr, seq_scale_ptr, status_ptr, loss_ptr, stats_ptr, n_tokens,
                            grid_seq_len, HAS_KL: tl.constexpr, BLOCK: tl.constexpr):
    loss = tl.zeros((BLOCK,), tl.float32)
    ln = tl.zeros((BLOCK,), tl.float32)
    hp = tl.zeros((BLOCK,), tl.float32)
    lp = tl.zeros((BLOCK,), tl.float32)
    hn = tl.zeros((BLOCK,), tl.float32)
    dual = tl.zeros((BLOCK,), tl.float32)
    ratio_sum = tl.zeros((BLOCK,), tl.float32)
    eur = tl.zeros((BLOCK,), tl.float32)
    entropy_sum = tl.zeros((BLOCK,), tl.float32)
    kl_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_tokens, BLOCK):
        token = start + tl.arange(0, BLOCK).to(tl.int64)
        valid = tl.load(target_index_ptr + token, mask=token < n_tokens, other=-1) >= 0
        scale = tl.load(seq_scale_ptr + token // grid_seq_len, mask=valid, other=0.0)
        token_loss = tl.load(per_token_ptr + codes.PLANE_TOKEN_LOSS * n_tokens + token, mask=valid)
        loss += tl.where(valid, token_loss * scale, 0.0)
        region = tl.load(per_token_ptr + codes.PLANE_REGION * n_tokens + token, mask=valid, other=0.0).to(tl.int32)
        ln += tl.where(valid & (region == codes.REGION_LN), 1.0, 0.0)
        hp += tl.where(valid & (region == codes.REGION_HP), 1.0, 0.0)
        lp += tl.where(valid & (region == codes.REGION_LP), 1.0, 0.0)
        hn += tl.where(valid & (region == codes.REGION_HN), 1.0, 0.0)
        dual += tl.where(valid & (region == codes.REGION_DUAL), 1.0, 0.0)
        ratio = tl.load(per_token_ptr + codes.PLANE_RATIO * n_tokens + token, mask=valid, other=1.0)
        psi = tl.load(per_token_ptr + codes.PLANE_PSI * n_tokens + token, mask=valid, other=0.0)
        ratio_sum += tl.where(valid, ratio, 0.0)
        eur += tl.where(valid, psi / ratio, 0.0)
        entropy_sum += tl.where(valid, tl.load(per_token_ptr + codes.PLANE_ENTROPY * n_tokens + token, mask=valid), 0.0)
        if HAS_KL:
            kl_sum += tl.where(valid, tl.load(per_token_ptr + codes.PLANE_KL * n_tokens + token, mask=valid), 0.0)
    count = tl.maximum(tl.load(status_ptr + codes.STATUS_TOKENS), 1).to(tl.float32)
    total = tl.sum(loss, axis=0)
    tl.store(loss_ptr, tl.where(tl.load(status_ptr + codes.STATUS_ERRORS) != 0, float("nan"), total))
    tl.store(stats_ptr + codes.STAT_LN_FRACTION, tl.sum(ln, axis=0) / count)
    tl.store(stats_ptr + codes.STAT_HP_FRACTION, tl.sum(hp, axis=0) / count)
    tl.store(stats_ptr + codes.STAT_LP_FRACTION, tl.sum(lp, axis=0) / count)
    tl.store(stats_ptr + codes.STAT_HN_FRACTION, tl.sum(hn, axis=0) / count)
    tl.store(stats_ptr + codes.STAT_DUAL_CLIP_FRACTION, tl.sum(dual, axis=0) / count)
    tl.store(stats_ptr + codes.STAT_RATIO_MEAN, tl.sum(ratio_sum, axis=0) / count)
    tl.store(stats_ptr + codes.STAT_EUR, tl.sum(eur, axis=0) / count)
    tl.store(stats_ptr + codes.STAT_ENTROPY_MEAN, tl.sum(entropy_sum, axis=0) / count)
    tl.store(stats_ptr + codes.STAT_KL_MEAN, tl.sum(kl_sum, axis=0) / count)


def finalize_block(n_tokens: int) -> int:
    return min(MAX_BLOCK, next_power_of_2(max(n_tokens, 16)))


@triton.jit
def finalize_kernel(
    per_token_ptr,
    target_index_ptr,
    seq_scale_ptr,
    status_ptr,
    loss_ptr,
    stats_ptr,
    n_tokens,
    grid_seq_len,
    HAS_KL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    reduce_loss_and_metrics(per_token_ptr, target_index_ptr, seq_scale_ptr, status_ptr, loss_ptr, stats_ptr, n_tokens,
                            grid_seq_len, HAS_KL, BLOCK)


def finalize(workspace, grid_seq_len: int, has_kl: bool) -> None:
    """Launch the finalize kernel: ``workspace.loss`` and ``workspace.stats`` from the forward's planes."""
    n_tokens = workspace.n_tokens
    finalize_kernel[(1,)](
        workspace.per_token, workspace.target_index, workspace.seq_scale, workspace.status, workspace.loss,
        workspace.stats, n_tokens, grid_seq_len, HAS_KL=has_kl, BLOCK=finalize_block(n_tokens),
        num_warps=FINALIZE_WARPS,
    )
