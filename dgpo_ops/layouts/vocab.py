"""A vocabulary split across a process group (tensor parallelism: Megatron's column-parallel lm_head, verl's
Megatron workers), on the same row kernels as one process.

Every process holds the same tokens and an equal share of the vocabulary, in rank order: ``V / P`` columns
of the logits, or ``V / P`` rows of the lm_head weight and bias. The row forward writes each row's
partials over this process's columns (``kernels/logprob_entropy.py``, ``WRITES_PARTIALS``): the max
``m``, ``S = sum exp(x - m)``, ``U = sum exp(x - m) (x - m)`` (centred on ``m``) and the target logit
where this process holds the target. ``merge_row_partials`` merges them over the group with one
all-reduce MAX of the maxima (4 bytes per token) and one all-reduce SUM of ``[S, U, target logit]``
re-centred on the global max (12 bytes per token): 16 bytes per token cross the group, and neither
logits nor weights do. Before it, the processes agree on their column and token counts on the host
(``agreed_sizes``), so that the merge never all-reduces tensors of different sizes. It leaves the planes
the single-process row forward writes (max, ``log S``, log-prob, entropy ``log S - U / S``), so
everything after it (the objective, the metrics, the deferred checks, the gradient kernel with its
``expm1`` form) is the single-process code. The logits'
gradient needs no communication; from hidden states each process's part of the hidden-state gradient
is all-reduced (``N x H`` values, as Megatron's column-parallel layer does in its backward).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dgpo_ops.kernels.interface import InputError, Plane


@dataclass(frozen=True)
class VocabShard:
    """This process's columns ``[start, start + size)`` of a ``vocab``-wide vocabulary over ``group``.
    ``agreed``: the processes' column and token counts agree (known on every process's host alike); where they do
    not, nothing is all-reduced over the group for this call (tensors of different sizes would abort gloo and hang
    or mix rows in NCCL). ``errors``: an int64 device scalar, ``InputError.VOCAB_SHARES`` where they do not agree
    under deferred validation (the loss is NaN and the error is raised later), else None."""

    group: object
    start: int
    size: int
    vocab: int
    agreed: bool = True
    errors: torch.Tensor | None = None

    @property
    def split(self) -> tuple[int, int]:
        """``(vocab_start, vocab_total)`` as the row forward takes them."""
        return self.start, self.vocab


def vocab_shard(group, columns: int, n_tokens: int, device, check: bool) -> VocabShard:
    """This process's share for equal shares in rank order. The processes' column and token counts are
    compared on the host (``agreed_sizes``): with ``check`` (immediate validation) a disagreement raises
    ``ValueError``; without, it becomes ``errors`` on the device (the loss is NaN on every process and the
    deferred error names the argument) and the call all-reduces nothing."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("vocab_parallel_group needs torch.distributed initialised (init_process_group)")
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError, AttributeError, TypeError) as error:
        raise ValueError(f"vocab_parallel_group is not a process group this process belongs to: {error}") from None
    if rank < 0:
        raise ValueError("vocab_parallel_group is not a process group this process belongs to")
    most_columns, fewest_columns, most_tokens, fewest_tokens = agreed_sizes(group, columns, n_tokens)
    agreed = most_columns == fewest_columns and most_tokens == fewest_tokens
    if check and most_columns != fewest_columns:
        raise ValueError(f"vocab_parallel_group: every process must hold an equal share of the vocabulary "
                         f"(in rank order); the shares here range from {fewest_columns} to {most_columns} columns")
    if check and most_tokens != fewest_tokens:
        raise ValueError(f"vocab_parallel_group: every process must hold the same tokens (a tensor-parallel "
                         f"group); the token counts range from {fewest_tokens} to {most_tokens}")
    # a fill on the device, not a copy from the host (which would wait for the stream)
    errors = None if agreed else torch.full((), int(InputError.VOCAB_SHARES), dtype=torch.int64, device=device)
    return VocabShard(group, rank * columns, columns, world * columns, agreed, errors)


def agreed_sizes(group, columns: int, n_tokens: int) -> tuple[int, int, int, int]:
    """``(most columns, fewest columns, most tokens, fewest tokens)`` over ``group``'s processes, on the host.

    The counts are shapes, host metadata, and every process must know whether they agree before the merge's
    all-reduce, whose sizes they set. So they are all-reduced as a CPU tensor (over ``host_group``): that waits
    for the other processes' hosts to reach this call, which run the same steps, and never for the device. An
    all-reduce on the device read back on the host would wait for every kernel queued before it (a host sync on
    the hot path), and one left on the device cannot stop the merge from running with mismatched sizes."""
    sizes = torch.tensor([columns, -columns, n_tokens, -n_tokens], dtype=torch.int64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=host_group(group))
    most_columns, fewest_columns, most_tokens, fewest_tokens = sizes.tolist()
    return most_columns, -fewest_columns, most_tokens, -fewest_tokens


