"""Prologue kernel: checks the per-token inputs on the device, counts the tokens to score per response
and computes the aggregation scale of each response; no host synchronisation.

One program per response walks its ``T`` tokens in ``BLOCK_T`` blocks (which tokens are scored:
``tokens.read_targets``, the same test the row forward applies, so the two kernels do not wait for
each other) and writes, per response, the scored-token count, the ``InputError`` bits it found and
its first out-of-range target id. The last program to finish (an arrival counter) reduces over the
responses: the call's error bits, token count and first bad target id go to the status vector, and
the per-response scale ``s_b`` (``loss = sum_t s_b(t) L_t``) to ``seq_scale``. Input that cannot be
scored poisons every scale with NaN, so the loss and gradient downstream are NaN, never quietly
wrong numbers; the host reads the bits later (``dgpo_ops.core.validation``) and raises the error.

With ``HAS_FINALIZE`` (the logits op, whose row forward and epilogue ran before this launch) the
same last program then reduces the loss and metrics (``finalize.reduce_loss_and_metrics``): one
Triton launch fewer per call, which is host time where the call is host-bound (small vocabularies).

Inputs keep their own dtypes and strides (int32/int64 targets, bool/int/float masks, per-response
advantages as a zero time stride): nothing is converted or copied before the launch.
"""

import torch
import triton
import triton.language as tl

from . import codes
from .finalize import FINALIZE_WARPS, finalize_block, reduce_loss_and_metrics
from .finalize import finalize as finalize_rows
from .interface import next_power_of_2
from .tokens import read_targets


@triton.jit
def _non_finite(x):
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def _check_finite(errors, ptr, stride_b, stride_t, b, t, scored, ERROR: tl.constexpr):
    values = tl.load(ptr + b * stride_b + t * stride_t, mask=scored, other=0.0).to(tl.float32)
    return errors | tl.where(tl.sum((scored & _non_finite(values)).to(tl.int32), axis=0) > 0, ERROR, 0)


@triton.jit
def _check_log_probability(errors, ptr, stride_b, stride_t, b, t, scored, ERROR: tl.constexpr):
    """``_check_finite``'s check of a log-prob input, which also refuses a value above 0 beyond rounding."""
    values = tl.load(ptr + b * stride_b + t * stride_t, mask=scored, other=0.0).to(tl.float32)
    bad = scored & (_non_finite(values) | (values > codes.LOGP_ABOVE_ZERO_TOLERANCE))
    return errors | tl.where(tl.sum(bad.to(tl.int32), axis=0) > 0, ERROR, 0)


@triton.jit
def _check_weight(errors, ptr, stride_b, stride_t, b, t, scored, ERROR: tl.constexpr):
    """``_check_finite``'s check of an importance weight (``WEIGHT_INPUTS``), which also refuses a value below 0."""
    values = tl.load(ptr + b * stride_b + t * stride_t, mask=scored, other=0.0).to(tl.float32)
    bad = scored & (_non_finite(values) | (values < 0.0))
    return errors | tl.where(tl.sum(bad.to(tl.int32), axis=0) > 0, ERROR, 0)


