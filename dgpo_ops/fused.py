"""``fused_dgpo_loss``: the policy loss from logits without any vocabulary-sized temporary
beyond the gradient itself (none with ``inplace=True``).

Forward: a row kernel reads each logits row once and returns log-sum-exp, the target's
log-prob and the entropy (plus, for token-level methods on Triton, the method's per-token terms
from its epilogue). The rest of the objective lives on O(N) vectors. Backward: a row kernel
expands two per-token coefficients, d loss/d l and d loss/d H, over the vocabulary.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .coefficients import RowKernels, epilogue_inputs, select_kernels, token_coefficients
from .inputs import TokenBatch, prepare_batch
from .metrics import policy_metrics
from .objective import check_kl_inputs
from .options import LossOptions
from .output import PolicyLossOutput


class FusedPolicyLossFunction(torch.autograd.Function):
    """Autograd over the row kernels. Non-tensor options travel as one ``LossOptions``; the
    per-token results are handed back through ``results`` (a dict the caller owns)."""

    @staticmethod
    def forward(ctx, logits, batch: TokenBatch, options: LossOptions, kernels: RowKernels, needs_grad: bool,
                results: dict):
        logits3d = logits.unsqueeze(0) if batch.flat else logits
        inv_temperature = 1.0 / options.temperature
        use_epilogue = kernels.has_epilogue and not options.sequence_level
        epilogue = epilogue_inputs(batch, options, logits.device) if use_epilogue else None
        rows = kernels.forward(logits3d, batch.target_ids, batch.mask, inv_temperature, epilogue)
        coefficients = token_coefficients(rows, batch, options, use_epilogue, needs_grad)
        results.update(rows=rows, coefficients=coefficients)
        ctx.save_for_backward(logits, batch.target_ids, rows.row_max, rows.log_norm, rows.entropy, coefficients.dloss_dlogp,
                              coefficients.dloss_dentropy)
        ctx.options, ctx.kernels, ctx.flat = options, kernels, batch.flat
        return coefficients.loss

    @staticmethod
    @once_differentiable  # the gradient kernel is not itself differentiable
    def backward(ctx, grad_loss):
        logits, target_ids, row_max, log_norm, entropy, dloss_dlogp, dloss_dentropy = ctx.saved_tensors
        grad_logits = logits if ctx.options.inplace else torch.empty_like(logits)
        dloss_dlogp = dloss_dlogp * grad_loss
        if dloss_dentropy is not None:
            dloss_dentropy = dloss_dentropy * grad_loss
        unsqueeze = (lambda t: t.unsqueeze(0)) if ctx.flat else (lambda t: t)
        ctx.kernels.backward(unsqueeze(logits), unsqueeze(grad_logits), target_ids, row_max, log_norm, entropy, dloss_dlogp,
                             dloss_dentropy, 1.0 / ctx.options.temperature)
        if ctx.options.inplace:
            # The logits now hold their gradient: anything else that saved them must fail loudly
            # when it unpacks them, not compute with the gradient.
            torch.autograd.graph.increment_version(logits)
        return grad_logits, None, None, None, None, None


def fused_loss_from_options(
    logits, target_ids, advantages, mask, old_logps, ref_logps, options: LossOptions, loss_normalizer=None,
    rollout_weights=None,
) -> PolicyLossOutput:
    if not torch.is_tensor(logits):
        raise ValueError(f"logits must be a tensor, got {type(logits).__name__}")
    batch = prepare_batch(
        logits.shape, logits.dtype, logits.device, target_ids, advantages, mask, old_logps, ref_logps,
        rollout_weights, options.aggregation, loss_normalizer, options.sequence_level,
    )
    check_kl_inputs(batch, options)
    if options.inplace and logits.is_leaf and logits.requires_grad:
        raise ValueError(
            "inplace=True overwrites the logits with their gradient: pass logits computed by the model "
            "(a non-leaf tensor), not a leaf whose values you keep"
        )
    kernels = select_kernels(options.backend, logits)
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    results: dict = {}
    loss = FusedPolicyLossFunction.apply(logits, batch, options, kernels, needs_grad, results)
    rows, coefficients = results["rows"], results["coefficients"]
    metrics = policy_metrics(coefficients.log_ratio, coefficients.psi, coefficients.region, rows.entropy,
                             coefficients.kl, batch.mask)
    return PolicyLossOutput(loss, batch.unflatten(rows.logp), batch.unflatten(rows.entropy), metrics)


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
    aggregation: str = "token_mean",
    loss_normalizer: float | torch.Tensor | None = None,
    beta: float = 0.0,
    entropy_coef: float = 0.0,
    importance_sampling_level: str = "token",
    rollout_weights: torch.Tensor | None = None,
    inplace: bool = False,
    backend: str = "auto",
    **method_params,
) -> PolicyLossOutput:
    """Fused policy loss of ``method`` from ``(B, T, V)`` or ``(N, V)`` logits.

    Same arguments and output as ``reference_loss``, plus:

    * ``inplace``: write d(loss)/d(logits) into the logits' storage during backward (no extra
      logits-sized buffer). The caller promises not to read the logits after backward.
    * ``backend``: ``"auto"`` (Triton on CUDA, the chunked torch path on CPU), ``"triton"``
      (on CPU tensors only under ``TRITON_INTERPRET=1``) or ``"torch"``.

    Per-token outputs are fp32 and 0 on masked tokens; the gradient has the logits' dtype.
    """
    options = LossOptions.build(
        method, temperature=temperature, aggregation=aggregation, beta=beta, entropy_coef=entropy_coef,
        importance_sampling_level=importance_sampling_level, inplace=inplace, backend=backend, **method_params,
    )
    return fused_loss_from_options(logits, target_ids, advantages, mask, old_logps, ref_logps, options,
                                   loss_normalizer, rollout_weights)


class DGPOLoss(torch.nn.Module):
    """``fused_dgpo_loss`` with its options held in a module: ``DGPOLoss("dgpo", n=2)(logits, ...)``."""

    def __init__(self, method="dgpo", **options):
        super().__init__()
        self.options = LossOptions.build(method, **options)

    def forward(self, logits, target_ids, advantages, mask=None, old_logps=None, ref_logps=None, *,
                loss_normalizer=None, rollout_weights=None) -> PolicyLossOutput:
        return fused_loss_from_options(logits, target_ids, advantages, mask, old_logps, ref_logps, self.options,
                                       loss_normalizer, rollout_weights)

    def extra_repr(self) -> str:
        return repr(self.options)
