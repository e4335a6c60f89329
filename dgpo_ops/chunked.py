"""The policy loss by chunks of rows in torch, for the token layouts the row kernels do not take:
a vocabulary split across processes, packed (padding-free) sequences, or both.

**Split vocabulary** (tensor parallelism: Megatron's column-parallel lm_head, verl's Megatron workers).
Every process holds the same tokens and an equal share of the vocabulary, in rank order: ``V / P``
columns of the logits, or ``V / P`` rows of the lm_head weight. Per token, each process reduces its
columns to three numbers in one pass (the local max ``m``, ``s = sum exp(x - m)``, ``w = sum exp(x - m)
x``, and the target's logit where it lies in its columns); one all-reduce (MAX, 4 bytes per token) of
the maxima and one (SUM, 12 bytes) of ``[s, w, target]`` rescaled to the global max give the
log-sum-exp, the target's log-prob and the entropy ``lse - w / s`` as one process over the whole
vocabulary would. Neither logits nor weights cross processes. The backward of the logits needs no
communication: ``g_logp (onehot - p) - g_H p (log p + H)`` needs only the global ``lse`` and ``H``.
From hidden states, the hidden state's gradient is a sum over the vocabulary, so each process's part
is all-reduced (``N x H`` values, as Megatron's column-parallel layer does in its backward).

**Packed sequences** (``cu_seqlens``): the per-token log-probs and entropies are laid on the padded
``(B, max_seqlen)`` grid (O(tokens) values, ``dgpo_ops.packed``), where the aggregations, per-response
advantages and GSPO's sequence ratio are defined.

Everything after the per-token values (the method, aggregation, KL, entropy bonus, GSPO, the metrics)
is the reference's torch objective, so every method and option is as on one process with the padded
layout. Chunks of rows stay within ``CHUNK_BYTES`` of fp32 temporaries; the Triton row kernels take
neither layout yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .inputs import LossBatch, per_token_dtype, prepare_batch
from .metrics import policy_metrics
from .objective import policy_objective
from .options import LossOptions
from .output import PolicyLossOutput
from .packed import PackedLayout
from .validation import refuse_double_backward, resolve_mode

CHUNK_BYTES = 64 * 2**20  # fp32 temporaries of one chunk of rows


@dataclass(frozen=True)
class CallLayout:
    """Where one call's vocabulary and tokens lie, beyond what the tensors' shapes say: a process group
    over which the vocabulary is split, and the boundaries of packed sequences."""

    vocab_parallel_group: object = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None

    @property
    def chunked(self) -> bool:
        """The call takes this module's path (the row kernels take neither layout)."""
        return self.vocab_parallel_group is not None or self.cu_seqlens is not None


@dataclass(frozen=True)
class VocabShard:
    """This process's columns ``[start, start + size)`` of a ``vocab``-wide vocabulary; ``group`` is
    None when the vocabulary is whole."""

    group: object
    start: int
    size: int
    vocab: int


