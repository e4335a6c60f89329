"""The public functions, and ``policy_loss``, the one place that routes a call:

* under ``torch.compile``: one ``torch.library`` custom op per call (``dgpo_ops.ops.compiled``);
* a vocabulary split across processes or packed sequences: the same eager ops, on the rows those layouts
  describe (``dgpo_ops.layouts``);
* the lm_head module instead of its weight: the op runs as the module's own forward, so a sharding
  engine gathers the weight and reduces its gradient (``dgpo_ops.distributed.head``);
* otherwise the eager op (``dgpo_ops.ops.logits``, ``dgpo_ops.ops.linear``);
* per-token log-probs a framework computed: the torch objective on them (``dgpo_ops.ops.from_logps``);
* ``reference=True``: the plain-PyTorch ground truth (``dgpo_ops.ops.reference``).

Before any of them, the rollout-correction stage (``dgpo_ops.corrections.stage``) turns ``rollout_logps`` into
rollout weights and a mask, so every route runs one copy of it.
"""

from __future__ import annotations

import inspect

import torch

from dgpo_ops.core.call import OPTION_FIELDS, PROJECTION_OPTIONS, CallSignature, public_function
from dgpo_ops.core.docstrings import documented
from dgpo_ops.core.inputs import LossInputs, check_generator, refuse_flat_source
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.core.validation import per_token_function, resolve_mode
from dgpo_ops.corrections.stage import with_rollout_correction
from dgpo_ops.distributed.head import head_forward
from dgpo_ops.layouts.rows import CallLayout
from dgpo_ops.layouts.vocab import check_unsharded, local_vocab_shard
from dgpo_ops.ops.compiled import compiled_fused_linear_loss, compiled_fused_loss
from dgpo_ops.ops.from_logps import check_logps, logps_loss
from dgpo_ops.ops.linear import flatten_tokens, linear_loss
from dgpo_ops.ops.logits import logits_loss
from dgpo_ops.ops.reference import reference_route


def refuse_under_compile(layout: CallLayout, batch: LossInputs) -> None:
    if not layout.is_default:  # the custom ops take no process group and no packed layout yet
        raise ValueError("vocab_parallel_group and cu_seqlens are not supported under torch.compile yet")
    if batch.entropy_weights is not None:  # nor entropy weights
        raise ValueError("entropy_weights are not supported under torch.compile yet")
    check_generator(batch.generator, batch.target_ids.device if torch.is_tensor(batch.target_ids) else "cpu")


def validates_now(options: LossOptions, device) -> bool:
    """The call's values are checked on the host now (immediate validation), so the rollout-correction stage may
    read its weights too."""
    return resolve_mode(options.validation, device) == "immediate"


# How policy_loss is called, for the errors of a call that is not.
POLICY_LOSS_CALL = ("policy_loss(inputs, options, *, logits=... | hidden=..., weight=... | logps=...): "
                    "inputs a LossInputs(target_ids, advantages, ...), "
                    "options a LossOptions.build(method_name, **options)")
DICT_HINTS = {"inputs": " (a dict of tensors: LossInputs(**that_dict))",
              "options": " (a dict of options: LossOptions.build(**that_dict))"}


def check_call_objects(inputs, options, sources: tuple) -> None:
    """``TypeError`` naming what ``policy_loss`` was handed in place of its two objects, or a source passed by
    position; where the call is right, two ``isinstance`` checks."""
    if sources:
        raise TypeError(f"policy_loss takes its source by keyword, got {2 + len(sources)} positional "
                        f"arguments: {POLICY_LOSS_CALL}")
    if isinstance(inputs, LossInputs) and isinstance(options, LossOptions):
        return
    if isinstance(inputs, LossOptions) and isinstance(options, LossInputs):
        raise TypeError(f"policy_loss got options then inputs: pass the LossInputs first. {POLICY_LOSS_CALL}")
    for name, value, cls in (("inputs", inputs, LossInputs), ("options", options, LossOptions)):
        if not isinstance(value, cls):
            hint = DICT_HINTS[name] if isinstance(value, dict) else ""
            got = f"{type(value).__name__}{hint}"
            raise TypeError(f"policy_loss's {name} must be a {cls.__name__}, got {got}. {POLICY_LOSS_CALL}")


