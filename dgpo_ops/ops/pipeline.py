"""The row pipeline: the steps both fused ops run per call, for every layout (padded, flat, packed, a
vocabulary split across processes), on the device and without a host read. ``forward_rows`` owns their
order:

1. the row forward (``RowKernels.forward``) over every row: canonical targets, log-sum-exp, log-prob,
   entropy, and the method's epilogue where it applies; over a split vocabulary, each row's partials,
   merged over the group by one all-reduce (``RowLayout.merge``);
2. the prologue (``RowKernels.prologue``): scored-token counts, aggregation scales, input checks, and
   the errors the layout found (bad ``cu_seqlens``, unequal vocabulary shares). It is independent of the
   row forward: the logits op launches it second (the long pass over the logits starts first), the
   fused-linear op first (its gradients need the scales during the sweep);
3. the loss and metrics: the finalize kernel after an epilogue, else the torch objective on the
   per-token log-probs and entropies laid on the grid (``objective_route``: every method, GSPO's
   sequence ratio included, with autograd on O(N) vectors only), on inputs that may be made from those
   log-probs and entropies first (``CallPlan.complete``: a trainer's masks); ``LossInputs.entropy_weights``'
   term added to the loss;
4. in backward, the gradient kernel (``RowKernels.backward``) with the ``expm1`` form of ``1 - p``.

``CallPlan`` is everything a call decides on the host: ``PlanTemplate`` what it decides from metadata alone, and
the call's tensors laid out by it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from dgpo_ops.core.aggregation import aggregation_codes
from dgpo_ops.core.inputs import (
    OBJECTIVE_FLOATS,
    LossInputs,
    canonical_batch,
    check_structure,
    check_values,
    normalizer_spec,
    objective_input_errors,
    row_inputs,
)
from dgpo_ops.core.metrics import policy_metrics
from dgpo_ops.core.objective import check_kl_inputs, entropy_weight_term, policy_objective
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.validation import defer, poll_deferred_errors, resolve_mode, running_per_token_function
from dgpo_ops.kernels.interface import InputError, Plane, Status
from dgpo_ops.kernels.row_io import RowWorkspace, RowInputs, compute_dtype
from dgpo_ops.layouts.rows import CallLayout, RowLayout
from dgpo_ops.ops.backends import RowKernels, select_kernels
from dgpo_ops.ops.inner_autograd import autograd_on_vectors


@dataclass
class CallPlan:
    inputs: RowInputs  # on the objective's grid: what the prologue and the objective read
    options: LossOptions
    kernels: RowKernels
    vocab: int  # the whole vocabulary
    normalizer: tuple  # normalizer_spec(...)
    deferred: bool  # input values are checked on the device (dgpo_ops.core.validation)
    needs_grad: bool
    rows: RowLayout
    row_inputs: RowInputs  # what the row forward reads per row (``inputs`` unless the rows are packed)
    generator: torch.Generator | None = None  # what a random token selection draws from (LossInputs.generator)
    entropy_weights: torch.Tensor | None = None  # (n_rows,) LossInputs.entropy_weights in the rows' order
    # Inputs that need the row forward's log-probs and entropies first (a trainer's masks): the plan the objective
    # is evaluated with, made from this one and the merged workspace between the row forward and the objective.
    complete: Callable[["CallPlan", RowWorkspace], "CallPlan"] | None = None

    @functools.cached_property  # read several times per call; a plan is never changed, only replaced
    def uses_epilogue(self) -> bool:
        """Token-level methods are evaluated in the row forward's epilogue (both kernel sets), where it
        finishes its rows, when their inputs are all known before it and the kernels read them all: a call
        that passes an input only the torch objective reads (``OBJECTIVE_FLOATS``) runs the objective,
        whatever reads it."""
        return (self.options.token_local and self.rows.finishes_rows_in_kernel and self.complete is None
                and all(value is None for value in self.inputs.objective_inputs.values()))

    @property
    def has_kl(self) -> bool:
        return self.options.beta != 0.0 and self.inputs.ref_logps is not None

    @property
    def grid_seq_len(self) -> int:
        return self.inputs.grid[1]

    @property
    def normalizer_tensor(self) -> torch.Tensor | None:
        return self.normalizer[2]


def plan_call(token_shape, columns: int, dtype, device, batch: LossInputs, options: LossOptions,
              kernel_probe: torch.Tensor, needs_grad: bool, layout: CallLayout = CallLayout(),
              checked: bool = True) -> CallPlan:
    """Everything a call decides on the host for rows of ``token_shape`` over ``columns`` vocabulary columns
    (of ``dtype`` on ``device``): the layout, the kernels (for tensors like ``kernel_probe``), the validation
    mode, the normaliser. ``checked``: immediate validation checks the values here (every call raises the errors
    of earlier deferred calls the device has finished in ``forward_rows``, never waiting); False plans from
    metadata alone (the fake implementation of the compiled ops, which has no values)."""
    deferred = resolve_mode(options.validation, device) == "deferred"
    rows = RowLayout.build(layout, token_shape, columns, device, check=checked and not deferred)
    grid_batch = rows.grid_batch(batch)
    template = plan_template(rows, layout, grid_batch, dtype, device, options, kernel_probe, needs_grad, deferred)
    return template.plan(batch, grid_batch, checked)


@dataclass(frozen=True)
class PlanTemplate:
    """What ``plan_call`` decides before it lays out a tensor: the checks of every input's structure passed, the
    rows, the grid, the kernels, the validation mode. On the default layout it holds no tensor (nor anything
    made from one), so ``dgpo_ops.ops.plan_cache`` keeps it for the calls of the same input signature;
    ``plan`` makes each call's ``CallPlan`` from it and the call's tensors."""

    options: LossOptions
    kernels: RowKernels
    rows: RowLayout
    layout: CallLayout
    grid: tuple[int, int]
    flat: bool
    device: torch.device
    value_dtype: torch.dtype  # what check_values checks the per-token floats in (compute_dtype of the kernels')
    deferred: bool
    needs_grad: bool

    def plan(self, batch: LossInputs, grid_batch: LossInputs, checked: bool = True) -> CallPlan:
        """The call's plan from its inputs (``grid_batch``: on the objective's grid, ``RowLayout.grid_batch``), with
        immediate validation's checks of values, which run on every call (``checked`` False: none; the poll of earlier
        deferred calls runs in ``forward_rows``, once the row forward is launched)."""
        inputs = row_inputs(grid_batch, self.grid, self.flat)
        rows = self.rows
        plan = CallPlan(inputs, self.options, self.kernels, rows.vocab,
                        normalizer_spec(grid_batch.loss_normalizer, self.device), self.deferred, self.needs_grad, rows,
                        rows.row_inputs(batch, inputs), batch.generator,
                        row_entropy_weights(batch.entropy_weights, rows.token_shape, self.layout, self.device))
        if checked and not self.deferred:
            check_values(inputs, plan.vocab, grid_batch.loss_normalizer, self.value_dtype)
        return plan


def plan_template(rows: RowLayout, layout: CallLayout, grid_batch: LossInputs, dtype, device, options: LossOptions,
                  kernel_probe: torch.Tensor, needs_grad: bool, deferred: bool) -> PlanTemplate:
    """Check the structure of every input of ``grid_batch`` for ``rows`` of ``dtype`` on ``device`` and choose the
    kernels: ``plan_call``'s decisions from metadata alone."""
    grid, flat = check_structure(rows.grid_logits_shape(), dtype, device, grid_batch, options.aggregation,
                                 options.sequence_reason)
    check_kl_inputs(row_inputs(grid_batch, grid, flat), options)
    kernels = select_kernels(options.backend, kernel_probe)
    return PlanTemplate(options, kernels, rows, layout, grid, flat, torch.device(device),
                        compute_dtype(kernel_probe.dtype), deferred, needs_grad)