def _chunks(n_rows: int, columns: int):
    rows = max(1, CHUNK_BYTES // (4 * max(columns, 1)))
    for start in range(0, n_rows, rows):
        yield slice(start, min(start + rows, n_rows))


def _row_partials(x, local_target, owned):
    """(max, sum exp(x - max), sum exp(x - max) x, target logit or 0) of each row of ``x``."""
    m = x.max(dim=-1).values
    e = torch.exp(x - m[:, None])
    weighted = torch.where(e > 0, e * x, 0.0).sum(-1)  # 0 * -inf is 0 here, not NaN
    picked = x.gather(-1, local_target.clamp(0, x.shape[-1] - 1)[:, None])[:, 0]
    return m, e.sum(-1), weighted, torch.where(owned, picked, 0.0)


def _merge(local_max, partial, group):
    """(log-sum-exp, target logit, entropy) per token from every process's partials."""
    global_max = local_max
    if group is not None:
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        rescale = torch.where(torch.isfinite(local_max), torch.exp(local_max - global_max), 0.0)
        partial[:2] *= rescale  # a shard of -inf logits adds nothing
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    total, weighted, target_logit = partial
    lse = global_max + torch.log(total)
    return lse, target_logit, lse - weighted / total


def _row_grads(x, lse, entropy, grad_logp, grad_entropy, local_target, owned):
    """d loss / d x for rows ``x`` (this process's columns): ``g_logp (onehot - p) - g_H p (log p + H)``."""
    log_p = x - lse[:, None]
    p = torch.exp(log_p)
    grad = -p * grad_logp[:, None] - grad_entropy[:, None] * torch.where(p > 0, p * (log_p + entropy[:, None]), 0.0)
    rows = owned.nonzero()[:, 0]
    grad[rows, local_target[rows]] += grad_logp[rows]
    return grad


def _incoming(grad, like):
    return torch.zeros_like(like) if grad is None else grad.to(like.dtype)


class ChunkedLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per token from logits ``(n, columns)``, this process's share of the vocabulary."""

    @staticmethod
    def forward(ctx, logits, target_ids, shard: VocabShard, inv_temperature: float):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        n, columns = logits.shape
        local_max = torch.empty(n, dtype=dtype, device=logits.device)
        partial = torch.empty(3, n, dtype=dtype, device=logits.device)  # s, w, target logit at local_max
        local_target = target_ids - shard.start
        owned = (local_target >= 0) & (local_target < columns)
        for rows in _chunks(n, columns):
            x = logits[rows].to(dtype) * inv_temperature
            local_max[rows], partial[0, rows], partial[1, rows], partial[2, rows] = _row_partials(
                x, local_target[rows], owned[rows])
        lse, target_logit, entropy = _merge(local_max, partial, shard.group)
        ctx.save_for_backward(logits, local_target, owned, lse, entropy)
        ctx.inv_temperature = inv_temperature
        return target_logit - lse, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("the chunked policy loss (vocab_parallel_group / cu_seqlens)")
        logits, local_target, owned, lse, entropy = ctx.saved_tensors
        grad_logp, grad_entropy = _incoming(grad_logp, lse), _incoming(grad_entropy, lse)
        grad_logits = torch.empty_like(logits)
        for rows in _chunks(*logits.shape):
            x = logits[rows].to(lse.dtype) * ctx.inv_temperature
            grad = _row_grads(x, lse[rows], entropy[rows], grad_logp[rows], grad_entropy[rows], local_target[rows],
                              owned[rows])
            grad_logits[rows] = (grad * ctx.inv_temperature).to(logits.dtype)
        return grad_logits, None, None, None


@dataclass(frozen=True)
class Projection:
    """``x = softcap * tanh(logit_scale * y / softcap)`` (or ``logit_scale * y``) ``/ temperature``, with
    ``y = hidden @ weight^T + bias`` from operands rounded to ``operand`` and accumulated in fp32 (rounded
    once to ``operand`` when it is a low-precision dtype and there is no softcap, as the model's lm_head
    hands its logits over)."""

    logit_scale: float
    softcap: float | None
    inv_temperature: float
    operand: torch.dtype

    def logits(self, hidden, weight, bias):
        dtype = torch.float64 if self.operand == torch.float64 else torch.float32
        y = hidden.to(self.operand).to(dtype) @ weight.to(self.operand).to(dtype).t()
        if bias is not None:
            y = y + bias.to(self.operand).to(dtype)
        if self.softcap is None:
            return y.to(self.operand).to(dtype) * (self.logit_scale * self.inv_temperature), None
        t = torch.tanh(y * (self.logit_scale / self.softcap))
        return t * (self.softcap * self.inv_temperature), t

    def chain_rule(self, grad_x, t):
        """d loss / d y from d loss / d x."""
        if self.softcap is None:
            return grad_x * (self.logit_scale * self.inv_temperature)
        return grad_x * ((1.0 - t * t) * (self.logit_scale * self.inv_temperature))


class ChunkedLinearLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per token from hidden ``(n, H)`` and this process's rows of the lm_head
    weight ``(columns, H)``; the logits exist one chunk of rows at a time, recomputed in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, shard: VocabShard, projection: Projection):
        n, columns = hidden.shape[0], weight.shape[0]
        dtype = torch.float64 if projection.operand == torch.float64 else torch.float32
        local_max = torch.empty(n, dtype=dtype, device=hidden.device)
        partial = torch.empty(3, n, dtype=dtype, device=hidden.device)
        local_target = target_ids - shard.start
        owned = (local_target >= 0) & (local_target < columns)
        for rows in _chunks(n, columns):
            x, _ = projection.logits(hidden[rows], weight, bias)
            local_max[rows], partial[0, rows], partial[1, rows], partial[2, rows] = _row_partials(
                x, local_target[rows], owned[rows])
        lse, target_logit, entropy = _merge(local_max, partial, shard.group)
        ctx.save_for_backward(hidden, weight, bias, local_target, owned, lse, entropy)
        ctx.shard, ctx.projection = shard, projection
        return target_logit - lse, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("the chunked policy loss (vocab_parallel_group / cu_seqlens)")
        hidden, weight, bias, local_target, owned, lse, entropy = ctx.saved_tensors
        projection = ctx.projection
        grad_logp, grad_entropy = _incoming(grad_logp, lse), _incoming(grad_entropy, lse)
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device) if wants_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if wants_weight else None
        grad_bias = torch.zeros(weight.shape[:1], dtype=lse.dtype, device=weight.device) if wants_bias else None
        operand_weight = weight.to(projection.operand).to(lse.dtype)
        for rows in _chunks(hidden.shape[0], weight.shape[0]):
            x, t = projection.logits(hidden[rows], weight, bias)
            grad = projection.chain_rule(_row_grads(x, lse[rows], entropy[rows], grad_logp[rows], grad_entropy[rows],
                                                    local_target[rows], owned[rows]), t)
            if grad_hidden is not None:
                grad_hidden[rows] = grad @ operand_weight
            if grad_weight is not None:
                grad_weight += grad.t() @ hidden[rows].to(projection.operand).to(lse.dtype)
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        if grad_hidden is not None and ctx.shard.group is not None:
            # the hidden state feeds every process's columns: its gradient is the sum of theirs
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.shard.group)
        grads = (grad_hidden, grad_weight, grad_bias)
        return (*(None if g is None else g.to(t.dtype) for g, t in zip(grads, (hidden, weight, weight))),
                None, None, None)


