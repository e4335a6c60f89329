"""Forward row kernel: one pass over each logits row gives log-sum-exp, the target's log-prob and
the entropy; for token-level methods an epilogue evaluates the method table in the same program.

One program per token on grid axis 0 (2^31 - 1 programs; the 65,535 cap of axes 1 and 2 never
applies). The row is read once, in BLOCK_V tiles, with an online max / sum-exp / sum-exp-times-x
in fp32. Masked tokens read nothing and write zeros.
"""

import torch
import triton
import triton.language as tl

from .method_table import token_terms
from .row_io import EpilogueInputs, EpilogueOutputs, RowForward


@triton.jit
def logprob_entropy_fwd_kernel(
    logits_ptr,
    target_ids_ptr,
    mask_ptr,
    row_max_ptr,
    log_norm_ptr,
    logp_ptr,
    entropy_ptr,
    advantages_ptr,
    old_logps_ptr,
    ref_logps_ptr,
    rollout_weights_ptr,
    method_params_ptr,
    token_loss_ptr,
    dloss_dlogp_ptr,
    psi_ptr,
    region_ptr,
    kl_ptr,
    inv_temperature,
    beta,
    seq_len,
    vocab,
    stride_b,
    stride_t,
    stride_v,
    METHOD: tl.constexpr,
    GATE: tl.constexpr,
    HAS_EPILOGUE: tl.constexpr,
    HAS_OLD_LOGPS: tl.constexpr,
    HAS_KL: tl.constexpr,
    KL_TIMES_RATIO: tl.constexpr,
    HAS_ROLLOUT_WEIGHTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (token // seq_len) * stride_b + (token % seq_len) * stride_t
    valid = tl.load(mask_ptr + token) != 0
    target = tl.load(target_ids_ptr + token)
    vocab_end = tl.where(valid, vocab, 0)

    # Running over the row: max m, S = sum exp(x - m) and U = sum exp(x - m) (x - m). Centring U on
    # the running max keeps the entropy H = log S - U / S accurate for peaked rows with large logits.
    row_max = -float("inf")
    sum_exp = 0.0
    sum_exp_dx = 0.0
    for start in range(0, vocab_end, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offsets * stride_v, mask=offsets < vocab, other=-float("inf")).to(tl.float32)
        x = x * inv_temperature
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        # A tile of -inf logits (vocabulary masking) must not give exp(-inf - -inf) = nan.
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        e = tl.exp(x - shift)
        rescale = tl.exp(row_max - shift)
        recentre = tl.where(sum_exp > 0.0, (row_max - shift) * sum_exp, 0.0)  # (x - m) = (x - m') + (m' - m)
        sum_exp_dx = rescale * (sum_exp_dx + recentre) + tl.sum(tl.where(e > 0.0, e * (x - shift), 0.0), axis=0)
        sum_exp = sum_exp * rescale + tl.sum(e, axis=0)
        row_max = new_max

    shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    log_sum_exp = tl.log(tl.where(valid, sum_exp, 1.0))
    target_logit = tl.load(row_ptr + target * stride_v, mask=valid, other=0.0).to(tl.float32) * inv_temperature
    # log-sum-exp kept as (max, log S) rather than their sum: log p = (x - max) - log S keeps full
    # precision for confident tokens (log p ~ -1e-3) where x - lse would cancel.
    logp = tl.where(valid, (target_logit - shift) - log_sum_exp, 0.0)
    entropy = tl.where(valid, log_sum_exp - sum_exp_dx / sum_exp, 0.0)
    tl.store(row_max_ptr + token, tl.where(valid, shift, 0.0))
    tl.store(log_norm_ptr + token, tl.where(valid, log_sum_exp, 0.0))
    tl.store(logp_ptr + token, logp)
    tl.store(entropy_ptr + token, entropy)

    if HAS_EPILOGUE:
        adv = tl.load(advantages_ptr + token)
        if HAS_OLD_LOGPS:
            old_logp = tl.load(old_logps_ptr + token)
        else:
            old_logp = logp
        loss, psi, region = token_terms(logp - old_logp, adv, old_logp, logp, method_params_ptr, METHOD, GATE)
        dloss_dlogp = -adv * psi
        if HAS_ROLLOUT_WEIGHTS:
            weight = tl.load(rollout_weights_ptr + token)
            loss = loss * weight
            dloss_dlogp = dloss_dlogp * weight
        if HAS_KL:
            delta = tl.load(ref_logps_ptr + token) - logp
            ref_ratio = tl.exp(delta)
            kl = ref_ratio - delta - 1.0
            dkl_dlogp = 1.0 - ref_ratio
            if KL_TIMES_RATIO:  # r KL: d(r KL)/dl = r (KL + dKL/dl) = r (l - l_ref), without cancellation
                ratio = tl.exp(logp - old_logp)
                dkl_dlogp = -ratio * delta
                kl = ratio * kl
            loss += beta * kl
            dloss_dlogp += beta * dkl_dlogp
            tl.store(kl_ptr + token, tl.where(valid, kl, 0.0))
        tl.store(token_loss_ptr + token, tl.where(valid, loss, 0.0))
        tl.store(dloss_dlogp_ptr + token, tl.where(valid, dloss_dlogp, 0.0))
        tl.store(psi_ptr + token, tl.where(valid, psi, 0.0))
        tl.store(region_ptr + token, tl.where(valid, region, 0).to(tl.int8))



def default_block_v(vocab: int) -> int:
    return min(triton.next_power_of_2(vocab), 4096)


def check_vocab_stride(logits: torch.Tensor) -> None:
    # Tile offsets times the vocabulary stride are int32 in the hot loop (unit stride, the usual
    # case, is specialised away); a wider stride would overflow.
    if logits.stride(2) * logits.shape[2] >= 2**31:
        raise ValueError("logits whose vocabulary stride times V reaches 2^31 are not supported: pass .contiguous() logits")


def logprob_entropy(logits, target_ids, mask, inv_temperature, epilogue=None, block_v=None) -> RowForward:
    """Launch the forward kernel on ``(B, T, V)`` logits (any strides).

    ``target_ids`` (int64) and ``mask`` (bool) are contiguous ``(B, T)``; with ``epilogue``
    (an ``EpilogueInputs``) the method's per-token terms are computed in the same program.
    """
    check_vocab_stride(logits)
    B, T, V = logits.shape
    row_max, log_norm, logp, entropy = (torch.empty((B, T), device=logits.device, dtype=torch.float32)
                                        for _ in range(4))
    out = EpilogueOutputs.empty(epilogue, (B, T), logits.device) if epilogue is not None else None
    inputs = epilogue or EpilogueInputs.absent()

    def pointer(tensor):  # absent optional tensors: a valid pointer that the HAS_* flags never read
        return logp if tensor is None else tensor

    block_v = block_v or default_block_v(V)
    logprob_entropy_fwd_kernel[(B * T,)](
        logits, target_ids, mask, row_max, log_norm, logp, entropy,
        pointer(inputs.advantages), pointer(inputs.old_logps), pointer(inputs.ref_logps),
        pointer(inputs.rollout_weights), pointer(inputs.method_params),
        pointer(out and out.token_loss), pointer(out and out.dloss_dlogp), pointer(out and out.psi),
        pointer(out and out.region), pointer(out and out.kl),
        inv_temperature, inputs.beta, T, V, logits.stride(0), logits.stride(1), logits.stride(2),
        METHOD=inputs.method_id, GATE=inputs.gate_id,
        HAS_EPILOGUE=epilogue is not None,
        HAS_OLD_LOGPS=inputs.old_logps is not None,
        HAS_KL=inputs.ref_logps is not None,
        KL_TIMES_RATIO=inputs.kl_ratio_correction,
        HAS_ROLLOUT_WEIGHTS=inputs.rollout_weights is not None,
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 4096 else 4,
    )
    return RowForward(row_max, log_norm, logp, entropy, out)
