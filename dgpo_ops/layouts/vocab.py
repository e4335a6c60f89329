"""Per-token log-probs and entropies by chunks of rows in torch, over a vocabulary that may be split
across a process group (tensor parallelism: Megatron's column-parallel lm_head, verl's Megatron
workers).

Every process holds the same tokens and an equal share of the vocabulary, in rank order: ``V / P``
columns of the logits, or ``V / P`` rows of the lm_head weight and bias. Per token, each process
reduces its columns to three numbers in one pass (the local max ``m``, ``s = sum exp(x - m)``,
``w = sum exp(x - m) x``, and the target's logit where it lies in its columns); one all-reduce (MAX,
4 bytes per token) of the maxima and one (SUM, 12 bytes) of ``[s, w, target]`` rescaled to the
global max give the log-sum-exp, the target's log-prob and the entropy ``lse - w / s`` as one process
over the whole vocabulary would. Neither logits nor weights cross processes. The backward of the
logits needs no communication: ``g_logp (onehot - p) - g_H p (log p + H)`` needs only the global
``lse`` and ``H``. From hidden states, the hidden state's gradient is a sum over the vocabulary, so
each process's part is all-reduced (``N x H`` values, as Megatron's column-parallel layer does in its
backward). Without a group the same code is the whole vocabulary on one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dgpo_ops.core.validation import refuse_double_backward

CHUNK_BYTES = 64 * 2**20  # fp32 temporaries of one chunk of rows


@dataclass(frozen=True)
class VocabShard:
    """This process's columns ``[start, start + size)`` of a ``vocab``-wide vocabulary; ``group`` is
    None when the vocabulary is whole."""

    group: object
    start: int
    size: int
    vocab: int


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


def _chunks(n_rows: int, columns: int):
    rows = max(1, CHUNK_BYTES // (4 * max(columns, 1)))
    for start in range(0, n_rows, rows):
        yield slice(start, min(start + rows, n_rows))


def _row_blocks(logits: torch.Tensor):
    """``(flat rows, 2-D view)`` of chunks of the rows of ``(N, V)`` or ``(B, T, V)`` logits, read where
    they are: strided logits (``logits[:, :-1]``) are walked per response, never copied whole."""
    columns = logits.shape[-1]
    try:
        flat = logits.view(-1, columns)
    except RuntimeError:  # not viewable as (N, V): one response at a time
        flat = None
    if flat is not None:
        for rows in _chunks(flat.shape[0], columns):
            yield rows, flat[rows]
        return
    seq_len = logits.shape[1]
    for b in range(logits.shape[0]):
        for rows in _chunks(seq_len, columns):
            yield slice(b * seq_len + rows.start, b * seq_len + rows.stop), logits[b, rows]


def _row_partials(x, local_target, owned):
    """(max, sum exp(x - max), sum exp(x - max) x, target logit or 0) of each row of ``x``. A row of -inf
    (a shard whose columns are all masked) gives (-inf, 0, 0, 0), which adds nothing when merged."""
    m = x.max(dim=-1).values
    e = torch.exp(x - torch.where(torch.isfinite(m), m, 0.0)[:, None])
    weighted = torch.where(e > 0, e * x, 0.0).sum(-1)  # 0 * -inf is 0 here, not NaN
    picked = x.gather(-1, local_target.clamp(0, x.shape[-1] - 1)[:, None])[:, 0]
    return m, e.sum(-1), weighted, torch.where(owned, picked, 0.0)


def _merge(local_max, partial, group):
    """(log-sum-exp, target logit, entropy) per token from every process's partials."""
    global_max = local_max
    if group is not None:
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        partial[:2] *= torch.where(torch.isfinite(local_max), torch.exp(local_max - global_max), 0.0)
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    total, weighted, target_logit = partial
    lse = global_max + torch.log(total)
    return lse, target_logit, lse - weighted / total


