"""Forward row kernel: one pass over each logits row gives log-sum-exp, the target's log-prob and
the entropy; for token-level methods an epilogue evaluates the method table in the same program.

One program per row on grid axis 0 (2^31 - 1 programs; the 65,535 cap of axes 1 and 2 never
applies). The row is read once, in BLOCK_V tiles, with an online max / sum-exp / sum-exp-times-x
in fp32: one exp per element. Each program decides from the caller's target id and mask whether its
token is scored (``tokens.read_targets``, the prologue's own test) and writes the canonical target
index the later kernels read; a token not scored reads nothing and writes zeros. So the row forward
waits for no other kernel: the logits op launches it first. Row ``r`` of the launch is token
``token_offset + r`` of the call: the fused-linear op runs it on one token chunk's logits tile at a
time.

With ``WRITES_PARTIALS`` the logits are this process's columns ``[vocab_start, vocab_start + vocab)`` of a
``vocab_total``-wide vocabulary split across processes. The program then stores the row's partials
instead of finishing it: the max ``m``, ``S = sum exp(x - m)``, ``U = sum exp(x - m) (x - m)`` and the
target logit where this process holds the target (0 elsewhere), in the planes ROW_MAX, LOG_NORM,
ENTROPY and LOGP; ``dgpo_ops.layouts.vocab.merge_row_partials`` merges them over the processes into
the planes ``finish_row`` writes. Its target index is the target's local column, or ``vocab`` (a column
no program reads) for a target another process holds.
"""

from dataclasses import dataclass

import triton
import triton.language as tl

from . import codes
from .interface import next_power_of_2
from .method_table import kernel_token_terms
from .tokens import read_targets


@dataclass(frozen=True)
class LaunchShape:
    """A row kernel's vocabulary tile (for vocabularies at least that wide), warps and stages."""

    block_v: int
    num_warps: int
    num_stages: int


# Chosen by measurement (csrc_notes.md, "Launch shapes"). The forward (H200 run 22, bench/experiments/row_shapes.py,
# N = 8192, V = 151,936 bf16): 4096 x 4 warps, 0.561 ms (4.44 TB/s), 2-4 stages alike, every other shape tried
# 10-80 % slower. The backward (H100): 8192 x 8 warps, the fastest bare gradient kernel at V = 32,000 to 262,144.
FORWARD_SHAPE = LaunchShape(block_v=4096, num_warps=4, num_stages=3)
BACKWARD_SHAPE = LaunchShape(block_v=8192, num_warps=8, num_stages=3)