def policy_loss(inputs: LossInputs, options: LossOptions, *sources, logits=None, hidden=None, weight=None,
                bias=None, logps=None, token_scales=None, complete_batch=None,
                reference=False) -> PolicyLossOutput:
    """The one entry of every loss call: the policy loss of ``inputs`` under ``options``, from one source:
    ``logits``; ``hidden`` states and the lm_head ``weight`` (a tensor or the module) and ``bias``; or ``logps``,
    the sampled tokens' log-probs ``(B, T)`` that a framework computed (``inputs.target_ids`` None; the gradient
    flows into them; ``dgpo_ops.ops.from_logps``). The public functions, ``DGPOLoss``, ``DGPOTrainer`` and the
    verl and SkyRL plugins call it; build the two objects directly (``LossInputs(target_ids, advantages, ...)``,
    ``LossOptions.build("grpo", eps_high=0.28)``) to call it yourself. ``token_scales`` (from ``logps`` only):
    per-token scales ``s_t`` of ``loss = sum_t s_t L_t`` in place of the aggregation, a framework's own
    normalisation. ``complete_batch`` (from hidden states, eager): ``dgpo_ops.ops.linear.CompleteBatch``, inputs
    made from the call's own first sweep of log-probs and entropies. ``reference`` (from ``logits``): the loss
    by ``log_softmax``, gather and autograd, the ground truth the fused ops are tested against
    (``reference_loss``; ``dgpo_ops.ops.reference``); it checks the values on the host (in a custom op under
    ``torch.compile``) whatever ``validation`` says, and reads no ``backend`` or ``inplace``."""
    check_call_objects(inputs, options, sources)
    layout = CallLayout(options.vocab_parallel_group, inputs.cu_seqlens, inputs.max_seqlen)
    if (logits is not None) + (hidden is not None or weight is not None) + (logps is not None) != 1:
        raise ValueError("policy_loss takes one source: logits, hidden and weight (the lm_head), or logps")
    if token_scales is not None and logps is None:
        raise ValueError("token_scales apply to the loss from log-probs (logps=...); the other sources take the "
                         "aggregation and loss_normalizer")
    if complete_batch is not None and hidden is None:
        raise ValueError("complete_batch applies to the loss from hidden states")
    if reference and (logits is None or options.vocab_parallel_group is not None):
        raise ValueError("reference=True is the loss from whole logits (logits=..., no vocab_parallel_group)")
    if hidden is None and any(getattr(options, name) != LossOptions.__dataclass_fields__[name].default
                              for name in PROJECTION_OPTIONS):
        raise ValueError(f"{', '.join(PROJECTION_OPTIONS)} apply to the loss from hidden states")
    if logps is not None:
        inputs = inputs._replace(target_ids=check_logps(logps, inputs, options))
    device = inputs.target_ids.device if torch.is_tensor(inputs.target_ids) else torch.device("cpu")
    immediate = reference or validates_now(options, device)
    if logits is not None:
        if not torch.is_tensor(logits):
            raise ValueError(f"logits must be a tensor, got {type(logits).__name__}")
        if reference:
            route = lambda batch: reference_route(logits, batch, options)  # noqa: E731
        else:
            route = lambda batch: _logits_route(logits, batch, options, layout)  # noqa: E731
    elif logps is not None:
        route = lambda batch: logps_loss(logps, batch, options, token_scales, immediate)  # noqa: E731
    else:
        route = lambda batch: _linear_route(hidden, weight, bias, batch, options, layout, complete_batch)  # noqa: E731
    return with_rollout_correction(inputs, options.rollout_correction, layout.cu_seqlens, route, immediate)


def _logits_route(logits, batch: LossInputs, options: LossOptions, layout: CallLayout) -> PolicyLossOutput:
    if torch.compiler.is_compiling():
        refuse_under_compile(layout, batch)
        return compiled_fused_loss(logits, batch, options)
    return logits_loss(logits, batch, options, layout)


def _linear_route(hidden, weight, bias, batch: LossInputs, options: LossOptions, layout: CallLayout,
                  complete_batch) -> PolicyLossOutput:
    if torch.is_tensor(hidden):  # named before the target ids its shape would ask for
        refuse_flat_source("hidden", hidden.shape, batch.target_ids, axis="H")
    if isinstance(weight, torch.nn.Module):  # the lm_head module: the op runs as its forward
        def as_head_forward(head_hidden, head_weight, head_bias):
            return _linear_route(head_hidden, head_weight, head_bias if bias is None else bias,
                                 batch, options, layout, complete_batch).tensors()

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
        return compiled_fused_linear_loss(flat_hidden, weight, bias, batch, options)
    return linear_loss(hidden, weight, bias, batch, options, layout, complete_batch)


FROM_HIDDEN_STATES = {name: "it applies to the loss from hidden states (fused_linear_dgpo_loss)"
                      for name in PROJECTION_OPTIONS}
LOGITS_CALL = CallSignature(source=("logits",), without=PROJECTION_OPTIONS, refusals=FROM_HIDDEN_STATES)
LINEAR_CALL = CallSignature(source=("hidden", "weight"), keyword_source=("bias",), without=("inplace",), refusals={
    "inplace": "inplace applies to fused_dgpo_loss; the linear op never holds whole logits"})

