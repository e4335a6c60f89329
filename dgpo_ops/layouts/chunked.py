"""The policy loss for the token layouts the row kernels do not take: a vocabulary split across
processes (``vocab_parallel_group``), packed (padding-free) sequences (``cu_seqlens``), or both.

The per-token log-probs and entropies come from ``dgpo_ops.layouts.vocab`` (chunks of rows in torch,
merged over the group); for packed sequences they are laid on the padded ``(B, max_seqlen)`` grid
(``dgpo_ops.layouts.packed``: O(tokens) values), where the aggregations, per-response advantages and GSPO's
sequence ratio are defined. Everything after the per-token values (the method, aggregation, KL,
entropy bonus, GSPO, the metrics) is the reference's torch objective, so every method and option is
as on one process with the padded layout. The Triton row kernels take neither layout yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpo_ops.core.inputs import LossBatch, per_token_dtype, prepare_batch
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.layouts.packed import TokenLayout
from dgpo_ops.core.objective import masked_objective
from dgpo_ops.core.validation import resolve_mode
from dgpo_ops.layouts.vocab import ChunkedLinearLogProbEntropy, ChunkedLogProbEntropy, Projection, vocab_shard


@dataclass(frozen=True)
class CallLayout:
    """Where one call's vocabulary and tokens lie, beyond what the tensors' shapes say: a process group
    over which the vocabulary is split, and the boundaries of packed sequences."""

    vocab_parallel_group: object = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None

    def __post_init__(self):
        if self.max_seqlen is not None and self.cu_seqlens is None:
            raise ValueError("max_seqlen goes with cu_seqlens (packed sequences)")

    @property
    def needs_chunked_path(self) -> bool:
        """The row kernels take neither a split vocabulary nor packed sequences."""
        return self.vocab_parallel_group is not None or self.cu_seqlens is not None


def objective_loss(per_token_fn, token_layout: TokenLayout, vocab: int, dtype, device, loss_batch: LossBatch,
                   options: LossOptions, check: bool) -> PolicyLossOutput:
    """The reference's objective on per-token values ``per_token_fn(target_ids (n,), scored (n,)) -> (logp,
    entropy)`` (``scored``: the token is scored; the others' logits or hidden states are read as 0)
    (differentiable), on the grid of ``token_layout``."""
    packed = token_layout.packed
    if packed is not None:
        loss_batch = packed.padded_batch(loss_batch)
        grid_shape = torch.Size((*packed.grid, vocab))
    else:
        grid_shape = torch.Size((*token_layout.token_shape, vocab))
    batch = prepare_batch(grid_shape, dtype, device, loss_batch, options.aggregation, options.sequence_level,
                          check=check)
    grid = batch.mask.shape
    targets = batch.target_ids.reshape(-1) if packed is None else packed.unpad(batch.target_ids)
    scored = batch.mask.reshape(-1) if packed is None else packed.unpad(batch.mask)
    logp, entropy = per_token_fn(targets, scored)
    if packed is not None:
        logp, entropy = packed.pad(logp, 0.0), packed.pad(entropy, 0.0)
    loss, logp, entropy, metrics = masked_objective(logp.reshape(grid), entropy.reshape(grid), batch, options)
    if not check:  # deferred validation: input the host did not check makes the loss NaN, never quietly wrong
        invalid = (batch.mask & ((batch.target_ids < 0) | (batch.target_ids >= vocab))).any()
        if packed is not None:
            invalid = invalid | packed.invalid
        loss = torch.where(invalid, float("nan"), loss)

    def per_token_output(values):  # fp32 (fp64 for fp64 inputs), as the fused ops give them
        values = values.detach().to(per_token_dtype(dtype))
        return batch.unflatten(values) if packed is None else packed.unpad(values)

    return PolicyLossOutput(loss, per_token_output(logp), per_token_output(entropy), metrics)


def _refuse_unsupported_options(options: LossOptions):
    if options.inplace:
        raise ValueError("inplace=True is not supported with vocab_parallel_group or cu_seqlens")
    if torch.compiler.is_compiling():
        raise ValueError("vocab_parallel_group and cu_seqlens are not supported under torch.compile yet")


def chunked_loss_from_options(logits, loss_batch: LossBatch, options: LossOptions,
                              call_layout: CallLayout) -> PolicyLossOutput:
    """``fused_dgpo_loss`` with ``vocab_parallel_group`` and/or ``cu_seqlens``."""
    if not torch.is_tensor(logits) or logits.dim() not in (2, 3):
        raise ValueError("logits must be a tensor of shape (B, T, V) or (N, V) (V / P columns with vocab_parallel_group)")
    _refuse_unsupported_options(options)
    check = resolve_mode(options.validation, logits.device) == "immediate"
    layout = TokenLayout.build(logits.shape[:-1], logits.device, call_layout.cu_seqlens, call_layout.max_seqlen, check)
    shard = vocab_shard(call_layout.vocab_parallel_group, logits.shape[-1], logits.shape[:-1].numel(), logits.device,
                        check)

    def per_token(targets, scored):
        return ChunkedLogProbEntropy.apply(logits, targets, shard, 1.0 / options.temperature, scored)

    return objective_loss(per_token, layout, shard.vocab, logits.dtype, logits.device, loss_batch, options, check)


def chunked_linear_loss_from_options(hidden, weight, bias, loss_batch: LossBatch, options: LossOptions,
                                     logit_scale: float, softcap: float | None, operand: torch.dtype,
                                     call_layout: CallLayout) -> PolicyLossOutput:
    """``fused_linear_dgpo_loss`` with ``vocab_parallel_group`` (``weight`` and ``bias``: this process's
    rows) and/or ``cu_seqlens``; ``hidden`` is ``(B, T, H)`` or ``(N, H)``, the same on every process."""
    _refuse_unsupported_options(options)
    check = resolve_mode(options.validation, hidden.device) == "immediate"
    token_shape = hidden.shape[:-1]
    layout = TokenLayout.build(token_shape, hidden.device, call_layout.cu_seqlens, call_layout.max_seqlen, check)
    shard = vocab_shard(call_layout.vocab_parallel_group, weight.shape[0], token_shape.numel(), hidden.device, check)
    projection = Projection(float(logit_scale), softcap, 1.0 / options.temperature, operand)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])

    def per_token(targets, scored):
        return ChunkedLinearLogProbEntropy.apply(flat_hidden, weight, bias, targets, shard, projection, scored)

    return objective_loss(per_token, layout, shard.vocab, operand, hidden.device, loss_batch, options, check)