def _row_grads(x, lse, entropy, grad_logp, grad_entropy, local_target, owned):
    """d loss / d x for rows ``x`` (this process's columns): ``g_logp (onehot - p) - g_H p (log p + H)``."""
    log_p = x - lse[:, None]
    p = torch.exp(log_p)
    grad = -p * grad_logp[:, None] - grad_entropy[:, None] * torch.where(p > 0, p * (log_p + entropy[:, None]), 0.0)
    # the one-hot term where the target is one of these columns (no host read of which rows those are)
    grad.scatter_add_(1, local_target.clamp(0, x.shape[-1] - 1)[:, None],
                      torch.where(owned, grad_logp, 0.0)[:, None])
    return grad


def _grad_or_zeros(grad, like):
    return torch.zeros_like(like) if grad is None else grad.to(like.dtype)


def _local_targets(target_ids, shard: VocabShard, columns: int):
    local_target = target_ids - shard.start
    return local_target, (local_target >= 0) & (local_target < columns)


def _scored_rows(values, scored, rows):
    """``values`` (rows ``rows`` of the tokens) with the rows of tokens not scored read as 0: whatever a
    padded position holds (NaN, inf) reaches neither a value nor a gradient."""
    return values if scored is None else torch.where(scored[rows, None], values, 0.0)


class ChunkedLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per token from logits ``(N, columns)`` or ``(B, T, columns)``, this
    process's share of the vocabulary; ``target_ids`` flat ``(n_tokens,)``; ``scored`` (or None: all) the
    tokens whose logits are read."""

    @staticmethod
    def forward(ctx, logits, target_ids, shard: VocabShard, inv_temperature: float, scored=None):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        n, columns = target_ids.shape[0], logits.shape[-1]
        local_max = torch.empty(n, dtype=dtype, device=logits.device)
        partial = torch.empty(3, n, dtype=dtype, device=logits.device)  # s, w, target logit at local_max
        local_target, owned = _local_targets(target_ids, shard, columns)
        for rows, block in _row_blocks(logits):
            x = _scored_rows(block.to(dtype), scored, rows) * inv_temperature
            local_max[rows], partial[0, rows], partial[1, rows], partial[2, rows] = _row_partials(
                x, local_target[rows], owned[rows])
        lse, target_logit, entropy = _merge(local_max, partial, shard.group)
        ctx.save_for_backward(logits, local_target, owned, lse, entropy, scored)
        ctx.inv_temperature = inv_temperature
        return target_logit - lse, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("the chunked policy loss (vocab_parallel_group / cu_seqlens)")
        logits, local_target, owned, lse, entropy, scored = ctx.saved_tensors
        grad_logp, grad_entropy = _grad_or_zeros(grad_logp, lse), _grad_or_zeros(grad_entropy, lse)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # dense
        flat_grad = grad_logits.view(-1, logits.shape[-1])
        for rows, block in _row_blocks(logits):
            x = _scored_rows(block.to(lse.dtype), scored, rows) * ctx.inv_temperature
            grad = _row_grads(x, lse[rows], entropy[rows], grad_logp[rows], grad_entropy[rows], local_target[rows],
                              owned[rows])
            flat_grad[rows] = _scored_rows(grad, scored, rows) * ctx.inv_temperature
        return grad_logits, None, None, None, None


@dataclass(frozen=True)
class Projection:
    """``x = softcap * tanh(logit_scale * y / softcap)`` (or ``logit_scale * y``) ``/ temperature``, with
    ``y = hidden @ weight^T + bias`` from operands rounded to ``operand`` and accumulated in fp32 (rounded
    once to ``operand`` when there is no softcap, as the model's lm_head hands its logits over)."""

    logit_scale: float
    softcap: float | None
    inv_temperature: float
    operand: torch.dtype

    @property
    def accumulate(self) -> torch.dtype:
        return torch.float64 if self.operand == torch.float64 else torch.float32

    def rounded(self, tensor):
        """``tensor`` rounded to the operand dtype, held in the accumulation dtype."""
        return tensor.to(self.operand).to(self.accumulate)

    def logits(self, hidden, operand_weight, operand_bias):
        """(x, tanh term for the chain rule or None), fp32 (fp64); ``operand_weight`` and ``operand_bias``
        are ``rounded`` once per pass by the caller, not once per chunk."""
        y = self.rounded(hidden) @ operand_weight.t()
        if operand_bias is not None:
            y = y + operand_bias
        if self.softcap is None:
            return self.rounded(y) * (self.logit_scale * self.inv_temperature), None
        t = torch.tanh(y * (self.logit_scale / self.softcap))
        return t * (self.softcap * self.inv_temperature), t

    def chain_rule(self, grad_x, t):
        """d loss / d y from d loss / d x."""
        if self.softcap is None:
            return grad_x * (self.logit_scale * self.inv_temperature)
        return grad_x * ((1.0 - t * t) * (self.logit_scale * self.inv_temperature))


def _rounded_or_none(projection: Projection, tensor):
    return None if tensor is None else projection.rounded(tensor)


class ChunkedLinearLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per token from hidden ``(n, H)`` and this process's rows of the lm_head
    weight ``(columns, H)``; the logits exist one chunk of rows at a time, recomputed in backward.
    The dtypes are the ``Projection``'s: autocast is off inside, as on the tile path."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, shard: VocabShard, projection: Projection, scored=None):
        n, columns = hidden.shape[0], weight.shape[0]
        dtype = projection.accumulate
        local_max = torch.empty(n, dtype=dtype, device=hidden.device)
        partial = torch.empty(3, n, dtype=dtype, device=hidden.device)
        local_target, owned = _local_targets(target_ids, shard, columns)
        with torch.autocast(hidden.device.type, enabled=False):
            operand_weight, operand_bias = projection.rounded(weight), _rounded_or_none(projection, bias)
            for rows in _chunks(n, columns):
                x, _ = projection.logits(_scored_rows(hidden[rows], scored, rows), operand_weight, operand_bias)
                local_max[rows], partial[0, rows], partial[1, rows], partial[2, rows] = _row_partials(
                    x, local_target[rows], owned[rows])
        lse, target_logit, entropy = _merge(local_max, partial, shard.group)
        ctx.save_for_backward(hidden, weight, bias, local_target, owned, lse, entropy, scored)
        ctx.shard, ctx.projection = shard, projection
        return target_logit - lse, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("the chunked policy loss (vocab_parallel_group / cu_seqlens)")
        hidden, weight, bias, local_target, owned, lse, entropy, scored = ctx.saved_tensors
        projection = ctx.projection
        grad_logp, grad_entropy = _grad_or_zeros(grad_logp, lse), _grad_or_zeros(grad_entropy, lse)
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        zeros = dict(dtype=lse.dtype, device=hidden.device)
        grad_hidden = torch.zeros(hidden.shape, **zeros) if wants_hidden else None
        grad_weight = torch.zeros(weight.shape, **zeros) if wants_weight else None
        grad_bias = torch.zeros(weight.shape[:1], **zeros) if wants_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            operand_weight, operand_bias = projection.rounded(weight), _rounded_or_none(projection, bias)
            for rows in _chunks(hidden.shape[0], weight.shape[0]):
                hidden_rows = _scored_rows(hidden[rows], scored, rows)
                x, t = projection.logits(hidden_rows, operand_weight, operand_bias)
                grad = _scored_rows(projection.chain_rule(_row_grads(
                    x, lse[rows], entropy[rows], grad_logp[rows], grad_entropy[rows], local_target[rows], owned[rows]),
                    t), scored, rows)
                if grad_hidden is not None:
                    grad_hidden[rows] = grad @ operand_weight
                if grad_weight is not None:
                    grad_weight += grad.t() @ projection.rounded(hidden_rows)
                if grad_bias is not None:
                    grad_bias += grad.sum(0)
        if grad_hidden is not None and ctx.shard.group is not None:
            # the hidden state feeds every process's columns: its gradient is the sum of theirs
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.shard.group)
        grads = (grad_hidden, grad_weight, grad_bias)
        return (*(None if g is None else g.to(t.dtype) for g, t in zip(grads, (hidden, weight, bias))),
                None, None, None, None)