@triton.jit
def logprob_entropy_fwd_kernel(
    logits_ptr,
    target_ids_ptr,
    mask_ptr,
    target_index_ptr,
    per_token_ptr,
    advantages_ptr,
    old_logps_ptr,
    ref_logps_ptr,
    rollout_weights_ptr,
    method_params_ptr,
    inv_temperature,
    beta,
    entropy_coef,
    token_offset,
    n_tokens,
    grid_seq_len,
    rows_per_seq,
    vocab,
    vocab_start,
    vocab_total,
    stride_b,
    stride_t,
    stride_v,
    target_stride_b,
    target_stride_t,
    mask_stride_b,
    mask_stride_t,
    adv_stride_b,
    adv_stride_t,
    old_stride_b,
    old_stride_t,
    ref_stride_b,
    ref_stride_t,
    rw_stride_b,
    rw_stride_t,
    METHOD: tl.constexpr,
    GATE: tl.constexpr,
    HAS_EPILOGUE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_OLD_LOGPS: tl.constexpr,
    HAS_KL: tl.constexpr,
    KL_TIMES_RATIO: tl.constexpr,
    HAS_ROLLOUT_WEIGHTS: tl.constexpr,
    WRITES_PARTIALS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token = token_offset + row
    row_ptr = logits_ptr + (row // rows_per_seq) * stride_b + (row % rows_per_seq) * stride_t
    b = token // grid_seq_len
    t = token % grid_seq_len
    target, listed, kept, _, in_range = read_targets(target_ids_ptr, mask_ptr, b, t, True, vocab_total,
                                                     target_stride_b, target_stride_t, mask_stride_b, mask_stride_t,
                                                     HAS_MASK)
    valid = listed & kept & in_range
    if WRITES_PARTIALS:
        target = target - vocab_start
        owned = valid & (target >= 0) & (target < vocab)
        target = tl.where(valid, tl.where(owned, target, vocab), -1)
    else:
        owned = valid
        target = tl.where(valid, target, -1)
    tl.store(target_index_ptr + token, target)  # what the finalize and backward kernels read
    vocab_end = tl.where(valid, vocab, 0)

    # Running over the row: max m, S = sum exp(x - m) and U = sum exp(x - m) (x - m), x the logits over the
    # temperature. Centring U on the running max keeps the entropy H = log S - U / S accurate for peaked rows with
    # large logits. The loop runs on the raw logits: m_raw = max of the stored logits (m = m_raw / temperature,
    # exactly the max of the scaled ones) and base-2 exponents y = (x_raw - m_raw) * exp2_scale, so each element
    # costs a subtraction, a product, the floor, one exp2 and the two sums (fewer instructions than exp of the
    # scaled logits: on an H200 the pass is then bound by HBM, not by instruction issue). U is summed in base-2
    # units (U2 = U / ln 2). Full tiles are read without a mask; the last, partial one with it.
    exp2_scale = inv_temperature * codes.LOG2E
    row_max = -float("inf")
    sum_exp = 0.0
    sum_exp_dy = 0.0
    full_end = vocab_end - vocab_end % BLOCK_V
    for start in range(0, full_end, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offsets * stride_v).to(tl.float32)
        row_max, sum_exp, sum_exp_dy = online_sums(x, row_max, sum_exp, sum_exp_dy, exp2_scale)
    if full_end < vocab_end:
        offsets = full_end + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offsets * stride_v, mask=offsets < vocab, other=-float("inf")).to(tl.float32)
        row_max, sum_exp, sum_exp_dy = online_sums(x, row_max, sum_exp, sum_exp_dy, exp2_scale)
    row_max = row_max * inv_temperature
    sum_exp_dx = sum_exp_dy * codes.LN2

    target_logit = tl.load(row_ptr + target * stride_v, mask=owned, other=0.0).to(tl.float32) * inv_temperature
    if WRITES_PARTIALS:
        token_planes_ptr = per_token_ptr + token
        tl.store(token_planes_ptr + codes.PLANE_ROW_MAX * n_tokens, tl.where(valid, row_max, -float("inf")))
        tl.store(token_planes_ptr + codes.PLANE_LOG_NORM * n_tokens, tl.where(valid, sum_exp, 0.0))
        tl.store(token_planes_ptr + codes.PLANE_ENTROPY * n_tokens, tl.where(valid, sum_exp_dx, 0.0))
        tl.store(token_planes_ptr + codes.PLANE_LOGP * n_tokens, target_logit)
    else:
        finish_row(per_token_ptr, token, n_tokens, b, t, valid, row_max, sum_exp, sum_exp_dx, target_logit,
                   advantages_ptr, old_logps_ptr, ref_logps_ptr, rollout_weights_ptr, method_params_ptr, beta,
                   entropy_coef, adv_stride_b, adv_stride_t, old_stride_b, old_stride_t, ref_stride_b, ref_stride_t,
                   rw_stride_b, rw_stride_t, METHOD, GATE, HAS_EPILOGUE, HAS_OLD_LOGPS, HAS_KL, KL_TIMES_RATIO,
                   HAS_ROLLOUT_WEIGHTS)


@triton.jit
def online_sums(x, row_max, sum_exp, sum_exp_dy, exp2_scale):
    """One tile of raw logits ``x`` folded into a row's running max of the raw logits, ``S`` and ``U2`` (base-2
    exponents ``(x - max) * exp2_scale``; ``exp2_scale`` > 0 is log2 e over the temperature)."""
    new_max = tl.maximum(row_max, tl.max(x, axis=0))
    # A tile of -inf logits (vocabulary masking) must not give -inf - -inf = nan.
    shift = tl.where(new_max == -float("inf"), 0.0, new_max)
    y = tl.maximum((x - shift) * exp2_scale, codes.EXP2_FLOOR, propagate_nan=codes.NAN_PROPAGATING)
    e = tl.math.exp2(y)
    old = (row_max - shift) * exp2_scale  # -inf for the first tile: its rescale is 0 and S, U2 are 0
    rescale = tl.math.exp2(old)
    recentre = tl.where(sum_exp > 0.0, old * sum_exp, 0.0)  # (x - m) = (x - m') + (m' - m)
    sum_exp_dy = rescale * (sum_exp_dy + recentre) + tl.sum(e * y, axis=0)
    sum_exp = sum_exp * rescale + tl.sum(e, axis=0)
    return new_max, sum_exp, sum_exp_dy


@triton.jit
def finish_row(per_token_ptr, token, n_tokens, b, t, valid, row_max, sum_exp, sum_exp_dx, target_logit, advantages_ptr,
               old_logps_ptr, ref_logps_ptr, rollout_weights_ptr, method_params_ptr, beta, entropy_coef, adv_stride_b,
               adv_stride_t, old_stride_b, old_stride_t, ref_stride_b, ref_stride_t, rw_stride_b, rw_stride_t,
               METHOD: tl.constexpr, GATE: tl.constexpr, HAS_EPILOGUE: tl.constexpr, HAS_OLD_LOGPS: tl.constexpr,
               HAS_KL: tl.constexpr, KL_TIMES_RATIO: tl.constexpr, HAS_ROLLOUT_WEIGHTS: tl.constexpr):
    """A token's planes from its row's running ``(max, S, U)`` and target logit (already / temperature):
    log-prob, entropy and, with the epilogue, the method's per-token terms. Shared by the row forward
    and the on-chip fused-linear kernels (``linear_logits.py``), so both evaluate one table."""
    shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    log_sum_exp = tl.log(tl.where(valid, sum_exp, 1.0))
    # log-sum-exp kept as (max, log S) rather than their sum: log p = (x - max) - log S keeps full
    # precision for confident tokens (log p ~ -1e-3) where x - lse would cancel.
    logp = tl.where(valid, (target_logit - shift) - log_sum_exp, 0.0)
    entropy = tl.where(valid, log_sum_exp - sum_exp_dx / sum_exp, 0.0)
    token_planes_ptr = per_token_ptr + token
    tl.store(token_planes_ptr + codes.PLANE_ROW_MAX * n_tokens, tl.where(valid, shift, 0.0))
    tl.store(token_planes_ptr + codes.PLANE_LOG_NORM * n_tokens, tl.where(valid, log_sum_exp, 0.0))
    tl.store(token_planes_ptr + codes.PLANE_LOGP * n_tokens, logp)
    tl.store(token_planes_ptr + codes.PLANE_ENTROPY * n_tokens, entropy)

    if HAS_EPILOGUE:
        # The objective sees log p floored (straight-through: the coefficient below is d/d log p all
        # the same), so a target with probability 0 gives finite values, as in dgpo_ops.core.objective.
        logp = tl.maximum(logp, codes.LOGP_FLOOR, propagate_nan=codes.NAN_PROPAGATING)
        adv = tl.load(advantages_ptr + b * adv_stride_b + t * adv_stride_t, mask=valid, other=0.0).to(tl.float32)
        if HAS_OLD_LOGPS:
            old_logp = tl.load(old_logps_ptr + b * old_stride_b + t * old_stride_t, mask=valid,
                               other=0.0).to(tl.float32)
        else:
            old_logp = logp
        loss, dloss_dlogp, psi, region, ratio_used = kernel_token_terms(logp - old_logp, adv, old_logp, logp,
                                                                 method_params_ptr, METHOD, GATE)
        if HAS_ROLLOUT_WEIGHTS:
            weight = tl.load(rollout_weights_ptr + b * rw_stride_b + t * rw_stride_t, mask=valid,
                             other=0.0).to(tl.float32)
            loss = loss * weight
            dloss_dlogp = dloss_dlogp * weight
        kl = 0.0
        if HAS_KL:
            delta = tl.load(ref_logps_ptr + b * ref_stride_b + t * ref_stride_t, mask=valid,
                            other=0.0).to(tl.float32) - logp
            # Clamped straight-through before the exponential, as the policy ratio is.
            delta = tl.clamp(delta, -codes.LOG_RATIO_CLAMP, codes.LOG_RATIO_CLAMP, propagate_nan=codes.NAN_PROPAGATING)
            ref_ratio = tl.exp(delta)
            kl = ref_ratio - delta - 1.0
            dkl_dlogp = 1.0 - ref_ratio
            if KL_TIMES_RATIO:  # r KL: d(r KL)/dl = r (KL + dKL/dl) = r (l - l_ref), without cancellation
                # r is the clamped ratio the method was evaluated at.
                dkl_dlogp = -ratio_used * delta
                kl = ratio_used * kl
            loss += beta * kl
            dloss_dlogp += beta * dkl_dlogp
        loss -= entropy_coef * entropy
        tl.store(token_planes_ptr + codes.PLANE_TOKEN_LOSS * n_tokens, tl.where(valid, loss, 0.0))
        tl.store(token_planes_ptr + codes.PLANE_DLOSS_DLOGP * n_tokens, tl.where(valid, dloss_dlogp, 0.0))
        tl.store(token_planes_ptr + codes.PLANE_RATIO * n_tokens, tl.where(valid, ratio_used, 1.0))
        tl.store(token_planes_ptr + codes.PLANE_PSI * n_tokens, tl.where(valid, psi, 0.0))
        tl.store(token_planes_ptr + codes.PLANE_REGION * n_tokens, tl.where(valid, region, 0).to(tl.float32))
        tl.store(token_planes_ptr + codes.PLANE_KL * n_tokens, tl.where(valid, kl, 0.0))


def default_block_v(vocab: int, shape: LaunchShape) -> int:
    return min(next_power_of_2(vocab), shape.block_v)


def launch_shape(block_v: int, shape: LaunchShape) -> dict:
    """The warps and stages for a tile of ``block_v``: the shape's own, or 4 warps for a narrower
    tile (a small vocabulary)."""
    if block_v >= shape.block_v:
        return dict(num_warps=shape.num_warps, num_stages=shape.num_stages)
    return dict(num_warps=min(4, shape.num_warps), num_stages=2)


def check_vocab_stride(logits) -> None:
    # Tile offsets times the vocabulary stride are int32 in the hot loop (unit stride, the usual
    # case, is specialised away); a wider stride would overflow.
    if logits.stride(-1) * logits.shape[-1] >= 2**31:
        raise ValueError("logits whose vocabulary stride times V reaches 2^31 are not supported: pass .contiguous() logits")


def logits_rows(logits):
    """(rows, rows_per_seq, stride_b, stride_t, stride_v) of ``(B, T, V)`` or ``(N, V)`` logits."""
    if logits.dim() == 2:
        return logits.shape[0], max(logits.shape[0], 1), 0, logits.stride(0), logits.stride(1)
    B, T, _ = logits.shape
    return B * T, max(T, 1), logits.stride(0), logits.stride(1), logits.stride(2)


def logprob_entropy(logits, batch, workspace, inv_temperature: float, epilogue=None, token_offset: int = 0,
                    block_v=None, vocab_split=None) -> None:
    """Launch the forward kernel on ``(B, T, V)`` or ``(N, V)`` logits (any strides); its rows are
    tokens ``token_offset ...`` of ``batch`` (a ``RowInputs``). Writes ``workspace.per_token``.

    With ``epilogue`` (an ``EpilogueInputs``) the method's per-token terms are computed in the same
    program. Also writes ``workspace.target_index`` (the target id, or -1 for a token not scored).
    With ``vocab_split`` (``(vocab_start, vocab_total)``: these logits are columns of a wider vocabulary)
    it writes the row partials instead (no epilogue), for ``dgpo_ops.layouts.vocab.merge_row_partials``.
    """
    check_vocab_stride(logits)
    rows, rows_per_seq, stride_b, stride_t, stride_v = logits_rows(logits)
    if rows == 0:
        return
    vocab = logits.shape[-1]
    if vocab_split is not None and epilogue is not None:
        raise ValueError("a split vocabulary's rows are finished after the merge: no epilogue in the row forward")
    vocab_start, vocab_total = vocab_split if vocab_split is not None else (0, vocab)
    anchor = workspace.per_token  # a valid pointer for absent inputs (their HAS_* flag is off)

    def pointer(tensor):
        return anchor if tensor is None else tensor

    def strides(tensor):
        return (0, 0) if tensor is None else batch.strides(tensor)

    has_kl = epilogue is not None and epilogue.beta != 0.0 and batch.ref_logps is not None
    block_v = block_v or default_block_v(vocab, FORWARD_SHAPE)
    logprob_entropy_fwd_kernel[(rows,)](
        logits, batch.target_ids, pointer(batch.mask), workspace.target_index, workspace.per_token,
        batch.advantages, pointer(batch.old_logps), pointer(batch.ref_logps), pointer(batch.rollout_weights),
        pointer(epilogue and epilogue.method_params),
        inv_temperature, epilogue.beta if epilogue else 0.0, epilogue.entropy_coef if epilogue else 0.0,
        token_offset, workspace.n_tokens, batch.grid[1], rows_per_seq, vocab, vocab_start, vocab_total,
        stride_b, stride_t, stride_v,
        *strides(batch.target_ids), *strides(batch.mask), *strides(batch.advantages), *strides(batch.old_logps), *strides(batch.ref_logps),
        *strides(batch.rollout_weights),
        METHOD=epilogue.method_id if epilogue else 0,
        GATE=epilogue.gate_id if epilogue else 0,
        HAS_EPILOGUE=epilogue is not None,
        HAS_MASK=batch.mask is not None,
        HAS_OLD_LOGPS=epilogue is not None and batch.old_logps is not None,
        HAS_KL=has_kl,
        KL_TIMES_RATIO=has_kl and epilogue.kl_ratio_correction,
        HAS_ROLLOUT_WEIGHTS=epilogue is not None and batch.rollout_weights is not None,
        WRITES_PARTIALS=vocab_split is not None,
        BLOCK_V=block_v,
        **launch_shape(block_v, FORWARD_SHAPE),
    )

