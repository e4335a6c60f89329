"""The policy loss from logits whose vocabulary is split across a process group (a tensor-parallel,
column-parallel lm_head, as Megatron and verl's Megatron workers run it): every process holds the
same tokens and ``V / P`` columns of their logits, in rank order.

Per token, each process reduces its columns to three numbers in one pass (the local max ``m``,
``s = sum exp(x - m)`` and ``w = sum exp(x - m) x``, plus the target's logit where it lies in its
columns); one all-reduce (MAX) of the maxima and one (SUM) of ``[s, w, target]`` rescaled to the
global max give the log-sum-exp, the target's log-prob and the entropy ``lse - w / s`` exactly as
one process over the whole vocabulary would. Neither logits nor weights cross processes: 4 + 12
bytes per token. Everything after (the method, aggregation, KL, entropy bonus, GSPO's sequence
ratio, the metrics) is the reference's torch objective on those per-token values, so every method
and option is as on one process. The backward needs no communication: each process's gradient
``g_logp (onehot - p) - g_H p (log p + H)`` needs only the global ``lse`` and ``H`` per token.

This is a chunked torch path (chunks of rows within ``CHUNK_BYTES``), on CPU and CUDA alike; the
Triton row kernels do not take a split vocabulary yet.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .inputs import LossBatch, prepare_batch
from .metrics import policy_metrics
from .objective import policy_objective
from .options import LossOptions
from .output import PolicyLossOutput
from .validation import refuse_double_backward, resolve_mode

CHUNK_BYTES = 64 * 2**20  # fp32 temporaries of one chunk of rows


def _chunks(n_rows: int, columns: int):
    rows = max(1, CHUNK_BYTES // (4 * max(columns, 1)))
    for start in range(0, n_rows, rows):
        yield slice(start, min(start + rows, n_rows))


class VocabParallelLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per token from this process's columns ``(n, V / P)`` of the logits."""

    @staticmethod
    def forward(ctx, logits, target_ids, vocab_start: int, group, inv_temperature: float):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        n, columns = logits.shape
        local_max = torch.empty(n, dtype=dtype, device=logits.device)
        partial = torch.zeros(3, n, dtype=dtype, device=logits.device)  # s, w, target logit (at local_max)
        local_target = target_ids - vocab_start
        owned = (local_target >= 0) & (local_target < columns)
        for rows in _chunks(n, columns):
            x = logits[rows].to(dtype) * inv_temperature
            m = x.max(dim=-1).values
            e = torch.exp(x - m[:, None])
            local_max[rows] = m
            partial[0, rows] = e.sum(-1)
            partial[1, rows] = torch.where(e > 0, e * x, 0.0).sum(-1)  # 0 * -inf is 0 here, not NaN
            picked = x.gather(-1, local_target[rows].clamp(0, columns - 1)[:, None])[:, 0]
            partial[2, rows] = torch.where(owned[rows], picked, 0.0)
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        rescale = torch.exp(local_max - global_max)
        rescale = torch.where(torch.isfinite(local_max), rescale, 0.0)  # a shard of -inf logits adds nothing
        partial[0] *= rescale
        partial[1] *= rescale
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
        total, weighted, target_logit = partial
        lse = global_max + torch.log(total)
        logp = target_logit - lse
        entropy = lse - weighted / total
        ctx.save_for_backward(logits, local_target, owned, lse, entropy)
        ctx.inv_temperature = inv_temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("fused_dgpo_loss with vocab_parallel_group")
        logits, local_target, owned, lse, entropy = ctx.saved_tensors
        dtype = lse.dtype
        n, columns = logits.shape
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(dtype)
        grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy.to(dtype)
        grad_logits = torch.empty_like(logits)
        for rows in _chunks(n, columns):
            log_p = logits[rows].to(dtype) * ctx.inv_temperature - lse[rows, None]
            p = torch.exp(log_p)
            # d logp / dx = onehot - p;  d H / dx = -p (log p + H), 0 where p is 0
            grad = -p * grad_logp[rows, None] - grad_entropy[rows, None] * torch.where(
                p > 0, p * (log_p + entropy[rows, None]), 0.0)
            hit = owned[rows]
            grad[hit, local_target[rows][hit]] += grad_logp[rows][hit]
            grad_logits[rows] = (grad * ctx.inv_temperature).to(logits.dtype)
        return grad_logits, None, None, None, None


def _group_layout(logits, group, check: bool) -> tuple[int, int]:
    """(this process's first column, the whole vocabulary) for equal shards in rank order. With
    ``check`` (immediate validation) the processes' token and column counts are compared (one small
    all-reduce and a host read), so mismatched groups fail loudly."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("vocab_parallel_group needs torch.distributed initialised (init_process_group)")
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"vocab_parallel_group is not a process group this process belongs to: {error}") from None
    if rank < 0:
        raise ValueError("vocab_parallel_group is not a process group this process belongs to")
    n_tokens, columns = logits.shape[:-1].numel(), logits.shape[-1]
    if check:
        sizes = torch.tensor([columns, -columns, n_tokens, -n_tokens], dtype=torch.float64, device=logits.device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
        most_columns, fewest_columns, most_tokens, fewest_tokens = sizes.tolist()
        if most_columns != -fewest_columns:
            raise ValueError(f"vocab_parallel_group: every process must hold an equal share of the vocabulary "
                             f"(in rank order); the shares here range from {int(-fewest_columns)} to "
                             f"{int(most_columns)} columns")
        if most_tokens != -fewest_tokens:
            raise ValueError(f"vocab_parallel_group: every process must hold the same tokens (a tensor-parallel "
                             f"group); the token counts range from {int(-fewest_tokens)} to {int(most_tokens)}")
    return rank * columns, world * columns


def vocab_parallel_loss_from_options(logits, loss_batch: LossBatch, options: LossOptions, group) -> PolicyLossOutput:
    if not torch.is_tensor(logits) or logits.dim() not in (2, 3):
        raise ValueError("logits must be a tensor of shape (B, T, V / P) or (N, V / P)")
    if options.inplace:
        raise ValueError("inplace=True is not supported with vocab_parallel_group")
    if torch.compiler.is_compiling():
        raise ValueError("vocab_parallel_group is not supported under torch.compile yet")
    check = resolve_mode(options.validation, logits.device) == "immediate"
    vocab_start, vocab = _group_layout(logits, group, check)
    whole_shape = torch.Size((*logits.shape[:-1], vocab))
    batch = prepare_batch(whole_shape, logits.dtype, logits.device, loss_batch, options.aggregation,
                          options.sequence_level, check=check)
    grid = batch.mask.shape
    logp, entropy = VocabParallelLogProbEntropy.apply(logits.reshape(-1, logits.shape[-1]),
                                                      batch.target_ids.reshape(-1), vocab_start, group,
                                                      1.0 / options.temperature)
    logp = torch.where(batch.mask, logp.reshape(grid), 0.0)
    entropy = torch.where(batch.mask, entropy.reshape(grid), 0.0)
    terms = policy_objective(logp, entropy, batch, options)
    metrics = policy_metrics(terms.log_ratio, terms.tokens.psi, terms.tokens.region, entropy, terms.kl, batch.mask)
    loss = terms.loss
    if not check:  # deferred validation: a target id outside the vocabulary makes the loss NaN, never quietly wrong
        outside = batch.mask & ((batch.target_ids < 0) | (batch.target_ids >= vocab))
        loss = torch.where(outside.any(), float("nan"), loss)
    return PolicyLossOutput(loss, batch.unflatten(logp.detach().float()),
                            batch.unflatten(entropy.detach().float()), metrics)