fused_dgpo_loss = public_function("fused_dgpo_loss", """Fused policy loss of ``method`` from logits: the sampled
token's log-prob by an online log-sum-exp, the entropy in the same pass and d(loss)/d(logits) in one more, never a
vocabulary-sized softmax. Same numbers as ``reference_loss``.""", LOGITS_CALL,
    lambda source, inputs, options: policy_loss(inputs, options, logits=source[0]))

REFERENCE_CALL = CallSignature(source=("logits",), without=(*PROJECTION_OPTIONS, "inplace", "backend",
                                                             "validation", "vocab_parallel_group"))

reference_loss = public_function("reference_loss", """Policy loss of ``method`` from logits by
``log_softmax``, gather, the method table and autograd: the ground truth of the fused ops. It materialises
``(N, V)`` fp32 log-probs; not a path to train with.""", REFERENCE_CALL,
    lambda source, inputs, options: policy_loss(inputs, options, logits=source[0], reference=True))

fused_linear_dgpo_loss = public_function("fused_linear_dgpo_loss", """Policy loss of ``method`` from hidden states
and the lm_head, as ``fused_dgpo_loss(softcap(logit_scale (hidden @ weight.T + bias)))`` without materialising the
logits: token chunks of logits tiles within ``memory_budget``. Under ``torch.autocast`` the products run in the
autocast dtype, as the model's own lm_head would. Tied embeddings need nothing special.""", LINEAR_CALL,
    lambda source, inputs, options: policy_loss(inputs, options, hidden=source[0], weight=source[1],
                                                bias=source[2]))

LOGPROBS_CALL = CallSignature(source=("hidden", "weight"), keyword_source=("bias",), positional=("target_ids", "mask"),
                              inputs=("cu_seqlens", "max_seqlen"),
                              options=("temperature", *PROJECTION_OPTIONS, "backend", "validation",
                                       "vocab_parallel_group"), method=False, default_method="grpo")


def _logprobs(source, inputs: LossInputs, options: LossOptions) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, weight, bias = source
    inputs = inputs._replace(advantages=torch.zeros(inputs.target_ids.shape, device=hidden.device))
    # the op's deferred errors name this function, and its per-token values are NaN on bad input
    with torch.no_grad(), per_token_function("fused_linear_logprobs"):
        out = policy_loss(inputs, options, hidden=hidden, weight=weight, bias=bias)
    return out.logps, out.entropy


fused_linear_logprobs = public_function("fused_linear_logprobs", """Forward only (old-policy and reference
log-probs): per-token log-probs and entropies, fp32, shaped like ``target_ids``, 0 on masked tokens. One GEMM pass,
no gradient work.""", LOGPROBS_CALL, _logprobs, returns="``(logps, entropy)``, two tensors shaped like ``target_ids``.")

DGPOLOSS_OPTIONS = CallSignature(positional=(), inputs=(), without=PROJECTION_OPTIONS, refusals=FROM_HIDDEN_STATES)
DGPOLOSS_INPUTS = CallSignature(source=("logits",), options=(), method=False, refusals={
    name: "an option of the module: DGPOLoss(method, ...) takes it" for name in OPTION_FIELDS})


class DGPOLoss(torch.nn.Module):
    """``fused_dgpo_loss`` with its options held in a module: ``DGPOLoss("dgpo", n=2)(logits, target_ids,
    advantages, ...)``. The constructor takes ``fused_dgpo_loss``'s options (a tensor-parallel module its
    ``vocab_parallel_group``), the forward its tensors (packed batches ``cu_seqlens`` per call)."""

    def __init__(self, method="dgpo", **options):
        super().__init__()
        _, _, self.options = DGPOLOSS_OPTIONS.split("DGPOLoss", (), {"method": method, **options})

    def forward(self, *args, **kwargs) -> PolicyLossOutput:
        (logits,), inputs, options = DGPOLOSS_INPUTS.split("DGPOLoss.forward", args, kwargs, self.options)
        return policy_loss(inputs, options, logits=logits)

    def extra_repr(self) -> str:
        return repr(self.options)


# Both signatures and docstrings come from the call object's fields, as every public function's do.
_SELF = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
# the method by position too: DGPOLoss("dgpo")
_METHOD, *_OPTIONS = DGPOLOSS_OPTIONS.signature.parameters.values()
DGPOLoss.__init__.__signature__ = inspect.Signature(
    [_SELF, _METHOD.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD), *_OPTIONS])
DGPOLoss.forward.__signature__ = inspect.Signature([_SELF, *DGPOLOSS_INPUTS.signature.parameters.values()])
documented("The method and options the module's every call runs with: ``fused_dgpo_loss``'s, held once.",
           returns="")(DGPOLoss.__init__)
documented("The policy loss of one batch of logits, under the module's method and options.")(DGPOLoss.forward)
