"""``linear_logprob_entropy``: per-token log-probs and entropies from hidden states and the lm_head
weight, with a backward for both outputs, for a loss the package does not compute itself (verl's policy
losses, entropy bonus and KL term sit on top of its fused log-prob kernel: ``dgpo_ops.integrations.verl``).

The logits are never whole. Forward: one sweep of ``chunk x V`` logits tiles through the row forward
kernel (log-sum-exp, log-prob, entropy; no method epilogue). Backward: a second sweep recomputes each
tile, the backward row kernel writes ``d loss / d logits = g (onehot - p) - h p (log p + H)`` from the
incoming per-token gradients ``g`` of the log-probs and ``h`` of the entropies, and the tile is multiplied
into the gradients of hidden, weight and bias (fp32 accumulators): four GEMM passes, as verl's own kernel.
The tiles, their precision under autocast and the GEMMs are ``fused_linear_dgpo_loss``'s.

A vocabulary split across a process group (``vocab_parallel_group``) runs the same sweeps on this process's
rows of the weight, its row partials merged over the group (``dgpo_ops.layouts.vocab``: 16 bytes per token
cross the group) and the hidden state's gradient summed over it. Tokens whose target is ``-100`` get
log-prob and entropy 0 and no gradient; under deferred validation, a call with bad input gives NaN
log-probs and entropies, and its error is raised later, naming the argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.core.call import CallSignature, PublicFunction
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.validation import defer, refuse_double_backward
from dgpo_ops.kernels.interface import Plane
from dgpo_ops.kernels.row_io import RowWorkspace, compute_dtype
from dgpo_ops.layouts.rows import CallLayout
from dgpo_ops.layouts.vocab import check_unsharded, local_vocab_shard
from dgpo_ops.ops.linear import (
    Precision,
    TileGradients,
    TileProjection,
    Tiles,
    autocast_dtype,
    flatten_tokens,
    linear_plan,
    pipelined,
    sweep_tiles,
)
from dgpo_ops.ops.pipeline import nan_rows_on_error, row_forward, run_prologue


class LinearLogProbEntropyFunction(torch.autograd.Function):
    """``(log p(target), entropy)`` of every token of ``hidden`` ``(n, H)``; ``plan`` is a ``CallPlan`` of
    flat ``(n, V)`` logits (its method is not evaluated: only the row kernels and the prologue's checks run)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, plan):
        ctx.set_materialize_grads(False)
        precision = Precision.resolve(weight, None, autocast_dtype(hidden.device))
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are ours to choose
            projection = TileProjection(weight, bias, precision, plan.options.memory_budget)
            tiles = Tiles(max(n_tokens, 1), vocab, precision, hidden.device, plan.options, pipelined(projection))
            workspace = RowWorkspace.allocate((n_tokens,), 1, hidden.device, compute_dtype(precision.tile))
            run_prologue(plan, workspace)
            forward = row_forward(plan, workspace, with_epilogue=False)  # the method is not this op's
            sweep_tiles(hidden, projection, tiles,
                        lambda start, stop, slot: forward(slot.logits[: stop - start], tiles.kernel_scale, start))
            plan.rows.merge(workspace)
        if plan.deferred:
            nan_rows_on_error(workspace)
            defer(workspace.status, plan.vocab, plan.normalizer_tensor, "linear_logprob_entropy")
        ctx.save_for_backward(hidden, weight, bias)
        ctx.workspace, ctx.plan, ctx.precision = workspace, plan, precision
        return workspace.per_token[Plane.LOGP].clone(), workspace.per_token[Plane.ENTROPY].clone()

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("linear_logprob_entropy")
        hidden, weight, bias = ctx.saved_tensors
        wants = ctx.needs_input_grad[:3]
        if (grad_logp is None and grad_entropy is None) or not any(wants):
            return None, None, None, None
        workspace, plan, precision = ctx.workspace, ctx.plan, ctx.precision
        dtype = workspace.per_token.dtype
        # No gradient for the entropies (verl without an entropy bonus): the kernel leaves the entropy term out.
        dloss_dlogp = torch.zeros(hidden.shape[0], dtype=dtype, device=hidden.device) if grad_logp is None \
            else grad_logp.detach().reshape(-1).to(dtype).contiguous()
        dloss_dentropy = None if grad_entropy is None else grad_entropy.detach().reshape(-1).to(dtype).contiguous()
        grads = [torch.empty(t.shape, dtype=precision.accumulate, device=t.device) if wanted else None
                 for t, wanted in zip((hidden, weight, bias), wants)]  # the first tile writes them
        with torch.autocast(hidden.device.type, enabled=False):
            projection = TileProjection(weight, bias, precision, plan.options.memory_budget)
            tiles = Tiles(max(hidden.shape[0], 1), weight.shape[0], precision, hidden.device, plan.options,
                          pipelined(projection))
            gradients = TileGradients(plan, tiles, projection, workspace, hidden, *grads)
            sweep_tiles(hidden, projection, tiles, lambda start, stop, slot: gradients.rows(
                start, stop, slot, 0.0, dloss_dlogp=dloss_dlogp, dloss_dentropy=dloss_dentropy), gradients.products)
            gradients.finish()
            plan.rows.reduce_hidden_grad(grads[0])
        return (*(None if g is None else g.to(t.dtype) for g, t in zip(grads, (hidden, weight, bias))), None)


def _check_targets(hidden, target_ids):
    if not torch.is_tensor(target_ids) or target_ids.shape != hidden.shape[:-1]:
        shape = tuple(target_ids.shape) if torch.is_tensor(target_ids) else type(target_ids).__name__
        raise ValueError(f"target_ids must have shape {tuple(hidden.shape[:-1])} (hidden's tokens), got {shape}")


LOGPROB_ENTROPY_CALL = CallSignature(source=("hidden", "weight"), keyword_source=("bias",), positional=("target_ids",),
                                     inputs=(), options=("temperature", "vocab_parallel_group", "memory_budget",
                                                         "backend", "validation"), method=False, default_method="grpo")


def _logprob_entropy(source, inputs: LossInputs, options: LossOptions) -> tuple[torch.Tensor, torch.Tensor]:
    # The options check temperature, backend and validation as every loss call does; the method is unused.
    hidden, weight, bias = source
    target_ids, group = inputs.target_ids, options.vocab_parallel_group
    if group is not None:
        weight, bias = (local_vocab_shard(t, name, group) for t, name in ((weight, "weight"), (bias, "bias")))
    else:
        weight, bias = check_unsharded(weight, "weight"), check_unsharded(bias, "bias")
    flat_hidden, _ = flatten_tokens(hidden, weight, bias)  # shapes, dtypes and devices of hidden, weight, bias
    _check_targets(hidden, target_ids)
    flat_targets = target_ids.reshape(-1)
    logits_shape = torch.Size((flat_targets.shape[0], weight.shape[0]))
    advantages = torch.zeros(flat_targets.shape, device=hidden.device)
    plan = linear_plan(logits_shape, weight, LossInputs(flat_targets, advantages), options, needs_grad=False,
                       layout=CallLayout(group))
    logp, entropy = LinearLogProbEntropyFunction.apply(flat_hidden, weight, bias, plan)
    return logp.reshape(target_ids.shape), entropy.reshape(target_ids.shape)


# The module's public function: what it takes, its docstring's summary and what each call runs. Its definition
# below is written from here (and the call object's fields) by `python docs/generate.py`.
PUBLIC_FUNCTIONS = {"linear_logprob_entropy": PublicFunction(LOGPROB_ENTROPY_CALL, """Per-token
``(log p(target), entropy)`` of the logits ``(hidden @ weight.T + bias) / temperature``, fp32 (fp64 for fp64
inputs), shaped like ``target_ids``, differentiable in both outputs (for hidden, weight and bias). Under
``torch.autocast`` the products run in the autocast dtype, as the model's own lm_head would. With
``vocab_parallel_group`` ``weight`` and ``bias`` are this process's rows (equal shares in rank order) and ``hidden``
and ``target_ids`` are the same on every process.""", _logprob_entropy,
    returns="``(logps, entropy)``, two differentiable tensors shaped like ``target_ids``.",
    return_annotation="tuple[torch.Tensor, torch.Tensor]")}

# public-functions:start
# Written by `python docs/generate.py` from PUBLIC_FUNCTIONS and the fields of LossInputs and
# LossOptions: what an IDE, a type checker and grep see. Each call runs the function that
# PublicFunction.define makes (the call's split, then its body), whose signature and docstring
# are these.


@PUBLIC_FUNCTIONS["linear_logprob_entropy"].define
def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor | torch.nn.Module,
    target_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_parallel_group: object = None,
    memory_budget: int = 536870912,
    backend: str = "auto",
    validation: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(log p(target), entropy)`` of the logits ``(hidden @ weight.T + bias) / temperature``, fp32
    (fp64 for fp64 inputs), shaped like ``target_ids``, differentiable in both outputs (for hidden, weight and
    bias). Under ``torch.autocast`` the products run in the autocast dtype, as the model's own lm_head would.
    With ``vocab_parallel_group`` ``weight`` and ``bias`` are this process's rows (equal shares in rank order)
    and ``hidden`` and ``target_ids`` are the same on every process.

    Arguments:
    * ``hidden``: hidden states ``(B, T, H)`` or ``(N, H)`` entering the lm_head.
    * ``weight``: the lm_head weight ``(V, H)``, or the lm_head module itself (``model.lm_head``; needed when
      an engine shards it, FSDP2 or DeepSpeed ZeRO-3: the op then runs as the module's forward, so the engine
      gathers the weight and reduces its gradient; its bias is used unless ``bias`` is given). A sharded
      DTensor weight is refused: pass the module.
    * ``target_ids``: sampled token ids ``(B, T)`` / ``(N,)``, int64 or int32; -100 marks positions not
      scored.
    * ``bias``: the lm_head bias ``(V,)``, or None.
    * ``temperature``: the logits are divided by it before the log-softmax.
    * ``vocab_parallel_group``: a process group over which the vocabulary is split (tensor parallelism): every
      process passes the same tokens and its equal share of the vocabulary, in rank order (``V / P`` logits
      columns, or ``V / P`` rows of the lm_head weight and bias); the loss, log-probs, entropies and metrics
      are the whole vocabulary's, the gradient this process's share's (the hidden state's is summed over the
      group). 16 bytes per token cross processes, never logits or weights: the row kernels' per-row partials,
      merged by one all-reduce (``dgpo_ops/layouts/vocab.py``); None: not split.
    * ``memory_budget``: bytes of logits and gradient tiles alive at once (the token chunk follows from it).
    * ``backend``: ``auto`` (Triton on CUDA, the kernels' torch twins on CPU), ``triton`` (on CPU tensors only
      under ``TRITON_INTERPRET=1``) or ``torch``.
    * ``validation``: ``auto`` (immediate on CPU, deferred on CUDA), ``immediate`` or ``deferred``: deferred
      checks never synchronise; a bad value makes the loss NaN and raises at a later call or at
      ``dgpo_ops.raise_deferred_errors()``.

    Returns ``(logps, entropy)``, two differentiable tensors shaped like ``target_ids``.
    """
# public-functions:end

# What tools read is the definition above; the module binds its public name on first access instead
# (__getattr__ below says why), so it is unbound here at run time only.
_linear_logprob_entropy = linear_logprob_entropy
if not TYPE_CHECKING:
    del linear_logprob_entropy


def __getattr__(name: str):
    """``linear_logprob_entropy``, made on first access (PEP 562). It is not traced by torch.compile yet: it
    runs eagerly inside a compiled region (a graph break; with fullgraph=True, dynamo's error says so; verl
    does not compile the model's forward). ``torch.compiler.disable`` imports ``torch._dynamo``, 1.2 s that
    an import of dgpo_ops which never touches this function does not pay."""
    if name != "linear_logprob_entropy":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    function = globals()[name] = torch.compiler.disable(_linear_logprob_entropy)
    return function
