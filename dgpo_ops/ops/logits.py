"""``fused_dgpo_loss``: the policy loss from logits without any vocabulary-sized temporary
beyond the gradient itself (none with ``inplace=True``), and without a host-device
synchronisation on CUDA.

Forward, for a token-level method on Triton, is two launches: the row kernel (each logits row
read once: log-sum-exp, the target's log-prob, the entropy and the method's per-token terms) and
the prologue (input checks, counts, aggregation scales), whose last program reduces the loss and
metrics.
Sequence-level ratios (GSPO) and the torch backend evaluate the objective with torch on O(N)
vectors instead. Backward is one launch: the gradient kernel expands two per-token coefficients
over the vocabulary, reading the incoming gradient on the device. Packed sequences and a
vocabulary split across processes run the same kernels, with the torch objective (``dgpo_ops.ops.pipeline``).
"""

from __future__ import annotations

import torch

from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.core.metrics import LossMetrics
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.core.validation import refuse_double_backward, resolve_mode
from dgpo_ops.kernels.interface import Plane
from dgpo_ops.kernels.row_io import RowWorkspace, compute_dtype
from dgpo_ops.layouts.rows import CallLayout, RowLayout
from dgpo_ops.ops.backends import RowKernels
from dgpo_ops.ops.pipeline import (
    CallPlan,
    PlanTemplate,
    backward_rows,
    entropy_gradient,
    forward_rows,
    plan_call,
    plan_template,
)
from dgpo_ops.ops.plan_cache import LOGITS_PLANS, input_signature


def forward_pass(logits: torch.Tensor, plan: CallPlan, zero_planes: bool = False):
    """The forward kernels of one call: ``(workspace, loss, stats, dloss_dlogp)``; the last is None
    after an epilogue (the coefficients are in the workspace) and under no_grad."""
    dtype = compute_dtype(logits.dtype)
    # what the row forward writes: forward_rows makes the rest once it is launched
    workspace = RowWorkspace.allocate_rows(logits.shape[:-1], logits.device, dtype, zero_planes)
    inv_temperature = 1.0 / plan.options.temperature
    # The row forward first: it waits for no other kernel, so the long pass over the logits
    # starts as early as the host can launch it; the small prologue (which finalizes) queues behind it.
    result = forward_rows(plan, workspace, lambda forward: forward(logits, inv_temperature), "fused_dgpo_loss",
                          prologue_first=False)
    return workspace, result.loss, result.stats, result.dloss_dlogp


def backward_pass(kernels: RowKernels, options: LossOptions, logits, grad_logits, workspace: RowWorkspace,
                  coefficient, grad_loss, rows: RowLayout | None = None, plan: CallPlan | None = None) -> torch.Tensor:
    """d loss / d logits into ``grad_logits`` (the logits themselves with ``inplace``); ``rows`` None: the
    logits are the whole vocabulary on the grid (a compiled call). ``plan``: the eager call's, for its entropy
    weights."""
    rows = rows or RowLayout(logits.shape[:-1], logits.shape[-1])
    grid_seq_len = logits.shape[1] if logits.dim() == 3 else logits.shape[0]
    backward_view = rows.backward_workspace(workspace, grid_seq_len)
    backward_rows(kernels, options, logits, grad_logits, backward_view, 1.0 / options.temperature,
                  dloss_dlogp=coefficient, grad_loss=grad_loss,
                  dloss_dentropy=None if plan is None else entropy_gradient(plan, backward_view))
    return grad_logits


class FusedPolicyLossFunction(torch.autograd.Function):
    """Autograd over the row kernels. Non-tensor options travel in one ``CallPlan``. Outputs: the
    loss (differentiable), the per-token planes and the metrics vector (not differentiable)."""

    @staticmethod
    def forward(ctx, logits, plan: CallPlan):
        ctx.set_materialize_grads(False)
        workspace, loss, stats, coefficient = forward_pass(logits, plan)
        if plan.needs_grad:
            # The planes are saved too: out.logps and out.entropy are views of them, so editing those
            # in place before backward fails loudly instead of changing the gradient.
            ctx.save_for_backward(logits, workspace.per_token)
            ctx.plan, ctx.workspace, ctx.coefficient = plan, workspace.for_backward(), coefficient
        ctx.mark_non_differentiable(workspace.per_token, stats)
        return loss, workspace.per_token, stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_per_token, _grad_stats):
        refuse_double_backward("fused_dgpo_loss")  # the gradient kernel is not itself differentiable
        if grad_loss is None:
            return None, None
        logits, _planes = ctx.saved_tensors  # unpacking checks that nobody edited the planes in place
        options = ctx.plan.options
        grad_logits = logits if options.inplace else torch.empty_like(logits)
        backward_pass(ctx.plan.kernels, options, logits, grad_logits, ctx.workspace, ctx.coefficient, grad_loss,
                      ctx.plan.rows, ctx.plan)
        if options.inplace:
            # The logits now hold their gradient: anything else that saved them must fail loudly
            # when it unpacks them, not compute with the gradient.
            torch.autograd.graph.increment_version(logits)
        return grad_logits, None