def check_unsharded(tensor: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """``tensor`` as the products can use it. A replicated DTensor is its local (whole) value; a
    sharded one is refused: from the tensor alone, ``Shard(0)`` may be FSDP's storage sharding over
    processes with different tokens (the weight must act whole and FSDP must reduce its gradient:
    pass the head module instead) or a tensor-parallel vocabulary split (each process keeps its rows),
    and a wrong guess computes a wrong gradient without an error."""
    if tensor is None or not _is_dtensor(tensor):
        if tensor is not None and getattr(tensor, "ds_id", None) is not None and tensor.numel() == 0:
            raise ValueError(f"{name} is a DeepSpeed ZeRO-3 parameter partitioned to 0 elements outside its "
                             "module's forward: pass the lm_head module instead of its weight "
                             f"(fused_linear_dgpo_loss(hidden, model.lm_head, ...)), which runs the op inside "
                             "the module's forward where ZeRO-3 gathers it")
        return tensor
    from torch.distributed.tensor import Replicate

    if all(isinstance(p, Replicate) for p in tensor.placements):
        return tensor.full_tensor()  # no communication: every process holds it whole
    raise ValueError(
        f"{name} is a DTensor placed as {tuple(tensor.placements)} on {tensor.device_mesh}: the op does not "
        "guess what the sharding means. For FSDP2 (processes holding different tokens, the weight acting "
        "whole) pass the lm_head module instead of its weight: fused_linear_dgpo_loss(hidden, model.lm_head, "
        "...) runs the op as the module's forward, so FSDP2 gathers the weight and reduces its gradient. "
        "For a vocabulary split across tensor-parallel processes (each keeping its rows) pass "
        "vocab_parallel_group=<that mesh dimension's process group>.")


def local_vocab_shard(tensor: torch.Tensor | None, name: str, group) -> torch.Tensor | None:
    """This process's rows of an lm_head ``weight`` / ``bias`` split by vocabulary over ``group``
    (``vocab_parallel_group``): a plain tensor is taken as the local shard (Megatron's column-parallel
    lm_head, verl's process-group convention); a DTensor must be ``Shard(0)`` over exactly that group,
    and its local shard is used (its gradient comes back as a ``Shard(0)`` DTensor)."""
    if tensor is None or not _is_dtensor(tensor):
        return tensor
    from torch.distributed.tensor import Replicate, Shard

    mesh = tensor.device_mesh
    shard_dims = [dim for dim, placement in enumerate(tensor.placements) if isinstance(placement, Shard)]
    if (len(shard_dims) != 1 or tensor.placements[shard_dims[0]] != Shard(0)
            or not all(isinstance(p, Replicate) for i, p in enumerate(tensor.placements) if i != shard_dims[0])):
        raise ValueError(f"{name} is a DTensor placed as {tuple(tensor.placements)}: with vocab_parallel_group it "
                         "must be split by vocabulary rows (Shard(0)) over that group, and replicated otherwise")
    if mesh.get_group(shard_dims[0]) is not group and not _same_ranks(mesh.get_group(shard_dims[0]), group):
        raise ValueError(f"{name} is sharded over mesh dimension {shard_dims[0]} of {mesh}, which is not "
                         "vocab_parallel_group: pass that mesh dimension's group (mesh.get_group(dim))")
    if tensor.shape[0] % mesh.size(shard_dims[0]):
        raise ValueError(f"{name}: the vocabulary ({tensor.shape[0]}) must split into equal shares over the "
                         f"{mesh.size(shard_dims[0])} processes of vocab_parallel_group")
    return tensor.to_local()


def _same_ranks(group_a, group_b) -> bool:
    import torch.distributed as dist

    try:
        return dist.get_process_group_ranks(group_a) == dist.get_process_group_ranks(group_b)
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return False


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(tensor, DTensor)
