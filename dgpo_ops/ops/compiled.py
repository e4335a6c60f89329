"""``torch.compile`` support: the fused ops as ``torch.library`` custom ops.

Eager calls run the autograd Functions of ``ops.logits`` and ``ops.linear`` directly (no dispatcher
round trip on the hot path). Under ``torch.compile`` the public functions route here instead: each
op is one node of the graph with a fake (meta) implementation, so ``fullgraph=True`` traces it
without a graph break, and its implementation runs the same kernels, validation included, when the
compiled graph runs. Options cross the op boundary as one JSON string (a custom op takes tensors and
scalars only), built and validated once at trace time.

* ``dgpo_ops::fused_policy_loss`` / ``fused_policy_loss_backward``: the logits op. The forward returns
  the row workspace the backward kernel reads (what the autograd Function keeps on its ctx).
* ``dgpo_ops::fused_linear_policy_loss``: the linear op, gradients made in the forward as in eager;
  backward scales them by the incoming gradient with torch ops the compiler sees. The autocast
  dtype in force at trace time is an argument, since compiled code does not run under the caller's
  autocast context.
* ``dgpo_ops::checked_inputs``: the reference's value checks (host reads), returning 1.0, which the
  compiled reference multiplies its loss by so that the check stays in the graph.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import torch

from dgpo_ops.core.inputs import OP_TENSORS, LossInputs, check_values, token_inputs
from dgpo_ops.core.metrics import LossMetrics
from dgpo_ops.core.options import LossOptions, assume_constant_result
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.kernels.interface import Plane
from dgpo_ops.kernels.row_io import RowWorkspace, compute_dtype
from dgpo_ops.methods.table import method_config
from dgpo_ops.ops.backends import select_kernels
from dgpo_ops.ops.linear import Precision, autocast_dtype, linear_forward_pass, linear_plan
from dgpo_ops.ops.logits import backward_pass, forward_pass, logits_plan

OptionalTensor = torch.Tensor | None


# ----------------------------------------------------------------------------- options across the boundary


@assume_constant_result
def options_spec(options: LossOptions) -> str:
    """``options`` as a JSON string; a trace-time constant (the options themselves are one: ``LossOptions.build``).
    The rollout correction runs before the op (``dgpo_ops.corrections.stage``) and the compiled ops take no
    process group, so neither is in it."""
    spec = {name: getattr(options, name) for name in LossOptions.__dataclass_fields__
            if name not in ("method", "rollout_correction", "vocab_parallel_group")}
    spec["method"] = {"name": options.method.name, "params": dataclasses.asdict(options.method)}
    return json.dumps(spec, sort_keys=True)


@functools.lru_cache(maxsize=256)
def options_from_spec(spec: str) -> LossOptions:
    values = json.loads(spec)
    method = values.pop("method")
    return LossOptions(method=method_config(method["name"], **method["params"]), **values)


def _normalizer(tensor: OptionalTensor, value: float | None):
    return tensor if tensor is not None else value


def split_normalizer(loss_normalizer) -> tuple[OptionalTensor, float | None]:
    """A tensor normaliser travels as a tensor, a number as a float; anything else is refused later
    (by the op, with the eager message) unchanged."""
    if torch.is_tensor(loss_normalizer):
        return loss_normalizer, None
    return None, loss_normalizer


# ----------------------------------------------------------------------------- the logits op


# The ops' schemas name every tensor of OP_TENSORS in its order (a field without a default is required), so a
# new per-token float reaches them by its TokenFloat mark; the implementations take the schema's arguments by
# position: the leading ones, the tensors (N_TENSORS), the normaliser as tensor or number, then the rest.
N_TENSORS = len(OP_TENSORS)
TENSORS_SCHEMA = ", ".join(f"Tensor{'' if name not in LossInputs._field_defaults else '?'} {name}"
                           for name in OP_TENSORS) + ", Tensor? normalizer, float? normalizer_value"


def _batch(args) -> tuple[LossInputs, tuple]:
    """The op's arguments from its tensors on as the eager path's one object, and the arguments after them."""
    tensors, (normalizer, normalizer_value, *rest) = args[:N_TENSORS], args[N_TENSORS:]
    normalizer = _normalizer(normalizer, normalizer_value)
    batch = LossInputs(**dict(zip(OP_TENSORS, tensors)), loss_normalizer=normalizer)
    return batch, tuple(rest)


def _logits_plan(logits, batch: LossInputs, spec, needs_grad, checked: bool):

    options = options_from_spec(spec)
    return logits_plan(logits, batch, options, needs_grad, checked)


@torch.library.custom_op("dgpo_ops::fused_policy_loss", mutates_args=(), schema=(
    f"(Tensor logits, {TENSORS_SCHEMA}, str spec, bool needs_grad) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def fused_policy_loss_op(logits, *args):
    """(loss, per_token, stats, target_index, sequence_stats, seq_scale, status, dloss_dlogp)."""

    batch, (spec, needs_grad) = _batch(args)
    plan = _logits_plan(logits, batch, spec, needs_grad, checked=True)
    workspace, loss, stats, coefficient = forward_pass(logits, plan, zero_planes=True)
    if coefficient is None:
        coefficient = logits.new_empty((0,), dtype=workspace.per_token.dtype)
    # Outputs may not alias each other: the loss and stats of the epilogue route live in the workspace.
    return (loss.clone(), workspace.per_token, stats.clone(), workspace.target_index, workspace.sequence_stats,
            workspace.seq_scale, workspace.status, coefficient)


@fused_policy_loss_op.register_fake
def _(logits, *args):
    # The structure checks (shapes, dtypes, devices) run here, at trace time, with the eager messages.
    batch, (spec, needs_grad) = _batch(args)
    plan = _logits_plan(logits, batch, spec, needs_grad, checked=False)
    dtype = compute_dtype(logits.dtype)
    workspace = RowWorkspace.allocate(logits.shape[:-1], plan.inputs.grid[0], logits.device, dtype)
    n_coefficients = workspace.n_tokens if needs_grad and not plan.uses_epilogue else 0
    return (workspace.loss, workspace.per_token, workspace.stats, workspace.target_index, workspace.sequence_stats,
            workspace.seq_scale, workspace.status, logits.new_empty((n_coefficients,), dtype=dtype))


@torch.library.custom_op("dgpo_ops::fused_policy_loss_backward", mutates_args=())
def fused_policy_loss_backward_op(
    grad_loss: torch.Tensor, logits: torch.Tensor, per_token: torch.Tensor, target_index: torch.Tensor,
    sequence_stats: torch.Tensor, seq_scale: torch.Tensor, status: torch.Tensor, dloss_dlogp: torch.Tensor,
    spec: str,
) -> torch.Tensor:

    options = options_from_spec(spec)
    kernels = select_kernels(options.backend, logits)
    # the forward's plan used the epilogue (CallPlan.uses_epilogue) where it handed out no coefficients: the
    # epilogue wrote them into the planes (with no token, either reading is the same empty gradient)
    uses_epilogue = dloss_dlogp.numel() == 0
    workspace = RowWorkspace(per_token, target_index, sequence_stats, seq_scale, status,
                             stats=per_token.new_empty(0), loss=per_token.new_empty(()))
    return backward_pass(kernels, options, logits, torch.empty_like(logits), workspace,
                         None if uses_epilogue else dloss_dlogp, grad_loss)


@fused_policy_loss_backward_op.register_fake
def _(grad_loss, logits, per_token, target_index, sequence_stats, seq_scale, status, dloss_dlogp, spec):
    return torch.empty_like(logits)


def _logits_setup_context(ctx, inputs, output):
    ctx.spec = inputs[1 + N_TENSORS + 2]
    ctx.save_for_backward(inputs[0], *output[1:2], *output[3:])


def _logits_backward(ctx, grad_loss, *_grads_of_non_differentiable_outputs):
    logits, per_token, target_index, sequence_stats, seq_scale, status, coefficient = ctx.saved_tensors
    grad_logits = fused_policy_loss_backward_op(grad_loss, logits, per_token, target_index, sequence_stats,
                                                seq_scale, status, coefficient, ctx.spec)
    return (grad_logits,) + (None,) * (N_TENSORS + 4)


fused_policy_loss_op.register_autograd(_logits_backward, setup_context=_logits_setup_context)


def compiled_fused_loss(logits, batch: LossInputs, options: LossOptions) -> PolicyLossOutput:
    if options.inplace:
        raise ValueError("inplace=True is not supported under torch.compile (a compiled graph owns its buffers): "
                         "pass inplace=False")
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    loss, per_token, stats, *_ = fused_policy_loss_op(
        logits, *batch.tensors(), *split_normalizer(batch.loss_normalizer), options_spec(options), needs_grad)
    per_token, stats = per_token.detach(), stats.detach()
    return PolicyLossOutput(loss, per_token[Plane.LOGP], per_token[Plane.ENTROPY], LossMetrics(stats))


# ----------------------------------------------------------------------------- the linear op


def _linear_plan(weight, batch: LossInputs, spec, needs_grad, checked: bool):

    logits_shape = torch.Size((*batch.target_ids.shape, weight.shape[0]))  # the token grid of the call, then V
    return linear_plan(logits_shape, weight, batch, options_from_spec(spec), needs_grad, checked)


def _dtype(name: str) -> torch.dtype | None:
    return None if name == "" else getattr(torch, name)


@torch.library.custom_op("dgpo_ops::fused_linear_policy_loss", mutates_args=(), schema=(
    f"(Tensor hidden, Tensor weight, Tensor? bias, {TENSORS_SCHEMA}, str spec, bool[] wants, "
    "str autocast) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def fused_linear_policy_loss_op(hidden, weight, bias, *args):
    """(loss, per_token, stats, grad_hidden, grad_weight, grad_bias); a gradient not wanted is empty."""

    batch, (spec, wants, autocast) = _batch(args)
    plan = _linear_plan(weight, batch, spec, any(wants), checked=True)
    loss, per_token, stats, *grads = linear_forward_pass(hidden, weight, bias, plan, wants, _dtype(autocast),
                                                         zero_planes=True)
    empty = per_token.new_empty(0)
    grads = [empty.clone() if g is None else g for g in grads]
    return (loss.clone(), per_token, stats.clone(), *grads)


@fused_linear_policy_loss_op.register_fake
def _(hidden, weight, bias, *args):

    batch, (spec, wants, autocast) = _batch(args)
    plan = _linear_plan(weight, batch, spec, any(wants), checked=False)
    precision = Precision.resolve(weight, plan.options.softcap, _dtype(autocast))
    token_shape = (hidden.shape[0],) if plan.inputs.flat else plan.inputs.grid
    workspace = RowWorkspace.allocate(token_shape, plan.inputs.grid[0], hidden.device,
                                      compute_dtype(precision.tile))
    grads = [torch.empty(t.shape, dtype=precision.accumulate, device=t.device) if w and t is not None
             else workspace.stats.new_empty(0) for t, w in zip((hidden, weight, bias), wants)]
    return (workspace.loss, workspace.per_token, workspace.stats, *grads)


def _linear_setup_context(ctx, inputs, output):
    hidden, weight, bias = inputs[:3]
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.wants = inputs[3 + N_TENSORS + 3]
    ctx.save_for_backward(*output[3:])


def _linear_backward(ctx, grad_loss, *_grads_of_other_outputs):
    grads = [g * grad_loss if wanted else None for g, wanted in zip(ctx.saved_tensors, ctx.wants)]
    grads = [None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
    return (*grads,) + (None,) * (N_TENSORS + 5)


fused_linear_policy_loss_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


def compiled_fused_linear_loss(flat_hidden, weight, bias, batch: LossInputs, options: LossOptions) -> PolicyLossOutput:

    grad_on = torch.is_grad_enabled()
    wants = [grad_on and t is not None and t.requires_grad for t in (flat_hidden, weight, bias)]
    cast = autocast_dtype(flat_hidden.device)
    loss, per_token, stats, *_ = fused_linear_policy_loss_op(
        flat_hidden, weight, bias, *batch.tensors(), *split_normalizer(batch.loss_normalizer),
        options_spec(options), wants, "" if cast is None else str(cast).split(".")[-1])
    loss = loss.to(compute_dtype(weight.dtype))
    per_token, stats = per_token.detach(), stats.detach()
    return PolicyLossOutput(loss, per_token[Plane.LOGP], per_token[Plane.ENTROPY], LossMetrics(stats))


# ----------------------------------------------------------------------------- the reference's value checks


@torch.library.custom_op("dgpo_ops::checked_inputs", mutates_args=(), schema=(
    f"({TENSORS_SCHEMA}, SymInt[] logits_shape, ScalarType logits_dtype, str spec) -> Tensor"))
def checked_inputs_op(*args):
    batch, (logits_shape, logits_dtype, spec) = _batch(args)
    options = options_from_spec(spec)
    device = batch.target_ids.device
    inputs = token_inputs(torch.Size(logits_shape), logits_dtype, device, batch, options.aggregation,
                          options.sequence_reason)
    check_values(inputs, logits_shape[-1], batch.loss_normalizer, compute_dtype(logits_dtype))
    return torch.ones((), device=device, dtype=compute_dtype(logits_dtype))


@checked_inputs_op.register_fake
def _(*args):
    batch, (_, logits_dtype, _) = _batch(args)
    return batch.target_ids.new_empty((), dtype=compute_dtype(logits_dtype))
