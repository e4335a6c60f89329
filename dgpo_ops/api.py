"""The public functions, and the one place that routes a call:

* under ``torch.compile``: one ``torch.library`` custom op per call (``dgpo_ops.ops.compiled``);
* a vocabulary split across processes or packed sequences: the same eager ops, on the rows those layouts
  describe (``dgpo_ops.layouts``);
* the lm_head module instead of its weight: the op runs as the module's own forward, so a sharding
  engine gathers the weight and reduces its gradient (``dgpo_ops.distributed.head``);
* otherwise the eager op (``dgpo_ops.ops.logits``, ``dgpo_ops.ops.linear``).

Before any of them, the rollout-correction stage (``dgpo_ops.corrections.stage``) turns ``rollout_logps`` into
rollout weights and a mask, so every route runs one copy of it.
"""

from __future__ import annotations

import torch

from dgpo_ops.core.docstrings import documented
from dgpo_ops.core.inputs import LossBatch, check_generator
from dgpo_ops.core.options import LossOptions, trace_constant
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.core.validation import per_token_function, resolve_mode
from dgpo_ops.corrections.stage import with_rollout_correction
from dgpo_ops.distributed.head import head_forward
from dgpo_ops.layouts.rows import CallLayout
from dgpo_ops.layouts.vocab import check_unsharded, local_vocab_shard
from dgpo_ops.ops.compiled import compiled_fused_linear_loss, compiled_fused_loss
from dgpo_ops.ops.linear import DEFAULT_MEMORY_BUDGET, ProjectionOptions, flatten_tokens, linear_loss
from dgpo_ops.ops.logits import logits_loss


def refuse_under_compile(layout: CallLayout, batch: LossBatch) -> None:
    if not layout.is_default:  # the custom ops take no process group and no packed layout yet
        raise ValueError("vocab_parallel_group and cu_seqlens are not supported under torch.compile yet")
    if batch.entropy_weights is not None:  # nor entropy weights
        raise ValueError("entropy_weights are not supported under torch.compile yet")
    check_generator(batch.generator, batch.target_ids.device if torch.is_tensor(batch.target_ids) else "cpu")


def validates_now(options: LossOptions, batch: LossBatch) -> bool:
    """The call's values are checked on the host now (immediate validation), so the rollout-correction stage may
    read its weights too."""
    device = batch.target_ids.device if torch.is_tensor(batch.target_ids) else torch.device("cpu")
    return resolve_mode(options.validation, device) == "immediate"


def loss_from_options(logits, batch: LossBatch, options: LossOptions, layout: CallLayout = CallLayout()
                      ) -> PolicyLossOutput:
    """``fused_dgpo_loss`` once its options are built."""
    if not torch.is_tensor(logits):
        raise ValueError(f"logits must be a tensor, got {type(logits).__name__}")
    return with_rollout_correction(batch, options.rollout_correction, layout.cu_seqlens,
                                   lambda batch: _logits_route(logits, batch, options, layout),
                                   validates_now(options, batch))


def _logits_route(logits, batch: LossBatch, options: LossOptions, layout: CallLayout) -> PolicyLossOutput:
    if torch.compiler.is_compiling():
        refuse_under_compile(layout, batch)
        return compiled_fused_loss(logits, batch, options)
    return logits_loss(logits, batch, options, layout)


def linear_loss_from_options(hidden, weight, bias, batch: LossBatch, options: LossOptions,
                             projection_options: ProjectionOptions, layout: CallLayout = CallLayout(),
                             complete_batch=None) -> PolicyLossOutput:
    """``fused_linear_dgpo_loss`` once its options are built; ``complete_batch``: ``dgpo_ops.ops.linear.CompleteBatch``
    (eager only)."""
    return with_rollout_correction(batch, options.rollout_correction, layout.cu_seqlens, lambda batch: _linear_route(
        hidden, weight, bias, batch, options, projection_options, layout, complete_batch), validates_now(options, batch))


def _linear_route(hidden, weight, bias, batch: LossBatch, options: LossOptions, projection_options: ProjectionOptions,
                  layout: CallLayout, complete_batch) -> PolicyLossOutput:
    if isinstance(weight, torch.nn.Module):  # the lm_head module: the op runs as its forward
        def as_head_forward(head_hidden, head_weight, head_bias):
            return _linear_route(head_hidden, head_weight, head_bias if bias is None else bias,
                                 batch, options, projection_options, layout, complete_batch).tensors()

        return PolicyLossOutput.from_tensors(head_forward(weight, as_head_forward, hidden))
    if layout.vocab_parallel_group is not None:
        weight, bias = (local_vocab_shard(t, name, layout.vocab_parallel_group)
                        for t, name in ((weight, "weight"), (bias, "bias")))
    else:
        weight, bias = check_unsharded(weight, "weight"), check_unsharded(bias, "bias")
    if torch.compiler.is_compiling():
        refuse_under_compile(layout, batch)
        if complete_batch is not None:
            raise ValueError("complete_batch is not supported under torch.compile yet")
        flat_hidden, _ = flatten_tokens(hidden, weight, bias)
        if options.inplace:
            raise ValueError("inplace applies to fused_dgpo_loss; the linear op never holds whole logits")
        return compiled_fused_linear_loss(flat_hidden, weight, bias, batch, options, projection_options)
    return linear_loss(hidden, weight, bias, batch, options, projection_options, layout, complete_batch)


