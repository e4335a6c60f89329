"""The epilogues: where a row pass finishes rows, a token-level method's terms are evaluated for them. The Triton
row kernel evaluates them itself (``kernels/method_table.py``) from ``epilogue_inputs``; the torch twins call
``TwinEpilogue``.

The torch twins' epilogue: a token-level method evaluated where the twin row forward finishes the rows it was
handed (the logits op's, or one tile of the fused linear), as the Triton row kernel evaluates it where it finishes
a row (``kernels/method_table.py``).

For those rows it writes the planes the Triton epilogue writes (``TOKEN_LOSS``, ``DLOSS_DLOGP``, ``RATIO``,
``PSI``, ``REGION``, ``KL``) from their ``LOGP`` and ``ENTROPY``, with the torch objective on those
tokens (``policy_objective``, the method table's torch rows) and autograd on their O(rows) vectors; a
token-level method's terms depend on the token alone, so the derivative of their sum is each token's own.
``finalize_torch`` then reduces the planes as the finalize kernel does. So the fused-linear op forms each tile's
gradient from the tile the forward pass just made on the CPU too: three GEMM passes, as on CUDA.
"""

from __future__ import annotations

import functools

import torch

from dgpo_ops.core.inputs import canonical_batch
from dgpo_ops.core.objective import policy_objective
from dgpo_ops.core.options import LossOptions
from dgpo_ops.kernels.interface import Plane
from dgpo_ops.kernels.row_io import EpilogueInputs, RowWorkspace, RowInputs, on_token_grid
from dgpo_ops.methods.base import MethodConfig
from dgpo_ops.ops.inner_autograd import autograd_on_vectors


@functools.lru_cache(maxsize=256)
def kernel_params_on(config: MethodConfig, device: torch.device) -> torch.Tensor:
    """The method's fp32 parameter vector on ``device``, made once per (config, device): later calls
    copy nothing. The copy to a GPU is asynchronous (pinned source), so even the first call does not
    synchronise."""
    values = torch.tensor(config.kernel_params(), dtype=torch.float32)
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def epilogue_inputs(options: LossOptions, device) -> EpilogueInputs:
    """What the Triton row forward's epilogue reads for ``options`` on ``device``: made once per pair (read only, and
    on every call), or made anew for options that cannot be hashed."""
    try:
        return _epilogue_inputs(options, torch.device(device))
    except TypeError:  # an unhashable option value
        return _epilogue_inputs.__wrapped__(options, torch.device(device))


@functools.lru_cache(maxsize=256)
def _epilogue_inputs(options: LossOptions, device: torch.device) -> EpilogueInputs:
    return EpilogueInputs(
        method_id=int(options.method.method_id),
        gate_id=int(options.method.gate_id),
        method_params=kernel_params_on(options.method, device),
        beta=float(options.beta),
        entropy_coef=float(options.entropy_coef),
        kl_ratio_correction=options.kl_ratio_correction,
    )


def flat_token_inputs(inputs: RowInputs) -> RowInputs:
    """The per-token inputs as flat ``(B T,)`` tensors in the rows' order (a view where the layout allows)."""
    grid = inputs.grid

    def flat(value):
        return None if value is None else on_token_grid(value, inputs.flat, grid).reshape(-1)

    return RowInputs((1, grid[0] * grid[1]), True, flat(inputs.target_ids), flat(inputs.advantages),
                     flat(inputs.mask), flat(inputs.old_logps), flat(inputs.ref_logps),
                     flat(inputs.rollout_weights),
                     objective_inputs={name: flat(value) for name, value in inputs.objective_inputs.items()})


def rows_of(inputs: RowInputs, at: slice) -> RowInputs:
    """The tokens ``at`` of flat per-token inputs."""
    def take(value):
        return None if value is None else value[at]

    return RowInputs((1, at.stop - at.start), True, inputs.target_ids[at], inputs.advantages[at], take(inputs.mask),
                     take(inputs.old_logps), take(inputs.ref_logps), take(inputs.rollout_weights),
                     objective_inputs={name: take(value) for name, value in inputs.objective_inputs.items()})


class TwinEpilogue:
    """``RowKernels.epilogue`` of the torch twins: made per call (``pipeline.row_forward``), called by
    ``logprob_entropy_torch`` with the token slice of the rows it finished."""

    def __init__(self, plan, workspace: RowWorkspace):  # plan: the call's pipeline.CallPlan
        self.options, self.needs_grad, self.workspace = plan.options, plan.needs_grad, workspace
        self.inputs = flat_token_inputs(plan.row_inputs)

    def __call__(self, at: slice) -> None:
        planes = self.workspace.planes()
        dtype = planes.dtype
        scored = (self.workspace.target_index[at] >= 0)[None]
        batch = canonical_batch(rows_of(self.inputs, at), scored, scored.to(dtype), dtype)
        logp, entropy = planes[Plane.LOGP, at].detach()[None], planes[Plane.ENTROPY, at].detach()[None]

        def write(plane, values):
            planes[plane, at] = torch.where(scored, values.detach().to(dtype), 0.0)[0]

        if not self.needs_grad:  # forward only (no_grad / inference_mode): the terms, no coefficients
            terms = policy_objective(logp, entropy, batch, self.options)
        else:
            with autograd_on_vectors():
                logp = logp.requires_grad_(True)
                terms = policy_objective(logp, entropy, batch, self.options)
                (dloss_dlogp,) = torch.autograd.grad(terms.per_token.sum(), [logp], allow_unused=True)
            # None: a term that does not depend on the log-prob
            write(Plane.DLOSS_DLOGP, torch.zeros_like(logp) if dloss_dlogp is None else dloss_dlogp)
        write(Plane.TOKEN_LOSS, terms.per_token)
        write(Plane.RATIO, torch.exp(terms.log_ratio))
        write(Plane.PSI, terms.tokens.psi)
        write(Plane.REGION, terms.tokens.region)
        if terms.kl is not None:
            write(Plane.KL, terms.kl)
