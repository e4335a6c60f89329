"""Plain-PyTorch reference: log_softmax + gather + the method table + autograd.

It materialises the full (N, V) fp32 log-softmax: it is the ground truth the fused ops are
tested against, not a path to train with.
"""

from __future__ import annotations

import torch

from dgpo_ops.core.inputs import LossInputs, prepare_batch
from dgpo_ops.core.objective import entropy_weight_term, masked_objective
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.layouts.packed import PackedLayout
from dgpo_ops.layouts.rows import CallLayout
from dgpo_ops.ops.compiled import checked_inputs_op, options_spec, split_normalizer


def reference_route(logits, batch: LossInputs, options: LossOptions) -> PolicyLossOutput:
    """``policy_loss(..., logits=..., reference=True)``'s route (``reference_loss``): packed logits on their
    padded grid, others as they are."""
    if batch.cu_seqlens is not None or batch.max_seqlen is not None:
        return packed_reference_loss(logits, batch, options, batch.cu_seqlens, batch.max_seqlen)
    return reference_loss_from_options(logits, batch, options)


def packed_reference_loss(logits, loss_batch: LossInputs, options: LossOptions, cu_seqlens, max_seqlen):
    """Packed ``(total_tokens, V)`` logits: the reference on the padded ``(B, max_seqlen, V)`` layout (which
    it materialises), per-token outputs back in packed order."""
    if not torch.is_tensor(logits):
        raise ValueError(f"logits must be a tensor, got {type(logits).__name__}")
    CallLayout(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)  # refuses a max_seqlen without cu_seqlens
    if logits.dim() != 2:
        raise ValueError(f"packed tokens (cu_seqlens) are (total_tokens, V) logits, got shape {tuple(logits.shape)}")
    if loss_batch.entropy_weights is not None:  # as the fused ops
        raise ValueError("entropy_weights are not supported with cu_seqlens yet")
    packed = PackedLayout.build(cu_seqlens, logits.shape[0], logits.device, max_seqlen)
    out = reference_loss_from_options(packed.pad(logits, 0.0), packed.padded_batch(loss_batch), options)
    return out._replace(logps=packed.unpad(out.logps), entropy=packed.unpad(out.entropy))


def reference_loss_from_options(logits, loss_batch: LossInputs, options: LossOptions) -> PolicyLossOutput:
    compiling = torch.compiler.is_compiling()
    batch = prepare_batch(logits.shape, logits.dtype, logits.device, loss_batch, options.aggregation,
                          options.sequence_reason, check=not compiling)
    if compiling:
        # The value checks (host reads) as one op that returns 1.0 or raises; the logits are scaled
        # by it so that it runs before anything reads them (an out-of-range target, say).
        logits = logits * checked_inputs_op(*loss_batch.tensors(), *split_normalizer(loss_batch.loss_normalizer),
                                            list(logits.shape), logits.dtype, options_spec(options))
    grid = batch.mask.shape
    x = logits.reshape(*grid, logits.shape[-1])
    x = x.to(torch.promote_types(x.dtype, torch.float32)) / options.temperature
    log_probs = torch.log_softmax(x, dim=-1)
    logp = log_probs.gather(-1, batch.target_ids.unsqueeze(-1)).squeeze(-1)
    probs = log_probs.exp()
    # p log p is 0 where p is 0 (a -inf logit), not 0 * -inf, in the value and in its gradient.
    entropy = -(probs * torch.where(probs > 0, log_probs, 0.0)).sum(-1)
    loss, logp, entropy, metrics = masked_objective(logp, entropy, batch, options, loss_batch.generator)
    if loss_batch.entropy_weights is not None:
        weights = loss_batch.entropy_weights.reshape(grid).to(entropy.dtype)
        loss = loss + entropy_weight_term(entropy, weights, batch.mask)

    def per_token_output(values):  # fp32, 0 on masked tokens (where the fused kernels read nothing)
        return batch.unflatten(values.detach().float())

    return PolicyLossOutput(loss, per_token_output(logp), per_token_output(entropy), metrics)
