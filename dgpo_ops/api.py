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

import dataclasses
import inspect
from typing import Any

import torch

from dgpo_ops.core.call import OPTION_FIELDS, PROJECTION_OPTIONS, CallSignature, PublicFunction
from dgpo_ops.core.docstrings import documented
from dgpo_ops.core.inputs import LossInputs, check_generator, refuse_flat_source
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.core.validation import MESSAGES, defer_errors, per_token_function, resolve_mode
from dgpo_ops.corrections.core import RolloutCorrection
from dgpo_ops.corrections.stage import apply_rollout_correction
from dgpo_ops.kernels.interface import InputError
from dgpo_ops.distributed.head import head_forward
from dgpo_ops.layouts.rows import CallLayout
from dgpo_ops.layouts.vocab import check_unsharded, local_vocab_shard
from dgpo_ops.methods.base import MethodConfig
from dgpo_ops.methods.table import METHODS
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
DEFAULT_LAYOUT = CallLayout()  # one process's whole vocabulary, the tokens as passed: most calls'
PROJECTION_DEFAULTS = tuple((name, LossOptions.__dataclass_fields__[name].default) for name in PROJECTION_OPTIONS)
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
    if options.vocab_parallel_group is None and inputs.cu_seqlens is None and inputs.max_seqlen is None:
        layout = DEFAULT_LAYOUT
    else:
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
    if hidden is None and any(getattr(options, name) != default for name, default in PROJECTION_DEFAULTS):
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


def with_rollout_correction(batch, correction, cu_seqlens, route, immediate: bool = True):
    """``route(batch)`` (a loss route, returning a ``PolicyLossOutput``) on the batch the correction stage makes,
    with the stage's metrics beside the route's: what every public loss function runs (``immediate``: the call's
    validation reads values on the host now). ``rollout_logps`` the stage refuses raise now where the call
    validates now; otherwise the loss, and so the gradient, is NaN and the error is queued after the route's
    own check (which raises the finished errors of earlier calls), as the routes' deferred errors are."""
    batch, metrics, errors = apply_rollout_correction(batch, correction, cu_seqlens, immediate)
    compiling = torch.compiler.is_compiling()
    if errors is not None and immediate and not compiling and bool(errors):
        raise ValueError(MESSAGES[InputError.ROLLOUT_LOGPS])
    out = route(batch)
    if errors is not None and not (immediate and not compiling):
        if not compiling:  # no queue while compiling: the NaN loss is the error there
            defer_errors(errors, "policy_loss")
        out = out._replace(loss=out.loss * torch.where(errors != 0, float("nan"), 1.0))
    return out if metrics is None else out._replace(metrics=out.metrics.with_rollout(metrics))


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

REFERENCE_CALL = CallSignature(source=("logits",), without=(*PROJECTION_OPTIONS, "inplace", "backend",
                                                             "validation", "vocab_parallel_group"))
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


# Every public loss function, by name: what it takes, its docstring's summary and what each call runs. Its
# definition below is written from here (and the call object's fields) by `python docs/generate.py`.
PUBLIC_FUNCTIONS = {
    "fused_dgpo_loss": PublicFunction(LOGITS_CALL, """Fused policy loss of ``method`` from logits: the sampled
token's log-prob by an online log-sum-exp, the entropy in the same pass and d(loss)/d(logits) in one more, never a
vocabulary-sized softmax. Same numbers as ``reference_loss``.""",
        lambda source, inputs, options: policy_loss(inputs, options, logits=source[0])),
    "reference_loss": PublicFunction(REFERENCE_CALL, """Policy loss of ``method`` from logits by
``log_softmax``, gather, the method table and autograd: the ground truth of the fused ops. It materialises
``(N, V)`` fp32 log-probs; not a path to train with.""",
        lambda source, inputs, options: policy_loss(inputs, options, logits=source[0], reference=True)),
    "fused_linear_dgpo_loss": PublicFunction(LINEAR_CALL, """Policy loss of ``method`` from hidden states
and the lm_head, as ``fused_dgpo_loss(softcap(logit_scale (hidden @ weight.T + bias)))`` without materialising the
logits: token chunks of logits tiles within ``memory_budget``. Under ``torch.autocast`` the products run in the
autocast dtype, as the model's own lm_head would. Tied embeddings need nothing special.""",
        lambda source, inputs, options: policy_loss(inputs, options, hidden=source[0], weight=source[1],
                                                    bias=source[2])),
    "fused_linear_logprobs": PublicFunction(LOGPROBS_CALL, """Forward only (old-policy and reference
log-probs): per-token log-probs and entropies, fp32, shaped like ``target_ids``, 0 on masked tokens. One GEMM pass,
no gradient work.""", _logprobs, returns="``(logps, entropy)``, two tensors shaped like ``target_ids``.",
        return_annotation="tuple[torch.Tensor, torch.Tensor]"),
}