def vocab_shard(group, columns: int, n_tokens: int, device, check: bool) -> VocabShard:
    """This process's share for equal shares in rank order (``group`` None: the whole vocabulary).
    With ``check`` (immediate validation) the processes' token and column counts are compared (one
    small all-reduce and a host read), so mismatched groups fail loudly."""
    if group is None:
        return VocabShard(None, 0, columns, columns)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("vocab_parallel_group needs torch.distributed initialised (init_process_group)")
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError, AttributeError, TypeError) as error:
        raise ValueError(f"vocab_parallel_group is not a process group this process belongs to: {error}") from None
    if rank < 0:
        raise ValueError("vocab_parallel_group is not a process group this process belongs to")
    if check:
        sizes = torch.tensor([columns, -columns, n_tokens, -n_tokens], dtype=torch.float64, device=device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
        most_columns, fewest_columns, most_tokens, fewest_tokens = sizes.tolist()
        if most_columns != -fewest_columns:
            raise ValueError(f"vocab_parallel_group: every process must hold an equal share of the vocabulary "
                             f"(in rank order); the shares here range from {int(-fewest_columns)} to "
                             f"{int(most_columns)} columns")
        if most_tokens != -fewest_tokens:
            raise ValueError(f"vocab_parallel_group: every process must hold the same tokens (a tensor-parallel "
                             f"group); the token counts range from {int(-fewest_tokens)} to {int(most_tokens)}")
    return VocabShard(group, rank * columns, columns, world * columns)


@dataclass(frozen=True)
class TokenLayout:
    """Where the packed or padded tokens of one call lie: the token shape the caller passed, the grid
    the objective runs on, and the packed layout (None: the tokens are the grid's, as passed)."""

    token_shape: torch.Size
    packed: PackedLayout | None

    @classmethod
    def build(cls, token_shape, device, cu_seqlens, max_seqlen) -> "TokenLayout":
        if cu_seqlens is None:
            if max_seqlen is not None:
                raise ValueError("max_seqlen goes with cu_seqlens (packed sequences)")
            return cls(torch.Size(token_shape), None)
        if len(token_shape) != 1:
            raise ValueError(f"packed tokens (cu_seqlens) are (total_tokens, V) logits or (total_tokens, H) hidden "
                             f"states, got token shape {tuple(token_shape)}")
        return cls(torch.Size(token_shape), PackedLayout.build(cu_seqlens, token_shape[0], device, max_seqlen))


def objective_loss(per_token_fn, token_layout: TokenLayout, vocab: int, dtype, device, loss_batch: LossBatch,
                   options: LossOptions, check: bool) -> PolicyLossOutput:
    """The reference's objective on per-token values ``per_token_fn(target_ids (n,)) -> (logp, entropy)``
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
    logp, entropy = per_token_fn(targets)
    if packed is not None:
        logp, entropy = packed.pad(logp, 0.0), packed.pad(entropy, 0.0)
    logp = torch.where(batch.mask, logp.reshape(grid), 0.0)
    entropy = torch.where(batch.mask, entropy.reshape(grid), 0.0)
    terms = policy_objective(logp, entropy, batch, options)
    metrics = policy_metrics(terms.log_ratio, terms.tokens.psi, terms.tokens.region, entropy, terms.kl, batch.mask)
    loss = terms.loss
    if not check:  # deferred validation: a target id outside the vocabulary makes the loss NaN, never quietly wrong
        outside = batch.mask & ((batch.target_ids < 0) | (batch.target_ids >= vocab))
        loss = torch.where(outside.any(), float("nan"), loss)

    def per_token_output(values):  # fp32 (fp64 for fp64 inputs), as the fused ops give them
        values = values.detach().to(per_token_dtype(dtype))
        return batch.unflatten(values) if packed is None else packed.unpad(values)

    return PolicyLossOutput(loss, per_token_output(logp), per_token_output(entropy), metrics)


def _refuse(options: LossOptions):
    if options.inplace:
        raise ValueError("inplace=True is not supported with vocab_parallel_group or cu_seqlens")
    if torch.compiler.is_compiling():
        raise ValueError("vocab_parallel_group and cu_seqlens are not supported under torch.compile yet")


def chunked_loss_from_options(logits, loss_batch: LossBatch, options: LossOptions,
                              call_layout: CallLayout) -> PolicyLossOutput:
    """``fused_dgpo_loss`` with ``vocab_parallel_group`` and/or ``cu_seqlens``."""
    if not torch.is_tensor(logits) or logits.dim() not in (2, 3):
        raise ValueError("logits must be a tensor of shape (B, T, V) or (N, V) (V / P columns with vocab_parallel_group)")
    _refuse(options)
    check = resolve_mode(options.validation, logits.device) == "immediate"
    layout = TokenLayout.build(logits.shape[:-1], logits.device, call_layout.cu_seqlens, call_layout.max_seqlen)
    shard = vocab_shard(call_layout.vocab_parallel_group, logits.shape[-1], logits.shape[:-1].numel(), logits.device,
                        check)
    flat_logits = logits.reshape(-1, logits.shape[-1])

    def per_token(targets):
        return ChunkedLogProbEntropy.apply(flat_logits, targets, shard, 1.0 / options.temperature)

    return objective_loss(per_token, layout, shard.vocab, logits.dtype, logits.device, loss_batch, options, check)


def chunked_linear_loss_from_options(hidden, weight, bias, loss_batch: LossBatch, options: LossOptions,
                                     logit_scale: float, softcap: float | None, operand: torch.dtype,
                                     call_layout: CallLayout) -> PolicyLossOutput:
    """``fused_linear_dgpo_loss`` with ``vocab_parallel_group`` (``weight`` and ``bias``: this process's
    rows) and/or ``cu_seqlens``; ``hidden`` is ``(B, T, H)`` or ``(N, H)``, the same on every process."""
    _refuse(options)
    check = resolve_mode(options.validation, hidden.device) == "immediate"
    token_shape = hidden.shape[:-1]
    layout = TokenLayout.build(token_shape, hidden.device, call_layout.cu_seqlens, call_layout.max_seqlen)
    shard = vocab_shard(call_layout.vocab_parallel_group, weight.shape[0], token_shape.numel(), hidden.device, check)
    projection = Projection(float(logit_scale), softcap, 1.0 / options.temperature, operand)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    logits_dtype = torch.float64 if operand == torch.float64 else operand

    def per_token(targets):
        return ChunkedLinearLogProbEntropy.apply(flat_hidden, weight, bias, targets, shard, projection)

    return objective_loss(per_token, layout, shard.vocab, logits_dtype, hidden.device, loss_batch, options, check)