# A gloo group over the ranks of each group that takes no CPU tensors (NCCL's), made on first use
HOST_GROUPS: dict = {}


def takes_cpu_tensors(group) -> bool:
    """Whether ``group``'s backends include one for CPU tensors (gloo, or a ``"cpu:gloo,cuda:nccl"`` group)."""
    config = dist.get_backend_config(group)
    return any(part.split(":")[0] == "cpu" if ":" in part else part == "gloo" for part in config.split(","))


def host_group(group):
    """The group that all-reduces host tensors among ``group``'s processes: ``group`` itself where it takes CPU
    tensors; else a gloo group over its ranks, made once, by its own processes alone (the first call of the op,
    which every one of them makes)."""
    if takes_cpu_tensors(group):
        return group
    if group not in HOST_GROUPS:
        HOST_GROUPS[group] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                            use_local_synchronization=True)
    return HOST_GROUPS[group]


def merge_row_partials(planes: torch.Tensor, target_index: torch.Tensor, group) -> None:
    """Merge every process's row partials (``planes``: ``(NUM_PLANES, n)``, as the row forward wrote them
    with ``WRITES_PARTIALS``) into the planes of the whole vocabulary, in place: ROW_MAX the global max,
    LOG_NORM ``log S``, LOGP ``(x_target - max) - log S``, ENTROPY ``log S - U / S``, 0 on tokens not
    scored (``target_index`` -1), as ``finish_row`` writes them on one process."""
    local_max, sum_exp, sum_exp_dx = planes[Plane.ROW_MAX], planes[Plane.LOG_NORM], planes[Plane.ENTROPY]
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    shift = torch.where(global_max == float("-inf"), 0.0, global_max)
    # Re-centre on the global max: sum e^(x - M) = e^(m - M) S and sum e^(x - M) (x - M) = e^(m - M) (U + (m - M) S);
    # a process whose columns are all -inf on a row (S = 0) adds nothing (not -inf * 0).
    holds_mass = sum_exp > 0
    rescale = torch.where(holds_mass, torch.exp(local_max - shift), 0.0)
    partial = torch.stack([sum_exp * rescale,
                           torch.where(holds_mass, rescale * (sum_exp_dx + (local_max - shift) * sum_exp), 0.0),
                           planes[Plane.LOGP]])
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    total, centred, target_logit = partial
    scored = target_index >= 0
    log_norm = torch.log(torch.where(scored, total, 1.0))
    planes[Plane.ROW_MAX] = torch.where(scored, shift, 0.0)
    planes[Plane.LOG_NORM] = torch.where(scored, log_norm, 0.0)
    planes[Plane.LOGP] = torch.where(scored, (target_logit - shift) - log_norm, 0.0)
    planes[Plane.ENTROPY] = torch.where(scored, log_norm - centred / torch.where(scored, total, 1.0), 0.0)


# Set while the fused-linear op runs as the lm_head module's own forward (``dgpo_ops.distributed.head``): a
# weight that is still a shard there is one the head's own hooks do not gather (``check_unsharded`` says what
# to do instead).
IN_HEAD_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("dgpo_ops_in_head_forward", default=False)
FUSED_LINEAR_ON_MODEL = "dgpo_ops.distributed.head.fused_linear_on_model"


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
    if IN_HEAD_FORWARD.get():
        raise ValueError(
            f"the lm_head's {name} is a DTensor placed as {tuple(tensor.placements)} on {tensor.device_mesh} even "
            "inside the head module's forward: no FSDP2 unit of the head's own gathers it there. The unit that "
            "holds it is an enclosing module's (e.g. the root, wrapped with reshard_after_forward=True, or a "
            "model whose forward has not run), which gathers it only during its own forward. Run the op inside "
            f"the model's forward instead: {FUSED_LINEAR_ON_MODEL}(model, input_ids, attention_mask, "
            "logits_to_keep, loss_fn), after dgpo_ops.distributed.head.add_hidden_state_output(model) "
            "(DGPOTrainer's route). For a vocabulary split across tensor-parallel processes pass "
            "vocab_parallel_group=<that mesh dimension's process group>.")
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
