"""The steps both fused ops run per call, on the device and without a host read:

1. the row forward (``RowKernels.forward``): canonical targets, log-sum-exp, log-prob, entropy, and
   the method's epilogue where it applies;
2. the prologue (``RowKernels.prologue``): scored-token counts, aggregation scales, input checks
   (independent of the row forward: the logits op launches it second, the fused-linear op first,
   since its gradients need the scales during the sweep);
3. the loss and metrics: the finalize kernel after an epilogue, else the torch objective on the
   per-token log-probs and entropies (``objective_route``: every method, GSPO's sequence ratio
   included, with autograd on O(N) vectors only);
4. in backward, the gradient kernel (``RowKernels.backward``).

``CallPlan`` is everything a call decides on the host from metadata alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dgpo_ops.core.aggregation import AGGREGATIONS
from dgpo_ops.ops.backends import RowKernels, select_kernels
from dgpo_ops.core.inputs import canonical_batch, check_values, normalizer_spec, per_token_dtype
from dgpo_ops.kernels.interface import Plane, Status
from dgpo_ops.kernels.row_io import EpilogueInputs, RowWorkspace, TokenInputs
from dgpo_ops.core.metrics import policy_metrics
from dgpo_ops.methods.table import MethodConfig
from dgpo_ops.core.objective import check_kl_inputs, policy_objective
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.validation import poll_deferred_errors, resolve_mode


@dataclass
class CallPlan:
    inputs: TokenInputs
    options: LossOptions
    kernels: RowKernels
    vocab: int
    normalizer: tuple  # normalizer_spec(...)
    deferred: bool  # input values are checked on the device (dgpo_ops.core.validation)
    needs_grad: bool

    @property
    def uses_epilogue(self) -> bool:
        """Token-level methods are evaluated in the forward kernel's epilogue (Triton)."""
        return self.kernels.has_epilogue and not self.options.sequence_level

    @property
    def has_kl(self) -> bool:
        return self.options.beta != 0.0 and self.inputs.ref_logps is not None

    @property
    def grid_seq_len(self) -> int:
        return self.inputs.grid[1]

    @property
    def normalizer_tensor(self) -> torch.Tensor | None:
        return self.normalizer[2]


def plan_call(inputs: TokenInputs, options: LossOptions, kernel_probe: torch.Tensor, vocab: int, loss_normalizer,
              device, needs_grad: bool) -> CallPlan:
    """The plan from metadata alone (no value is read): what ``prepare_call`` decides, and what a
    fake (meta) implementation of the custom ops needs for the shapes of its outputs."""
    check_kl_inputs(inputs, options)
    kernels = select_kernels(options.backend, kernel_probe)
    deferred = resolve_mode(options.validation, device) == "deferred"
    return CallPlan(inputs, options, kernels, vocab, normalizer_spec(loss_normalizer, device), deferred, needs_grad)


def prepare_call(inputs: TokenInputs, options: LossOptions, kernel_probe: torch.Tensor, vocab: int, loss_normalizer,
                 device, needs_grad: bool) -> CallPlan:
    """Everything a call decides on the host, from metadata: the kernels (for tensors like
    ``kernel_probe``), the validation mode, the normaliser. Immediate validation checks the values
    here; deferred validation raises the errors of earlier calls the device has finished (never waits)."""
    plan = plan_call(inputs, options, kernel_probe, vocab, loss_normalizer, device, needs_grad)
    deferred = plan.deferred
    if deferred:
        poll_deferred_errors()
    else:
        check_values(inputs, vocab, loss_normalizer, per_token_dtype(kernel_probe.dtype))
    return plan


@functools.lru_cache(maxsize=256)
def method_params(config: MethodConfig, device: torch.device) -> torch.Tensor:
    """The method's fp32 parameter vector on ``device``, made once per (config, device): later calls
    copy nothing. The copy to a GPU is asynchronous (pinned source), so even the first call does not
    synchronise."""
    values = torch.tensor(config.kernel_params(), dtype=torch.float32)
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def epilogue_inputs(options: LossOptions, device) -> EpilogueInputs:
    return EpilogueInputs(
        method_id=int(options.method.method_id),
        gate_id=int(options.method.gate_id),
        method_params=method_params(options.method, torch.device(device)),
        beta=float(options.beta),
        entropy_coef=float(options.entropy_coef),
        kl_ratio_correction=options.kl_ratio_correction,
    )


def run_prologue(plan: CallPlan, workspace: RowWorkspace, finalize: bool = False) -> None:
    """The prologue; with ``finalize`` (after the row forward's epilogue) its last program also
    reduces the loss and metrics into the workspace, in the same launch."""
    extra = dict(finalize=(workspace, plan.has_kl)) if finalize else {}
    plan.kernels.prologue(plan.inputs, workspace.sequence_stats, workspace.seq_scale, workspace.status, plan.vocab,
                          AGGREGATIONS[plan.options.aggregation], plan.normalizer, **extra)


@dataclass
class ObjectiveResult:
    loss: torch.Tensor
    dloss_dlogp: torch.Tensor | None  # (n_tokens,), scaled by the aggregation
    stats: torch.Tensor


def objective_route(plan: CallPlan, workspace: RowWorkspace) -> ObjectiveResult:
    """Loss, scaled per-token coefficients and metrics from the row planes with the torch objective."""
    B, T = plan.inputs.grid
    planes = workspace.planes()
    dtype = planes.dtype
    scored = (workspace.target_index >= 0).view(B, T)
    scale = torch.where(scored, workspace.seq_scale[:, None], 0.0)
    batch = canonical_batch(plan.inputs, scored, scale, dtype)
    logp, entropy = planes[Plane.LOGP].view(B, T), planes[Plane.ENTROPY].view(B, T)
    if not plan.needs_grad:  # forward only (no_grad / inference_mode): the loss and metrics, no coefficients
        terms = policy_objective(logp, entropy, batch, plan.options)
        dloss_dlogp = None
    else:
        # Autograd on O(N) vectors. Inside the custom op of a compiled call (dgpo_ops.ops.compiled) the
        # dispatcher has autograd excluded below the op's own autograd node: re-admit it here.
        with torch.enable_grad(), torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False):
            logp_leaf = logp.detach().requires_grad_(True)
            entropy_leaf = entropy.detach().requires_grad_(True)
            terms = policy_objective(logp_leaf, entropy_leaf, batch, plan.options)
            (dloss_dlogp,) = torch.autograd.grad(terms.loss, [logp_leaf], allow_unused=True)
        dloss_dlogp = torch.zeros_like(logp) if dloss_dlogp is None else dloss_dlogp
        dloss_dlogp = dloss_dlogp.reshape(-1)
    metrics = policy_metrics(terms.log_ratio, terms.tokens.psi, terms.tokens.region, entropy, terms.kl, scored)
    # As the finalize kernel: input the prologue could not score makes the loss NaN even when it hides
    # every scored token (the scales are NaN, but no scored token carries them into the sum).
    loss = torch.where(workspace.status[Status.ERRORS] != 0, float("nan"), terms.loss.detach())
    return ObjectiveResult(loss, dloss_dlogp, metrics.as_tensor())
