"""What both fused ops share: the choice of row kernels, and the per-token coefficients of the
objective (loss, d loss/d l, d loss/d H, and the metric inputs) from one forward row pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .inputs import TokenBatch
from .methods import LOG_RATIO_CLAMP
from .objective import policy_objective
from .options import LossOptions


@dataclass(frozen=True)
class RowKernels:
    forward: Callable
    backward: Callable
    has_epilogue: bool  # evaluates token-level methods in the forward pass


def triton_is_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from .kernels.logprob_entropy import logprob_entropy_fwd_kernel

    return isinstance(logprob_entropy_fwd_kernel, InterpretedFunction)


def select_kernels(backend: str, logits: torch.Tensor) -> RowKernels:
    if backend == "auto":
        backend = "triton" if logits.is_cuda else "torch"
    if backend == "torch":
        from .kernels.torch_twins import logits_grad_torch, logprob_entropy_torch

        return RowKernels(logprob_entropy_torch, logits_grad_torch, has_epilogue=False)
    if logits.dtype == torch.float64:
        raise ValueError("backend='triton' supports float32, bfloat16 and float16 logits; use backend='torch' for float64")
    if not logits.is_cuda and not triton_is_interpreted():
        raise ValueError(
            "backend='triton' on CPU tensors runs the Triton interpreter: set TRITON_INTERPRET=1 before "
            "importing dgpo_ops (or use backend='torch', the default on CPU)"
        )
    from .kernels.logits_grad import logits_grad
    from .kernels.logprob_entropy import logprob_entropy

    return RowKernels(logprob_entropy, logits_grad, has_epilogue=True)


def epilogue_inputs(batch: TokenBatch, options: LossOptions, device, method_params: torch.Tensor | None = None):
    from .kernels.row_io import EpilogueInputs

    params = method_params
    if params is None:
        params = torch.tensor(options.method.kernel_params(), dtype=torch.float32, device=device)
    return EpilogueInputs(
        method=options.method,
        method_params=params,
        advantages=batch.advantages,
        old_logps=batch.old_logps,
        ref_logps=batch.ref_logps if options.beta != 0.0 else None,
        rollout_weights=batch.rollout_weights,
        beta=float(options.beta),
        kl_ratio_correction=options.kl_ratio_correction,
    )


@dataclass
class TokenCoefficients:
    """The per-token results of the objective: the loss and what backward expands over V."""

    loss: torch.Tensor
    dloss_dlogp: torch.Tensor
    dloss_dentropy: torch.Tensor | None
    log_ratio: torch.Tensor
    psi: torch.Tensor
    region: torch.Tensor
    kl: torch.Tensor | None


def _coefficients_from_epilogue(rows, batch: TokenBatch, options: LossOptions) -> TokenCoefficients:
    out = rows.epilogue
    per_token = out.token_loss
    dloss_dentropy = None
    if options.entropy_coef != 0.0:
        per_token = per_token - options.entropy_coef * rows.entropy
        dloss_dentropy = -options.entropy_coef * batch.scale
    old_logp = rows.logp if batch.old_logps is None else batch.old_logps
    log_ratio = (rows.logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return TokenCoefficients(
        loss=(per_token * batch.scale).sum(),
        dloss_dlogp=out.dloss_dlogp * batch.scale,
        dloss_dentropy=dloss_dentropy,
        log_ratio=log_ratio,
        psi=out.psi,
        region=out.region,
        kl=out.kl,
    )


def _coefficients_from_objective(rows, batch: TokenBatch, options: LossOptions, needs_grad: bool) -> TokenCoefficients:
    if not needs_grad:  # forward only (no_grad / inference_mode): the loss and metrics, no coefficients
        terms = policy_objective(rows.logp, rows.entropy, batch, options)
        return TokenCoefficients(terms.loss, None, None, terms.log_ratio, terms.tokens.psi, terms.tokens.region,
                                 terms.kl)
    # Autograd on O(N) vectors only: exact for every method, GSPO's per-response mean included.
    with torch.enable_grad():
        logp = rows.logp.detach().requires_grad_(True)
        entropy = rows.entropy.detach().requires_grad_(True)
        terms = policy_objective(logp, entropy, batch, options)
        dloss_dlogp, dloss_dentropy = torch.autograd.grad(terms.loss, [logp, entropy], allow_unused=True)
    if dloss_dlogp is None:
        dloss_dlogp = torch.zeros_like(logp)
    if options.entropy_coef == 0.0:
        dloss_dentropy = None
    return TokenCoefficients(
        loss=terms.loss.detach(),
        dloss_dlogp=dloss_dlogp,
        dloss_dentropy=dloss_dentropy,
        log_ratio=terms.log_ratio,
        psi=terms.tokens.psi,
        region=terms.tokens.region,
        kl=terms.kl,
    )


def token_coefficients(rows, batch: TokenBatch, options: LossOptions, used_epilogue: bool,
                       needs_grad: bool) -> TokenCoefficients:
    if used_epilogue:
        return _coefficients_from_epilogue(rows, batch, options)
    return _coefficients_from_objective(rows, batch, options, needs_grad)


def concat_coefficients(parts: list[TokenCoefficients]) -> TokenCoefficients:
    """Join per-chunk coefficients of a flat token range (chunks in order) into one."""
    def cat(name):
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values, dim=-1)

    return TokenCoefficients(
        loss=torch.stack([p.loss for p in parts]).sum(),
        **{name: cat(name) for name in ("dloss_dlogp", "dloss_dentropy", "log_ratio", "psi", "region", "kl")},
    )