def row_entropy_weights(weights, token_shape, layout: CallLayout, device) -> torch.Tensor | None:
    """``LossInputs.entropy_weights`` checked and flattened to the rows' order (the tokens', on the layouts that
    take them)."""
    if weights is None:
        return None
    if not layout.is_default:
        raise ValueError("entropy_weights are not supported with vocab_parallel_group or cu_seqlens yet")
    if not torch.is_tensor(weights) or not weights.is_floating_point() or weights.shape != torch.Size(token_shape):
        shape = tuple(weights.shape) if torch.is_tensor(weights) else type(weights).__name__
        raise ValueError(f"entropy_weights must be a float tensor of shape {tuple(token_shape)}, got {shape}")
    if weights.device != torch.device(device):
        raise ValueError(f"entropy_weights is on {weights.device} but the logits are on {device}")
    return weights.detach().reshape(-1)


def entropy_gradient(plan: CallPlan, backward_view: tuple[RowWorkspace, int]) -> torch.Tensor | None:
    """d loss / d H of each row where the call has entropy weights: ``-(entropy_coef s_b + w_t)`` (the kernels'
    per-token entropy coefficient); None without them (the kernels form ``-entropy_coef s_b`` themselves)."""
    if plan.entropy_weights is None:
        return None
    workspace, grid_seq_len = backward_view
    rows = torch.arange(workspace.n_tokens, device=workspace.seq_scale.device)
    scale = workspace.seq_scale[rows // grid_seq_len]
    return -(plan.options.entropy_coef * scale + plan.entropy_weights.to(scale.dtype))


def run_prologue(plan: CallPlan, workspace: RowWorkspace, finalize: bool = False) -> None:
    """The prologue; with ``finalize`` (after the row forward's epilogue) its last program also
    reduces the loss and metrics into the workspace, in the same launch. Errors the layout found on
    the device, and those of the per-token floats the kernel does not read, join the prologue's: the
    call's status names them, and NaN scales make the loss and gradient NaN, as for bad values."""
    extra = dict(finalize=(workspace, plan.has_kl)) if finalize else {}
    plan.kernels.prologue(plan.inputs, workspace.sequence_stats, workspace.seq_scale, workspace.status, plan.vocab,
                          aggregation_codes(plan.options.aggregation), plan.normalizer, **extra)
    errors = plan.rows.errors()
    if errors is not None:  # never with finalize: a layout's rows are finished after the row forward
        workspace.status[Status.ERRORS] |= errors
        workspace.seq_scale.copy_(torch.where(errors != 0, float("nan"), workspace.seq_scale))
    check_objective_inputs(plan, workspace)


def check_objective_inputs(plan: CallPlan, workspace: RowWorkspace) -> None:
    """Deferred validation of the per-token floats the prologue kernel does not read
    (``objective_input_errors``) into the call's status and scales. A call that passes one runs the objective
    (``CallPlan.uses_epilogue``), whose loss is reduced after this, from the NaN scales."""
    found = objective_input_errors(plan.inputs, workspace.seq_scale.dtype) if plan.deferred else None
    if found is None:
        return
    errors, position = found
    named = (workspace.status[Status.ERRORS] & int(InputError.OBJECTIVE_INPUT)) != 0  # by an earlier check
    workspace.status[Status.BAD_INPUT] = torch.where(named, workspace.status[Status.BAD_INPUT], position)
    workspace.status[Status.ERRORS] |= errors
    workspace.seq_scale.copy_(torch.where(errors != 0, float("nan"), workspace.seq_scale))


RowForward = Callable[..., None]  # (rows, inv_scale, token_offset=0): the row forward over some of the call's rows


def row_forward(plan: CallPlan, workspace: RowWorkspace, with_epilogue: bool = True) -> RowForward:
    """Step 1 on the rows it is handed (the logits op: all of them; the fused-linear op: one tile at a time),
    with the method's epilogue where the plan uses it (and ``with_epilogue``: False for log-probs alone) and a
    split vocabulary's partials where it is split."""
    uses_epilogue = with_epilogue and plan.uses_epilogue
    epilogue = plan.kernels.epilogue(plan, workspace) if uses_epilogue else None

    def forward(rows: torch.Tensor, inv_scale: float, token_offset: int = 0) -> None:
        plan.kernels.forward(rows, plan.row_inputs, workspace, inv_scale, epilogue, token_offset=token_offset,
                             vocab_split=plan.rows.vocab_split)

    return forward


@dataclass
class ObjectiveResult:
    loss: torch.Tensor
    dloss_dlogp: torch.Tensor | None  # (n_rows,), scaled by the aggregation; None after an epilogue
    stats: torch.Tensor
    plan: CallPlan | None = None  # the plan the objective was evaluated with (CallPlan.complete's, where it has one)


def forward_rows(plan: CallPlan, workspace: RowWorkspace, sweep: Callable[[RowForward], None], op: str,
                 prologue_first: bool) -> ObjectiveResult:
    """Steps 1-3 of one call in their order: ``sweep(forward)`` runs the row forward over every row (and
    whatever the op does per tile after it). Queues the call's deferred checks."""
    uses_epilogue = plan.uses_epilogue  # the row forward's (never with CallPlan.complete)
    if prologue_first:
        run_prologue(plan, workspace.complete(plan.inputs.grid[0]))
    sweep(row_forward(plan, workspace))
    # Once the long pass is launched, on the host: the workspace's other buffers (RowWorkspace.allocate_rows), and
    # the errors of earlier deferred calls the device has finished (read by every call, whatever its own
    # validation; never waits).
    workspace.complete(plan.inputs.grid[0])
    poll_deferred_errors()
    plan.rows.merge(workspace)
    if plan.complete is not None:
        plan = plan.complete(plan, workspace)
        if prologue_first:  # the completed inputs were not there when the prologue ran
            check_objective_inputs(plan, workspace)
    if not prologue_first:
        run_prologue(plan, workspace, finalize=uses_epilogue)
    elif uses_epilogue:
        plan.kernels.finalize(workspace, plan.grid_seq_len, plan.has_kl)
    result = ObjectiveResult(workspace.loss, None, workspace.stats) if uses_epilogue \
        else objective_route(plan, workspace)
    if plan.entropy_weights is not None:
        planes = workspace.planes()
        result.loss = result.loss + entropy_weight_term(planes[Plane.ENTROPY], plan.entropy_weights.to(planes.dtype),
                                                        workspace.target_index >= 0)
    if plan.deferred:
        function = running_per_token_function()
        if function is not None:  # its results are the per-token values (a loss op's, its loss and gradient)
            nan_rows_on_error(workspace)
        defer(workspace.status, plan.vocab, plan.normalizer_tensor, function or op, OBJECTIVE_FLOATS)
    result.plan = plan
    return result


def nan_rows_on_error(workspace: RowWorkspace) -> None:
    """Deferred validation, for a function whose results are the per-token log-probs and entropies: a call with
    bad input gives NaN on every token, in place and on the device, as a loss op's loss and gradient are. A
    target outside the vocabulary scores nothing, so its log-prob and entropy would stay 0: probability 1, a
    number that reads as right."""
    rows = workspace.planes()[Plane.LOGP:Plane.ENTROPY + 1]
    rows.copy_(torch.where(workspace.status[Status.ERRORS] != 0, float("nan"), rows))


def objective_route(plan: CallPlan, workspace: RowWorkspace) -> ObjectiveResult:
    """Loss, scaled per-row coefficients and metrics from the row planes with the torch objective, on the grid."""
    B, T = plan.inputs.grid
    planes = workspace.planes()
    dtype = planes.dtype

    def on_grid(values, fill=0.0):
        return plan.rows.to_grid(values, fill).reshape(B, T)

    scored = on_grid(workspace.target_index >= 0, False)
    scale = torch.where(scored, workspace.seq_scale[:, None], 0.0)
    batch = canonical_batch(plan.inputs, scored, scale, dtype)
    logp, entropy = planes[Plane.LOGP], planes[Plane.ENTROPY]
    if not plan.needs_grad:  # forward only (no_grad / inference_mode): the loss and metrics, no coefficients
        terms = policy_objective(on_grid(logp), on_grid(entropy), batch, plan.options, plan.generator)
        dloss_dlogp = None
    else:
        with autograd_on_vectors():
            logp_leaf = logp.detach().requires_grad_(True)
            terms = policy_objective(on_grid(logp_leaf), on_grid(entropy.detach()), batch, plan.options,
                                     plan.generator)
            (dloss_dlogp,) = torch.autograd.grad(terms.loss, [logp_leaf], allow_unused=True)
        dloss_dlogp = torch.zeros_like(logp) if dloss_dlogp is None else dloss_dlogp
    metrics = policy_metrics(terms.log_ratio, terms.tokens.psi, terms.tokens.region, on_grid(entropy), terms.kl, scored)
    # As the finalize kernel: input the prologue could not score makes the loss NaN even when it hides
    # every scored token (the scales are NaN, but no scored token carries them into the sum).
    loss = torch.where(workspace.status[Status.ERRORS] != 0, float("nan"), terms.loss.detach())
    return ObjectiveResult(loss, dloss_dlogp, metrics.as_tensor())


def backward_rows(kernels: RowKernels, options: LossOptions, rows: torch.Tensor, grad_rows: torch.Tensor,
                  backward_view: tuple[RowWorkspace, int], inv_scale: float, dloss_dlogp=None, grad_loss=None,
                  token_offset: int = 0, dloss_dentropy=None, entropy_coef: float | None = None) -> None:
    """Step 4 on some of the call's rows: d loss / d rows into ``grad_rows``. ``backward_view`` is
    ``RowLayout.backward_workspace(...)``, made once per call (packed rows: one O(N) gather of their scales)."""
    workspace, grid_seq_len = backward_view
    kernels.backward(rows, grad_rows, workspace, grid_seq_len, inv_scale,
                     options.entropy_coef if entropy_coef is None else entropy_coef, grad_loss=grad_loss,
                     dloss_dlogp=dloss_dlogp, token_offset=token_offset, dloss_dentropy=dloss_dentropy)