# public-functions:start
# Written by `python docs/generate.py` from PUBLIC_FUNCTIONS and the fields of LossInputs and
# LossOptions: what an IDE, a type checker and grep see. Each call runs the function that
# PublicFunction.define makes (the call's split, then its body), whose signature and docstring
# are these.


@PUBLIC_FUNCTIONS["fused_dgpo_loss"].define
def fused_dgpo_loss(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    *,
    method: str | MethodConfig = "dgpo",
    rollout_weights: torch.Tensor | None = None,
    loss_normalizer: float | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    rollout_logps: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    entropy_weights: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    temperature: float = 1.0,
    aggregation: str | None = None,
    beta: float = 0.0,
    kl_ratio_correction: bool = False,
    entropy_coef: float = 0.0,
    positive_nll_coef: float = 0.0,
    importance_sampling_level: str = "token",
    inplace: bool = False,
    backend: str = "auto",
    validation: str = "auto",
    rollout_correction: RolloutCorrection | None = None,
    vocab_parallel_group: object = None,
    **method_params: Any,
) -> PolicyLossOutput:
    """Fused policy loss of ``method`` from logits: the sampled token's log-prob by an online log-sum-exp, the
    entropy in the same pass and d(loss)/d(logits) in one more, never a vocabulary-sized softmax. Same numbers
    as ``reference_loss``.

    Arguments:
    * ``logits``: ``(B, T, V)`` or ``(N, V)``, fp32, bf16 or fp16 (fp64 on the torch path); may be strided.
    * ``target_ids``: sampled token ids ``(B, T)`` / ``(N,)``, int64 or int32; -100 marks positions not
      scored.
    * ``advantages``: per token ``(B, T)`` or per response ``(B,)``.
    * ``mask``: which tokens are scored (bool, 0/1 integers or floats); None: every token whose id is not
      -100.
    * ``old_logps``: log-probs of the sampling policy; None means on-policy (ratio exactly 1).
    * ``ref_logps``: log-probs of the reference model, for the k3 KL term (needed when ``beta != 0``).
    * ``method``: a method of ``dgpo_ops.METHODS`` (or a ``MethodConfig``); its parameters are keywords
      (``method_params``).
    * ``rollout_weights``: per-token weights on the policy term (truncated importance sampling), or None;
      vespo and geo_mean fold them into their sequence statistic instead, as TRL folds vLLM's importance ratio
      and verl its rollout weights' geometric mean.
    * ``loss_normalizer``: the token count ``token_mean`` divides by (a number or a one-element tensor, e.g.
      the tokens of every micro-batch of the step); None: this call's scored tokens.
    * ``generator``: what a method that selects tokens at random draws from (clip_cov), for repeatable runs: a
      ``torch.Generator`` on the logits' device; None: torch's default generator of that device. A key is
      drawn for every position of the ``(B, T)`` grid, so the same state draws the same tokens for the same
      grid (another padding draws others). With ``vocab_parallel_group`` the generator, or the default one,
      must be in the same state on every process of the group (they must cut the same tokens; nothing checks
      it). Not taken under ``torch.compile``.
    * ``rollout_logps``: the inference engine's per-token log-probs of the sampled tokens (shaped like
      ``target_ids``; NaN where the engine gave none, handled as the correction's framework does), or None.
      With ``old_logps`` they give the mismatch metrics (``mismatch_kl_k1``, ``mismatch_kl_k3``,
      ``sampling_logp_difference_mean``/``_max``) and feed ``rollout_correction``.
    * ``scores``: each response's score, ``(B,)`` (or per token; ``(n_seqs,)`` packed), or None: the methods
      that split responses by its sign read it (topr's positive and negative samples, as ROLL's episode
      score); where None the advantage's sign stands in. No gradient.
    * ``entropy_weights``: per-token weights ``w`` of a second entropy term, outside the aggregation: the loss
      subtracts ``sum w_t H_t`` over the scored tokens (TRL's entropy bonus, with its own tokens and
      normaliser: ``w = coef * tokens / (count * accumulation)``), in the same passes; or None. Padded or flat
      tokens, eager (not with ``vocab_parallel_group``, ``cu_seqlens`` or under ``torch.compile`` yet).
    * ``cu_seqlens``: packed (padding-free) sequences: ``(total_tokens, V)`` logits or ``(total_tokens, H)``
      hidden states with boundaries ``[0, len_0, len_0 + len_1, ..., total_tokens]`` (int32/int64, as
      flash-attention and verl take them); per-token inputs ``(total_tokens,)``, advantages per token
      (``(total_tokens,)`` or ``(1, total_tokens)``) or per sequence (``(B,)`` or ``(B, 1)``; where ``B``
      equals the number of tokens, ``(B,)`` is an error that says which to pass); every aggregation and GSPO
      as on the padded ``(B, max_seqlen)`` layout. The row kernels read the packed rows where they are
      (``dgpo_ops/layouts/packed.py``); None: not packed.
    * ``max_seqlen``: the longest packed sequence (the padded layout's width, which
      ``seq_mean_token_sum_norm`` divides by); None: read from ``cu_seqlens`` (a host read).
    * ``temperature``: the logits are divided by it before the log-softmax.
    * ``aggregation``: ``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum_norm``,
      ``seq_sum_token_mean``, ``seq_mean_token_sum`` (TRL's luspo) or ``token_sum`` (verl's token-sum) (flat
      ``(N, V)`` logits: token level only); None: the method's own where its authors or framework fix one
      (dcpo: ``seq_sum_token_mean``, geo_mean: ``seq_mean_token_mean``), else ``token_mean``. A framework's
      own mode as its trainer divides: ``"framework:mode"`` (``"roll:seq-mean-token-mean"``,
      ``"skyrl:token_mean"``, ...; ``dgpo_ops.FRAMEWORK_AGGREGATIONS``, docs/normalization.md).
    * ``beta``: weight of the k3 KL to ``ref_logps``.
    * ``kl_ratio_correction``: multiply the KL term by the importance ratio (TRL's
      ``use_bias_correction_kl``), a bool.
    * ``entropy_coef``: weight of the entropy bonus (the loss subtracts ``entropy_coef * H``).
    * ``positive_nll_coef``: VAPO's positive-example NLL (NeMo-RL's ``positive_example_nll_weight``): the loss
      adds ``coef`` times the mean negative log-prob over the scored tokens of the responses whose score is >
      0 (needs ``scores``); 0: off.
    * ``importance_sampling_level``: ``token`` or ``sequence`` (GSPO: the ratio is the geometric mean over the
      response).
    * ``inplace``: write d(loss)/d(logits) into the logits' storage during backward (no extra logits-sized
      buffer); the logits must be a non-leaf you do not read again.
    * ``backend``: ``auto`` (Triton on CUDA, the kernels' torch twins on CPU), ``triton`` (on CPU tensors only
      under ``TRITON_INTERPRET=1``) or ``torch``.
    * ``validation``: ``auto`` (immediate on CPU, deferred on CUDA), ``immediate`` or ``deferred``: deferred
      checks never synchronise; a bad value makes the loss NaN and raises at a later call or at
      ``dgpo_ops.raise_deferred_errors()``.
    * ``rollout_correction``: a ``dgpo_ops.corrections.RolloutCorrection``, each framework's modes under their
      own names (``TrlCorrection``, ``VerlCorrection``, ``OpenRLHFCorrection``, ``NemoRLCorrection``,
      ``SkyRLCorrection``, ``SwiftCorrection`` (ms-swift), ``ArealCorrection``: docs/corrections.md), or None.
      It runs before the loss on ``old_logps`` and ``rollout_logps`` (both required), giving the rollout
      weights (so not together with ``rollout_weights``) and the rejections, which leave the mask (the
      normaliser counts only the tokens kept).
    * ``vocab_parallel_group``: a process group over which the vocabulary is split (tensor parallelism): every
      process passes the same tokens and its equal share of the vocabulary, in rank order (``V / P`` logits
      columns, or ``V / P`` rows of the lm_head weight and bias); the loss, log-probs, entropies and metrics
      are the whole vocabulary's, the gradient this process's share's (the hidden state's is summed over the
      group). 16 bytes per token cross processes, never logits or weights: the row kernels' per-row partials,
      merged by one all-reduce (``dgpo_ops/layouts/vocab.py``); None: not split.
    * ``method_params``: the method's own parameters, e.g. ``eps_low``, ``eps_high``, ``n``, ``m``
      (docs/methods.md: the method table); unknown names raise ``ValueError``.

    Returns ``PolicyLossOutput``: ``loss`` (a scalar, differentiable), per-token ``logps`` and ``entropy``
    (fp32, detached, 0 on tokens not scored) and ``metrics`` (region fractions, EUR, ratio, entropy, KL; read
    lazily). Gradients come back in each input's dtype.
    """