def _elements_may_overlap(tensor: torch.Tensor) -> bool:
    """Whether two indices of ``tensor`` may address one element: False when, with the dimensions
    ordered by stride, each stride steps past everything the smaller ones span (every dense,
    permuted or sliced layout)."""
    dims = sorted((stride, size) for stride, size in zip(tensor.stride(), tensor.shape) if size > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def check_inplace_target(logits: torch.Tensor) -> None:
    """``inplace=True`` writes the gradient over the logits: refuse storage the caller keeps (a leaf,
    or a view of one) and storage where one element stands for several logits (``expand``)."""
    base = logits
    while base._base is not None:
        base = base._base
    if base.is_leaf and base.requires_grad:
        what = "a leaf" if base is logits else "a view of a leaf"
        raise ValueError(
            f"inplace=True overwrites the logits with their gradient, and these are {what} whose values you "
            "keep: pass logits computed by the model (a non-leaf tensor), or inplace=False")
    if _elements_may_overlap(logits):
        raise ValueError(
            f"inplace=True writes one gradient value per logit, but these logits (shape {tuple(logits.shape)}, "
            f"strides {logits.stride()}) share memory between elements (e.g. from expand): pass "
            "inplace=False, or .contiguous() logits")


def logits_plan(logits, batch: LossInputs, options: LossOptions, needs_grad: bool, checked: bool = True,
                layout: CallLayout = CallLayout()) -> CallPlan:
    """The call's plan from metadata; ``checked`` also checks the values (False: the fake
    implementation of the compiled op, which has no values)."""
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must have shape (B, T, V) or (N, V), got {tuple(logits.shape)}")
    return plan_call(logits.shape[:-1], logits.shape[-1], logits.dtype, logits.device, batch, options, logits,
                     needs_grad, layout, checked)


def cached_logits_plan(logits, batch: LossInputs, options: LossOptions, needs_grad: bool,
                       layout: CallLayout = CallLayout()) -> CallPlan:
    """``logits_plan``, from the template cached for the call's input signature where it has one
    (``dgpo_ops.ops.plan_cache``); the checks of values run on every call either way."""
    key = input_signature(logits, batch, options, needs_grad) if layout.is_default else None
    template = None if key is None else LOGITS_PLANS.template(
        key, lambda: logits_template(logits, batch, options, needs_grad))
    if template is None:
        return logits_plan(logits, batch, options, needs_grad, layout=layout)
    return template.plan(batch, batch)


def logits_template(logits, batch: LossInputs, options: LossOptions, needs_grad: bool) -> PlanTemplate:
    """The plan template of a call on the default layout (one process's whole vocabulary, tokens as passed)."""
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must have shape (B, T, V) or (N, V), got {tuple(logits.shape)}")
    layout = CallLayout()
    deferred = resolve_mode(options.validation, logits.device) == "deferred"
    rows = RowLayout.build(layout, logits.shape[:-1], logits.shape[-1], logits.device, check=not deferred)
    return plan_template(rows, layout, batch, logits.dtype, logits.device, options, logits, needs_grad, deferred)


def logits_loss(logits, batch: LossInputs, options: LossOptions, layout: CallLayout = CallLayout()) -> PolicyLossOutput:
    """The logits op, eager, on every layout (``dgpo_ops.api`` routes compiled calls)."""
    if not torch.is_tensor(logits):
        raise ValueError(f"logits must be a tensor, got {type(logits).__name__}")
    if options.inplace:
        check_inplace_target(logits)
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    plan = cached_logits_plan(logits, batch, options, needs_grad, layout)
    loss, per_token, stats = FusedPolicyLossFunction.apply(logits, plan)
    return PolicyLossOutput(loss, per_token[Plane.LOGP], per_token[Plane.ENTROPY], LossMetrics(stats))