@documented("""Fused policy loss of ``method`` from logits: the sampled token's log-prob by an online
log-sum-exp, the entropy in the same pass and d(loss)/d(logits) in one more, never a vocabulary-sized
softmax. Same numbers as ``reference_loss``.""")
def fused_dgpo_loss(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    *,
    method="dgpo",
    temperature: float = 1.0,
    aggregation: str | None = None,
    loss_normalizer: float | torch.Tensor | None = None,
    beta: float = 0.0,
    entropy_coef: float = 0.0,
    importance_sampling_level: str = "token",
    rollout_weights: torch.Tensor | None = None,
    rollout_logps: torch.Tensor | None = None,
    rollout_correction=None,
    scores: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    entropy_weights: torch.Tensor | None = None,
    inplace: bool = False,
    backend: str = "auto",
    validation: str = "auto",
    vocab_parallel_group=None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    **method_params,
) -> PolicyLossOutput:
    options = LossOptions.build(
        method, temperature=temperature, aggregation=aggregation, beta=beta, entropy_coef=entropy_coef,
        importance_sampling_level=importance_sampling_level, inplace=inplace, backend=backend,
        validation=validation, rollout_correction=rollout_correction, **method_params,
    )
    batch = LossBatch(target_ids, advantages, mask, old_logps, ref_logps, rollout_weights, loss_normalizer, generator,
                      rollout_logps, scores, entropy_weights)
    return loss_from_options(logits, batch, options, CallLayout(vocab_parallel_group, cu_seqlens, max_seqlen))


class DGPOLoss(torch.nn.Module):
    """``fused_dgpo_loss`` with its options held in a module: ``DGPOLoss("dgpo", n=2)(logits, ...)``.
    A tensor-parallel module holds its ``vocab_parallel_group``; packed batches pass ``cu_seqlens`` per call."""

    def __init__(self, method="dgpo", vocab_parallel_group=None, **options):
        super().__init__()
        self.options = LossOptions.build(method, **options)
        self.vocab_parallel_group = vocab_parallel_group

    def forward(self, logits, target_ids, advantages, mask=None, old_logps=None, ref_logps=None, *,
                loss_normalizer=None, rollout_weights=None, rollout_logps=None, cu_seqlens=None, max_seqlen=None,
                generator=None, scores=None, entropy_weights=None) -> PolicyLossOutput:
        batch = LossBatch(target_ids, advantages, mask, old_logps, ref_logps, rollout_weights, loss_normalizer,
                          generator, rollout_logps, scores, entropy_weights)
        return loss_from_options(logits, batch, self.options,
                                 CallLayout(self.vocab_parallel_group, cu_seqlens, max_seqlen))

    def extra_repr(self) -> str:
        return repr(self.options)


@documented("""Policy loss of ``method`` from hidden states and the lm_head, as
``fused_dgpo_loss(softcap(logit_scale (hidden @ weight.T + bias)))`` without materialising the logits: token
chunks of logits tiles within ``memory_budget``. Under ``torch.autocast`` the products run in the autocast dtype,
as the model's own lm_head would. Tied embeddings need nothing special.""")
def fused_linear_dgpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor | torch.nn.Module,
    target_ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    method="dgpo",
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    aggregation: str | None = None,
    loss_normalizer: float | torch.Tensor | None = None,
    beta: float = 0.0,
    entropy_coef: float = 0.0,
    importance_sampling_level: str = "token",
    rollout_weights: torch.Tensor | None = None,
    rollout_logps: torch.Tensor | None = None,
    rollout_correction=None,
    scores: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    entropy_weights: torch.Tensor | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    logits_on_chip: bool = False,
    backend: str = "auto",
    validation: str = "auto",
    vocab_parallel_group=None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    **method_params,
) -> PolicyLossOutput:
    options = LossOptions.build(
        method, temperature=temperature, aggregation=aggregation, beta=beta, entropy_coef=entropy_coef,
        importance_sampling_level=importance_sampling_level, backend=backend, validation=validation,
        rollout_correction=rollout_correction, **method_params,
    )
    if torch.compiler.is_compiling():  # a trace-time constant, as the loss options (options.trace_constant)
        logit_scale, softcap = trace_constant(logit_scale), trace_constant(softcap)
    projection_options = ProjectionOptions(logit_scale=logit_scale, softcap=softcap, memory_budget=memory_budget,
                                           logits_on_chip=logits_on_chip)
    batch = LossBatch(target_ids, advantages, mask, old_logps, ref_logps, rollout_weights, loss_normalizer, generator,
                      rollout_logps, scores, entropy_weights)
    return linear_loss_from_options(hidden, weight, bias, batch, options, projection_options,
                                    CallLayout(vocab_parallel_group, cu_seqlens, max_seqlen))


@torch.no_grad()
def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor | torch.nn.Module,
    target_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    logits_on_chip: bool = False,
    backend: str = "auto",
    validation: str = "auto",
    vocab_parallel_group=None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only (old-policy and reference log-probs): per-token log-probs and entropies, fp32,
    shaped like ``target_ids``, 0 on masked tokens. One GEMM pass, no gradient work."""
    advantages = torch.zeros(target_ids.shape, device=hidden.device)
    # the op's deferred errors name this function, and its per-token values are NaN on bad input
    with per_token_function("fused_linear_logprobs"):
        out = fused_linear_dgpo_loss(hidden, weight, target_ids, advantages, mask, bias=bias, method="grpo",
                                     temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                                     memory_budget=memory_budget, logits_on_chip=logits_on_chip, backend=backend,
                                     validation=validation, vocab_parallel_group=vocab_parallel_group,
                                     cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    return out.logps, out.entropy