@PUBLIC_FUNCTIONS["reference_loss"].define
def reference_loss(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    *,
    method: str | MethodConfig = "dgpo",
    rollout_weights: torch.Tensor | None = None,
    loss_normalizer: float | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    rollout_logps: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    entropy_weights: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    temperature: float = 1.0,
    aggregation: str | None = None,
    beta: float = 0.0,
    kl_ratio_correction: bool = False,
    entropy_coef: float = 0.0,
    positive_nll_coef: float = 0.0,
    importance_sampling_level: str = "token",
    rollout_correction: RolloutCorrection | None = None,
    **method_params: Any,
) -> PolicyLossOutput:
    """Policy loss of ``method`` from logits by ``log_softmax``, gather, the method table and autograd: the
    ground truth of the fused ops. It materialises ``(N, V)`` fp32 log-probs; not a path to train with.

    Arguments:
    * ``logits``: ``(B, T, V)`` or ``(N, V)``, fp32, bf16 or fp16 (fp64 on the torch path); may be strided.
    * ``target_ids``: sampled token ids ``(B, T)`` / ``(N,)``, int64 or int32; -100 marks positions not
      scored.
    * ``advantages``: per token ``(B, T)`` or per response ``(B,)``.
    * ``mask``: which tokens are scored (bool, 0/1 integers or floats); None: every token whose id is not
      -100.
    * ``old_logps``: log-probs of the sampling policy; None means on-policy (ratio exactly 1).
    * ``ref_logps``: log-probs of the reference model, for the k3 KL term (needed when ``beta != 0``).
    * ``method``: a method of ``dgpo_ops.METHODS`` (or a ``MethodConfig``); its parameters are keywords
      (``method_params``).
    * ``rollout_weights``: per-token weights on the policy term (truncated importance sampling), or None;
      vespo and geo_mean fold them into their sequence statistic instead, as TRL folds vLLM's importance ratio
      and verl its rollout weights' geometric mean.
    * ``loss_normalizer``: the token count ``token_mean`` divides by (a number or a one-element tensor, e.g.
      the tokens of every micro-batch of the step); None: this call's scored tokens.
    * ``generator``: what a method that selects tokens at random draws from (clip_cov), for repeatable runs: a
      ``torch.Generator`` on the logits' device; None: torch's default generator of that device. A key is
      drawn for every position of the ``(B, T)`` grid, so the same state draws the same tokens for the same
      grid (another padding draws others). With ``vocab_parallel_group`` the generator, or the default one,
      must be in the same state on every process of the group (they must cut the same tokens; nothing checks
      it). Not taken under ``torch.compile``.
    * ``rollout_logps``: the inference engine's per-token log-probs of the sampled tokens (shaped like
      ``target_ids``; NaN where the engine gave none, handled as the correction's framework does), or None.
      With ``old_logps`` they give the mismatch metrics (``mismatch_kl_k1``, ``mismatch_kl_k3``,
      ``sampling_logp_difference_mean``/``_max``) and feed ``rollout_correction``.
    * ``scores``: each response's score, ``(B,)`` (or per token; ``(n_seqs,)`` packed), or None: the methods
      that split responses by its sign read it (topr's positive and negative samples, as ROLL's episode
      score); where None the advantage's sign stands in. No gradient.
    * ``entropy_weights``: per-token weights ``w`` of a second entropy term, outside the aggregation: the loss
      subtracts ``sum w_t H_t`` over the scored tokens (TRL's entropy bonus, with its own tokens and
      normaliser: ``w = coef * tokens / (count * accumulation)``), in the same passes; or None. Padded or flat
      tokens, eager (not with ``vocab_parallel_group``, ``cu_seqlens`` or under ``torch.compile`` yet).
    * ``cu_seqlens``: packed (padding-free) sequences: ``(total_tokens, V)`` logits or ``(total_tokens, H)``
      hidden states with boundaries ``[0, len_0, len_0 + len_1, ..., total_tokens]`` (int32/int64, as
      flash-attention and verl take them); per-token inputs ``(total_tokens,)``, advantages per token
      (``(total_tokens,)`` or ``(1, total_tokens)``) or per sequence (``(B,)`` or ``(B, 1)``; where ``B``
      equals the number of tokens, ``(B,)`` is an error that says which to pass); every aggregation and GSPO
      as on the padded ``(B, max_seqlen)`` layout. The row kernels read the packed rows where they are
      (``dgpo_ops/layouts/packed.py``); None: not packed.
    * ``max_seqlen``: the longest packed sequence (the padded layout's width, which
      ``seq_mean_token_sum_norm`` divides by); None: read from ``cu_seqlens`` (a host read).
    * ``temperature``: the logits are divided by it before the log-softmax.
    * ``aggregation``: ``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum_norm``,
      ``seq_sum_token_mean``, ``seq_mean_token_sum`` (TRL's luspo) or ``token_sum`` (verl's token-sum) (flat
      ``(N, V)`` logits: token level only); None: the method's own where its authors or framework fix one
      (dcpo: ``seq_sum_token_mean``, geo_mean: ``seq_mean_token_mean``), else ``token_mean``. A framework's
      own mode as its trainer divides: ``"framework:mode"`` (``"roll:seq-mean-token-mean"``,
      ``"skyrl:token_mean"``, ...; ``dgpo_ops.FRAMEWORK_AGGREGATIONS``, docs/normalization.md).
    * ``beta``: weight of the k3 KL to ``ref_logps``.
    * ``kl_ratio_correction``: multiply the KL term by the importance ratio (TRL's
      ``use_bias_correction_kl``), a bool.
    * ``entropy_coef``: weight of the entropy bonus (the loss subtracts ``entropy_coef * H``).
    * ``positive_nll_coef``: VAPO's positive-example NLL (NeMo-RL's ``positive_example_nll_weight``): the loss
      adds ``coef`` times the mean negative log-prob over the scored tokens of the responses whose score is >
      0 (needs ``scores``); 0: off.
    * ``importance_sampling_level``: ``token`` or ``sequence`` (GSPO: the ratio is the geometric mean over the
      response).
    * ``rollout_correction``: a ``dgpo_ops.corrections.RolloutCorrection``, each framework's modes under their
      own names (``TrlCorrection``, ``VerlCorrection``, ``OpenRLHFCorrection``, ``NemoRLCorrection``,
      ``SkyRLCorrection``, ``SwiftCorrection`` (ms-swift), ``ArealCorrection``: docs/corrections.md), or None.
      It runs before the loss on ``old_logps`` and ``rollout_logps`` (both required), giving the rollout
      weights (so not together with ``rollout_weights``) and the rejections, which leave the mask (the
      normaliser counts only the tokens kept).
    * ``method_params``: the method's own parameters, e.g. ``eps_low``, ``eps_high``, ``n``, ``m``
      (docs/methods.md: the method table); unknown names raise ``ValueError``.

    Returns ``PolicyLossOutput``: ``loss`` (a scalar, differentiable), per-token ``logps`` and ``entropy``
    (fp32, detached, 0 on tokens not scored) and ``metrics`` (region fractions, EUR, ratio, entropy, KL; read
    lazily). Gradients come back in each input's dtype.
    """


