"""Running the fused-linear op as the lm_head module's own forward, so that a sharding engine
(FSDP2 in any wrapping, DeepSpeed ZeRO-3) hands it the whole weight and reduces its gradient.

The fused-linear op replaces ``lm_head(hidden)``: the head module's forward never runs, so neither do
the hooks an engine registers on it. FSDP2 all-gathers a unit's parameters in its forward pre-hook and
reduce-scatters their gradients from hooks placed on that forward's inputs and outputs; ZeRO-3 does
the same per module. A weight taken from a head whose hooks did not run is a shard (FSDP2: a
``Shard(0)`` DTensor; ZeRO-3: an empty tensor), and a gradient computed from it by hand
(``full_tensor()``) stays on one process: silently wrong. ``head_forward`` calls the head module
itself with its ``forward`` redirected to the op (TRL's forward redirection), so every hook of every
engine runs exactly as for ``lm_head(hidden)``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def head_forward(head: nn.Module, fn: Callable[..., Any], hidden: torch.Tensor, *args) -> Any:
    """``fn(hidden, head.weight, head.bias, *args)``, run as ``head``'s forward (``head(hidden)``
    with its forward redirected), so the engine that shards ``head`` has its parameters whole when
    ``fn`` reads them and reduces their gradients as it does for the head's own forward.

    ``fn`` must return tensors in a tuple (FSDP2 and DeepSpeed find the outputs that need their
    backward hooks by walking tuples); ``hidden`` reaches it as the engine passed it on (cast by an
    FSDP2 ``MixedPrecisionPolicy``, as the head's own input would be)."""
    if not isinstance(head, nn.Module):
        raise ValueError(f"head must be the lm_head nn.Module, got {type(head).__name__}")
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"head ({type(head).__name__}) has no weight tensor: pass the lm_head module (an nn.Linear "
                         "or the tied nn.Embedding), whose weight is (V, H)")
    had_own_forward = "forward" in head.__dict__
    own_forward = head.__dict__.get("forward")

    def redirected(engine_hidden, *engine_args):
        restore()  # anything inside fn that calls the head gets its own forward
        return fn(engine_hidden, head.weight, getattr(head, "bias", None), *engine_args)

    def restore():
        if had_own_forward:
            head.forward = own_forward
        elif "forward" in head.__dict__:
            del head.forward

    head.forward = redirected
    try:
        return head(hidden, *args)
    finally:
        restore()


def add_hidden_state_output(model) -> None:
    """Let ``model(..., dgpo_head_fn=fn)`` return ``fn(hidden, lm_head)``, ``hidden`` the backbone's last
    hidden state (a transformers causal LM: ``base_model`` and ``get_output_embeddings``). The forward
    is patched on the instance, like TRL's fused head, so the fused-linear op runs inside the model's
    forward as DDP, FSDP2 or DeepSpeed wrapped it, and ``fn`` runs it as the lm_head's own forward
    (``head_forward``): every engine gathers the head's weight and reduces its gradient as for
    ``lm_head(hidden)``."""
    previous_forward = model.forward

    def forward(self, *args, dgpo_head_fn=None, **kwargs):
        if dgpo_head_fn is None:
            return previous_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        return dgpo_head_fn(self.base_model(*args, **kwargs).last_hidden_state, self.get_output_embeddings())

    model.forward = types.MethodType(forward, model)


def fused_linear_on_model(model, input_ids, attention_mask, logits_to_keep, loss_fn):
    """``loss_fn(hidden, weight, bias)`` on the completion positions' hidden states, run as the
    lm_head's forward inside ``model``'s (wrapped) forward; returns what ``loss_fn`` returns (a tuple
    of tensors). ``model`` has had ``add_hidden_state_output``."""
    def on_hidden(hidden, head):
        return head_forward(head, loss_fn, hidden[:, -logits_to_keep - 1 : -1])

    return model(input_ids=input_ids, attention_mask=attention_mask, dgpo_head_fn=on_hidden)


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