@triton.jit
def token_prologue_kernel(
    target_ids_ptr,
    mask_ptr,
    advantages_ptr,
    old_logps_ptr,
    ref_logps_ptr,
    rollout_weights_ptr,
    normalizer_ptr,
    sequence_stats_ptr,
    seq_scale_ptr,
    status_ptr,
    per_token_ptr,
    target_index_ptr,
    loss_ptr,
    stats_ptr,
    normalizer,
    n_seqs,
    seq_len,
    vocab,
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
    HAS_MASK: tl.constexpr,
    CHECK_MASK_VALUES: tl.constexpr,
    HAS_OLD_LOGPS: tl.constexpr,
    HAS_REF_LOGPS: tl.constexpr,
    HAS_ROLLOUT_WEIGHTS: tl.constexpr,
    NORMALIZER: tl.constexpr,
    PER_RESPONSE: tl.constexpr,
    DENOMINATOR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_FINALIZE: tl.constexpr,
    HAS_KL: tl.constexpr,
    FINALIZE_BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    count = tl.zeros((), tl.int64)
    errors = tl.zeros((), tl.int64)
    first_bad = tl.full((), codes.NO_TOKEN, tl.int64)
    for start in range(0, seq_len, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T).to(tl.int64)
        inside = t < seq_len
        target, listed, kept, keep, in_range = read_targets(
            target_ids_ptr, mask_ptr, b, t, inside, vocab, target_stride_b, target_stride_t, mask_stride_b,
            mask_stride_t, HAS_MASK)
        # Out-of-range ids are an error wherever they sit, masked or not (as the host check does).
        bad_target = listed & ~in_range
        if CHECK_MASK_VALUES:
            bad_mask = inside & (keep != 0) & (keep != 1)
            errors = errors | tl.where(tl.sum(bad_mask.to(tl.int32), axis=0) > 0, codes.ERR_MASK, 0)
        scored = listed & kept
        errors = errors | tl.where(tl.sum(bad_target.to(tl.int32), axis=0) > 0, codes.ERR_TARGET_IDS, 0)
        first_bad = tl.minimum(first_bad, tl.min(tl.where(bad_target, t, codes.NO_TOKEN), axis=0))
        count += tl.sum((scored & in_range).to(tl.int64), axis=0)
        errors = _check_finite(errors, advantages_ptr, adv_stride_b, adv_stride_t, b, t, scored, codes.ERR_ADVANTAGES)
        if HAS_OLD_LOGPS:
            errors = _check_log_probability(errors, old_logps_ptr, old_stride_b, old_stride_t, b, t, scored,
                                            codes.ERR_OLD_LOGPS)
        if HAS_REF_LOGPS:
            errors = _check_log_probability(errors, ref_logps_ptr, ref_stride_b, ref_stride_t, b, t, scored,
                                            codes.ERR_REF_LOGPS)
        if HAS_ROLLOUT_WEIGHTS:
            errors = _check_weight(errors, rollout_weights_ptr, rw_stride_b, rw_stride_t, b, t, scored,
                                   codes.ERR_ROLLOUT_WEIGHTS)
    bad_value = tl.load(target_ids_ptr + b * target_stride_b + first_bad * target_stride_t,
                        mask=first_bad != codes.NO_TOKEN, other=0).to(tl.int64)
    tl.store(sequence_stats_ptr + codes.SEQ_TOKENS * n_seqs + b, count)
    tl.store(sequence_stats_ptr + codes.SEQ_ERRORS * n_seqs + b, errors)
    tl.store(sequence_stats_ptr + codes.SEQ_FIRST_BAD_TARGET * n_seqs + b, bad_value)

    # The last program to arrive reduces over the responses. The barrier orders every thread's
    # stores before the release; the acquire makes the other programs' stores visible here.
    tl.debug_barrier()
    arrived = tl.atomic_add(status_ptr + codes.STATUS_ARRIVED, 1, sem="acq_rel")
    if arrived == n_seqs - 1:
        total = tl.zeros((), tl.int64)
        scored_responses = tl.zeros((), tl.int64)
        all_errors = tl.zeros((), tl.int64)
        bad_target_value = tl.zeros((), tl.int64)
        found_bad = tl.zeros((), tl.int32)
        for b_start in range(0, n_seqs, BLOCK_B):
            seqs = b_start + tl.arange(0, BLOCK_B)
            in_batch = seqs < n_seqs
            counts = tl.load(sequence_stats_ptr + codes.SEQ_TOKENS * n_seqs + seqs, mask=in_batch, other=0,
                             cache_modifier=".cg")
            seq_errors = tl.load(sequence_stats_ptr + codes.SEQ_ERRORS * n_seqs + seqs, mask=in_batch, other=0,
                                 cache_modifier=".cg")
            bad_values = tl.load(sequence_stats_ptr + codes.SEQ_FIRST_BAD_TARGET * n_seqs + seqs, mask=in_batch,
                                 other=0, cache_modifier=".cg")
            total += tl.sum(counts, axis=0)
            if DENOMINATOR == codes.DENOMINATOR_SCORED_RESPONSES:  # only where it divides: no work for the others
                scored_responses += tl.sum((counts > 0).to(tl.int64), axis=0)
            all_errors = all_errors | tl.reduce(seq_errors, 0, _bitwise_or)
            has_bad = (seq_errors & codes.ERR_TARGET_IDS) != 0
            first = tl.min(tl.where(has_bad, seqs, codes.NO_TOKEN), axis=0)
            take = (found_bad == 0) & (first != codes.NO_TOKEN)
            bad_target_value = tl.where(take, tl.sum(tl.where(seqs == first, bad_values, 0), axis=0),
                                        bad_target_value)
            found_bad = tl.where(take, 1, found_bad)

        if DENOMINATOR == codes.DENOMINATOR_TOKENS:
            denominator = tl.maximum(total, 1).to(tl.float32)
        elif DENOMINATOR == codes.DENOMINATOR_RESPONSES:
            denominator = tl.maximum(n_seqs, 1).to(tl.float32)
        elif DENOMINATOR == codes.DENOMINATOR_GRID:
            denominator = tl.maximum(n_seqs * seq_len, 1).to(tl.float32)
        elif DENOMINATOR == codes.DENOMINATOR_SCORED_RESPONSES:
            denominator = tl.maximum(scored_responses, 1).to(tl.float32)
        elif DENOMINATOR == codes.DENOMINATOR_HORIZON:
            denominator = tl.maximum(seq_len, 1).to(tl.float32)
        elif DENOMINATOR == codes.DENOMINATOR_ONE:
            denominator = 1.0
        else:
            tl.static_assert(False, "token_prologue_kernel: unknown DENOMINATOR (add its branch here and its "
                                    "row of COUNTED_DENOMINATORS or FIXED_DENOMINATORS)")
        if NORMALIZER == codes.NORMALIZER_VALUE:
            denominator = normalizer
        elif NORMALIZER == codes.NORMALIZER_TENSOR:
            denominator = tl.load(normalizer_ptr).to(tl.float32)
            usable = (denominator > 0.0) & ~_non_finite(denominator)
            all_errors = all_errors | tl.where(usable, 0, codes.ERR_LOSS_NORMALIZER)
        elif NORMALIZER != codes.NORMALIZER_ABSENT:
            tl.static_assert(False, "token_prologue_kernel: unknown NORMALIZER (add its branch here and in "
                                    "token_prologue_torch's)")
        poison = all_errors != 0
        for b_start in range(0, n_seqs, BLOCK_B):
            seqs = b_start + tl.arange(0, BLOCK_B)
            in_batch = seqs < n_seqs
            if PER_RESPONSE:
                counts = tl.load(sequence_stats_ptr + codes.SEQ_TOKENS * n_seqs + seqs, mask=in_batch, other=1,
                                 cache_modifier=".cg")
                # Rounded twice, like the torch path: (1 / |o_b|) / denominator.
                within = tl.div_rn(1.0, tl.maximum(counts, 1).to(tl.float32))
            else:
                within = tl.full((BLOCK_B,), 1.0, tl.float32)
            scale = tl.div_rn(within, denominator)
            tl.store(seq_scale_ptr + seqs, tl.where(poison, float("nan"), scale), mask=in_batch)
        tl.store(status_ptr + codes.STATUS_ERRORS, all_errors)
        tl.store(status_ptr + codes.STATUS_BAD_TARGET, bad_target_value)
        tl.store(status_ptr + codes.STATUS_TOKENS, total)
        if HAS_FINALIZE:
            # The reduction reads back the scales and status this program's threads just stored:
            # the barrier makes them visible to every thread of the block.
            tl.debug_barrier()
            reduce_loss_and_metrics(per_token_ptr, target_index_ptr, seq_scale_ptr, status_ptr, loss_ptr, stats_ptr,
                                    n_seqs * seq_len, seq_len, HAS_KL, FINALIZE_BLOCK)


def prologue_warps(finalizes: bool) -> int:
    """4 warps for the checks; the finalize kernel's warps when the last program also reduces the tokens."""
    return FINALIZE_WARPS if finalizes else 4


def token_prologue(batch, sequence_stats, seq_scale, status, vocab: int, aggregation_codes, normalizer,
                   finalize=None) -> None:
    """Launch the prologue over a ``RowInputs`` batch (``dgpo_ops.kernels.row_io``).

    ``status`` must hold zeros (its arrival counter); ``aggregation_codes`` is
    ``(per_response, Denominator)``; ``normalizer`` a ``(Normalizer, float, tensor or None)``.
    ``finalize``: ``(workspace, has_kl)`` to reduce the loss and metrics into that ``RowWorkspace``
    in the same launch; its planes must have been written by the row forward with the epilogue.
    """
    n_seqs, seq_len = batch.grid

    def strides(tensor):
        return (0, 0) if tensor is None else batch.strides(tensor)

    per_response, denominator = aggregation_codes
    normalizer_kind, normalizer_value, normalizer_tensor = normalizer
    anchor = batch.advantages  # a valid pointer for absent optional inputs (their HAS_* flag is off)

    def pointer(tensor):
        return anchor if tensor is None else tensor

    workspace, has_kl = finalize if finalize is not None else (None, False)
    if workspace is not None and workspace.n_tokens != n_seqs * seq_len:
        raise ValueError(f"the workspace holds {workspace.n_tokens} tokens, the batch {n_seqs} x {seq_len}")
    if n_seqs == 0:  # no program would run: the loss and metrics of no tokens (0) from the finalize kernel
        if workspace is not None:
            finalize_rows(workspace, max(seq_len, 1), has_kl)
        return
    finalize_pointers = ((workspace.per_token, workspace.target_index, workspace.loss, workspace.stats)
                         if workspace is not None else (seq_scale,) * 4)

    token_prologue_kernel[(n_seqs,)](
        batch.target_ids, pointer(batch.mask), batch.advantages, pointer(batch.old_logps), pointer(batch.ref_logps),
        pointer(batch.rollout_weights), pointer(normalizer_tensor),
        sequence_stats, seq_scale, status, *finalize_pointers,
        float(normalizer_value), n_seqs, seq_len, vocab,
        *strides(batch.target_ids), *strides(batch.mask), *strides(batch.advantages), *strides(batch.old_logps),
        *strides(batch.ref_logps), *strides(batch.rollout_weights),
        HAS_MASK=batch.mask is not None,
        CHECK_MASK_VALUES=batch.mask is not None and batch.mask.dtype != torch.bool,
        HAS_OLD_LOGPS=batch.old_logps is not None,
        HAS_REF_LOGPS=batch.ref_logps is not None,
        HAS_ROLLOUT_WEIGHTS=batch.rollout_weights is not None,
        NORMALIZER=int(normalizer_kind),
        PER_RESPONSE=per_response,
        DENOMINATOR=int(denominator),
        BLOCK_T=min(1024, next_power_of_2(max(seq_len, 1))),
        BLOCK_B=min(1024, next_power_of_2(max(n_seqs, 1))),
        HAS_FINALIZE=workspace is not None,
        HAS_KL=has_kl,
        FINALIZE_BLOCK=finalize_block(n_seqs * seq_len) if workspace is not None else 16,  # no recompile per size
        num_warps=prologue_warps(workspace is not None),
    )