@PUBLIC_FUNCTIONS["fused_linear_dgpo_loss"].define
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
    method: str | MethodConfig = "dgpo",
    rollout_weights: torch.Tensor | None = None,
    loss_normalizer: float | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    rollout_logps: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    entropy_weights: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    temperature: float = 1.0,
    aggregation: str | None = None,
    beta: float = 0.0,
    kl_ratio_correction: bool = False,
    entropy_coef: float = 0.0,
    positive_nll_coef: float = 0.0,
    importance_sampling_level: str = "token",
    backend: str = "auto",
    validation: str = "auto",
    rollout_correction: RolloutCorrection | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    memory_budget: int = 536870912,
    logits_on_chip: bool = False,
    vocab_parallel_group: object = None,
    **method_params: Any,
) -> PolicyLossOutput:
    """Policy loss of ``method`` from hidden states and the lm_head, as ``fused_dgpo_loss(softcap(logit_scale
    (hidden @ weight.T + bias)))`` without materialising the logits: token chunks of logits tiles within
    ``memory_budget``. Under ``torch.autocast`` the products run in the autocast dtype, as the model's own
    lm_head would. Tied embeddings need nothing special.

    Arguments:
    * ``hidden``: hidden states ``(B, T, H)`` or ``(N, H)`` entering the lm_head.
    * ``weight``: the lm_head weight ``(V, H)``, or the lm_head module itself (``model.lm_head``; needed when
      an engine shards it, FSDP2 or DeepSpeed ZeRO-3: the op then runs as the module's forward, so the engine
      gathers the weight and reduces its gradient; its bias is used unless ``bias`` is given). A sharded
      DTensor weight is refused: pass the module.
    * ``target_ids``: sampled token ids ``(B, T)`` / ``(N,)``, int64 or int32; -100 marks positions not
      scored.
    * ``advantages``: per token ``(B, T)`` or per response ``(B,)``.
    * ``mask``: which tokens are scored (bool, 0/1 integers or floats); None: every token whose id is not
      -100.
    * ``old_logps``: log-probs of the sampling policy; None means on-policy (ratio exactly 1).
    * ``ref_logps``: log-probs of the reference model, for the k3 KL term (needed when ``beta != 0``).
    * ``bias``: the lm_head bias ``(V,)``, or None.
    * ``method``: a method of ``dgpo_ops.METHODS`` (or a ``MethodConfig``); its parameters are keywords
      (``method_params``).
    * ``rollout_weights``: per-token weights on the policy term (truncated importance sampling), or None;
      vespo and geo_mean fold them into their sequence statistic instead, as TRL folds vLLM's importance ratio
      and verl its rollout weights' geometric mean.
    * ``loss_normalizer``: the token count ``token_mean`` divides by (a number or a one-element tensor, e.g.
      the tokens of every micro-batch of the step); None: this call's scored tokens.
    * ``generator``: what a method that selects tokens at random draws from (clip_cov), for repeatable runs: a
      ``torch.Generator`` on the logits' device; None: torch's default generator of that device. A key is
      drawn for every position of the ``(B, T)`` grid, so the same state draws the same tokens for the same
      grid (another padding draws others). With ``vocab_parallel_group`` the generator, or the default one,
      must be in the same state on every process of the group (they must cut the same tokens; nothing checks
      it). Not taken under ``torch.compile``.
    * ``rollout_logps``: the inference engine's per-token log-probs of the sampled tokens (shaped like
      ``target_ids``; NaN where the engine gave none, handled as the correction's framework does), or None.
      With ``old_logps`` they give the mismatch metrics (``mismatch_kl_k1``, ``mismatch_kl_k3``,
      ``sampling_logp_difference_mean``/``_max``) and feed ``rollout_correction``.
    * ``scores``: each response's score, ``(B,)`` (or per token; ``(n_seqs,)`` packed), or None: the methods
      that split responses by its sign read it (topr's positive and negative samples, as ROLL's episode
      score); where None the advantage's sign stands in. No gradient.
    * ``entropy_weights``: per-token weights ``w`` of a second entropy term, outside the aggregation: the loss
      subtracts ``sum w_t H_t`` over the scored tokens (TRL's entropy bonus, with its own tokens and
      normaliser: ``w = coef * tokens / (count * accumulation)``), in the same passes; or None. Padded or flat
      tokens, eager (not with ``vocab_parallel_group``, ``cu_seqlens`` or under ``torch.compile`` yet).
    * ``cu_seqlens``: packed (padding-free) sequences: ``(total_tokens, V)`` logits or ``(total_tokens, H)``
      hidden states with boundaries ``[0, len_0, len_0 + len_1, ..., total_tokens]`` (int32/int64, as
      flash-attention and verl take them); per-token inputs ``(total_tokens,)``, advantages per token
      (``(total_tokens,)`` or ``(1, total_tokens)``) or per sequence (``(B,)`` or ``(B, 1)``; where ``B``
      equals the number of tokens, ``(B,)`` is an error that says which to pass); every aggregation and GSPO
      as on the padded ``(B, max_seqlen)`` layout. The row kernels read the packed rows where they are
      (``dgpo_ops/layouts/packed.py``); None: not packed.
    * ``max_seqlen``: the longest packed sequence (the padded layout's width, which
      ``seq_mean_token_sum_norm`` divides by); None: read from ``cu_seqlens`` (a host read).
    * ``temperature``: the logits are divided by it before the log-softmax.
    * ``aggregation``: ``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum_norm``,
      ``seq_sum_token_mean``, ``seq_mean_token_sum`` (TRL's luspo) or ``token_sum`` (verl's token-sum) (flat
      ``(N, V)`` logits: token level only); None: the method's own where its authors or framework fix one
      (dcpo: ``seq_sum_token_mean``, geo_mean: ``seq_mean_token_mean``), else ``token_mean``. A framework's
      own mode as its trainer divides: ``"framework:mode"`` (``"roll:seq-mean-token-mean"``,
      ``"skyrl:token_mean"``, ...; ``dgpo_ops.FRAMEWORK_AGGREGATIONS``, docs/normalization.md).
    * ``beta``: weight of the k3 KL to ``ref_logps``.
    * ``kl_ratio_correction``: multiply the KL term by the importance ratio (TRL's
      ``use_bias_correction_kl``), a bool.
    * ``entropy_coef``: weight of the entropy bonus (the loss subtracts ``entropy_coef * H``).
    * ``positive_nll_coef``: VAPO's positive-example NLL (NeMo-RL's ``positive_example_nll_weight``): the loss
      adds ``coef`` times the mean negative log-prob over the scored tokens of the responses whose score is >
      0 (needs ``scores``); 0: off.
    * ``importance_sampling_level``: ``token`` or ``sequence`` (GSPO: the ratio is the geometric mean over the
      response).
    * ``backend``: ``auto`` (Triton on CUDA, the kernels' torch twins on CPU), ``triton`` (on CPU tensors only
      under ``TRITON_INTERPRET=1``) or ``torch``.
    * ``validation``: ``auto`` (immediate on CPU, deferred on CUDA), ``immediate`` or ``deferred``: deferred
      checks never synchronise; a bad value makes the loss NaN and raises at a later call or at
      ``dgpo_ops.raise_deferred_errors()``.
    * ``rollout_correction``: a ``dgpo_ops.corrections.RolloutCorrection``, each framework's modes under their
      own names (``TrlCorrection``, ``VerlCorrection``, ``OpenRLHFCorrection``, ``NemoRLCorrection``,
      ``SkyRLCorrection``, ``SwiftCorrection`` (ms-swift), ``ArealCorrection``: docs/corrections.md), or None.
      It runs before the loss on ``old_logps`` and ``rollout_logps`` (both required), giving the rollout
      weights (so not together with ``rollout_weights``) and the rejections, which leave the mask (the
      normaliser counts only the tokens kept).
    * ``logit_scale``: the logits are ``logit_scale * (hidden @ weight.T + bias)``.
    * ``softcap``: ``softcap * tanh(logits / softcap)`` after the scale, as Gemma's final softcap; None: off.
    * ``memory_budget``: bytes of logits and gradient tiles alive at once (the token chunk follows from it).
    * ``logits_on_chip``: False: cuBLAS products into logits tiles of ``memory_budget`` bytes; True: Triton
      kernels that keep the logits in registers (no tiles, no weight copy under autocast, one more pass of
      products, gradients summed with atomics; CUDA or the interpreter).
    * ``vocab_parallel_group``: a process group over which the vocabulary is split (tensor parallelism): every
      process passes the same tokens and its equal share of the vocabulary, in rank order (``V / P`` logits
      columns, or ``V / P`` rows of the lm_head weight and bias); the loss, log-probs, entropies and metrics
      are the whole vocabulary's, the gradient this process's share's (the hidden state's is summed over the
      group). 16 bytes per token cross processes, never logits or weights: the row kernels' per-row partials,
      merged by one all-reduce (``dgpo_ops/layouts/vocab.py``); None: not split.
    * ``method_params``: the method's own parameters, e.g. ``eps_low``, ``eps_high``, ``n``, ``m``
      (docs/methods.md: the method table); unknown names raise ``ValueError``.

    Returns ``PolicyLossOutput``: ``loss`` (a scalar, differentiable), per-token ``logps`` and ``entropy``
    (fp32, detached, 0 on tokens not scored) and ``metrics`` (region fractions, EUR, ratio, entropy, KL; read
    lazily). Gradients come back in each input's dtype.
    """


@PUBLIC_FUNCTIONS["fused_linear_logprobs"].define
def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor | torch.nn.Module,
    target_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    memory_budget: int = 536870912,
    logits_on_chip: bool = False,
    backend: str = "auto",
    validation: str = "auto",
    vocab_parallel_group: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only (old-policy and reference log-probs): per-token log-probs and entropies, fp32, shaped like
    ``target_ids``, 0 on masked tokens. One GEMM pass, no gradient work.

    Arguments:
    * ``hidden``: hidden states ``(B, T, H)`` or ``(N, H)`` entering the lm_head.
    * ``weight``: the lm_head weight ``(V, H)``, or the lm_head module itself (``model.lm_head``; needed when
      an engine shards it, FSDP2 or DeepSpeed ZeRO-3: the op then runs as the module's forward, so the engine
      gathers the weight and reduces its gradient; its bias is used unless ``bias`` is given). A sharded
      DTensor weight is refused: pass the module.
    * ``target_ids``: sampled token ids ``(B, T)`` / ``(N,)``, int64 or int32; -100 marks positions not
      scored.
    * ``mask``: which tokens are scored (bool, 0/1 integers or floats); None: every token whose id is not
      -100.
    * ``bias``: the lm_head bias ``(V,)``, or None.
    * ``cu_seqlens``: packed (padding-free) sequences: ``(total_tokens, V)`` logits or ``(total_tokens, H)``
      hidden states with boundaries ``[0, len_0, len_0 + len_1, ..., total_tokens]`` (int32/int64, as
      flash-attention and verl take them); per-token inputs ``(total_tokens,)``, advantages per token
      (``(total_tokens,)`` or ``(1, total_tokens)``) or per sequence (``(B,)`` or ``(B, 1)``; where ``B``
      equals the number of tokens, ``(B,)`` is an error that says which to pass); every aggregation and GSPO
      as on the padded ``(B, max_seqlen)`` layout. The row kernels read the packed rows where they are
      (``dgpo_ops/layouts/packed.py``); None: not packed.
    * ``max_seqlen``: the longest packed sequence (the padded layout's width, which
      ``seq_mean_token_sum_norm`` divides by); None: read from ``cu_seqlens`` (a host read).
    * ``temperature``: the logits are divided by it before the log-softmax.
    * ``logit_scale``: the logits are ``logit_scale * (hidden @ weight.T + bias)``.
    * ``softcap``: ``softcap * tanh(logits / softcap)`` after the scale, as Gemma's final softcap; None: off.
    * ``memory_budget``: bytes of logits and gradient tiles alive at once (the token chunk follows from it).
    * ``logits_on_chip``: False: cuBLAS products into logits tiles of ``memory_budget`` bytes; True: Triton
      kernels that keep the logits in registers (no tiles, no weight copy under autocast, one more pass of
      products, gradients summed with atomics; CUDA or the interpreter).
    * ``backend``: ``auto`` (Triton on CUDA, the kernels' torch twins on CPU), ``triton`` (on CPU tensors only
      under ``TRITON_INTERPRET=1``) or ``torch``.
    * ``validation``: ``auto`` (immediate on CPU, deferred on CUDA), ``immediate`` or ``deferred``: deferred
      checks never synchronise; a bad value makes the loss NaN and raises at a later call or at
      ``dgpo_ops.raise_deferred_errors()``.
    * ``vocab_parallel_group``: a process group over which the vocabulary is split (tensor parallelism): every
      process passes the same tokens and its equal share of the vocabulary, in rank order (``V / P`` logits
      columns, or ``V / P`` rows of the lm_head weight and bias); the loss, log-probs, entropies and metrics
      are the whole vocabulary's, the gradient this process's share's (the hidden state's is summed over the
      group). 16 bytes per token cross processes, never logits or weights: the row kernels' per-row partials,
      merged by one all-reduce (``dgpo_ops/layouts/vocab.py``); None: not split.

    Returns ``(logps, entropy)``, two tensors shaped like ``target_ids``.
    """
# public-functions:end


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

    def __setattr__(self, name, value):
        # Liger's loss modules read their hyperparameters from attributes on every call (a beta schedule sets
        # loss.beta); this one reads self.options alone, so such an attribute would change nothing.
        if name in _OPTION_NAMES:
            raise AttributeError(
                f"DGPOLoss reads its options from self.options, so setting DGPOLoss.{name} would change nothing: "
                f"set loss.options = dataclasses.replace(loss.options, {name}=...) for an option, "
                f"loss.options = LossOptions.build(method, ...) for a method or its parameters, or build a new "
                "DGPOLoss")
        super().__setattr__(name, value)

    def forward(self, *args, **kwargs) -> PolicyLossOutput:
        (logits,), inputs, options = DGPOLOSS_INPUTS.split("DGPOLoss.forward", args, kwargs, self.options)
        return policy_loss(inputs, options, logits=logits)

    def extra_repr(self) -> str:
        return repr(self.options)


# What DGPOLoss refuses as an attribute: its options' fields and every method's parameters.
_OPTION_NAMES = frozenset(LossOptions.__dataclass_fields__) | frozenset(
    field.name for spec in METHODS.values() for field in dataclasses.fields(spec.config))

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
