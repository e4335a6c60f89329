"""``fused_linear_dgpo_loss``: the policy loss from hidden states and the lm_head weight, with the
logits never whole.

Tiles are ``token chunk x whole vocabulary`` in fp32 (the product is never rounded to bf16 before
the log-sum-exp). For a token-level method every token's loss, and so its gradient coefficient,
is known as soon as its row is reduced, so the gradient tile is formed from the same logits tile
the forward GEMM just wrote: three GEMM passes (logits, dH, dW) instead of TRL's four (its
backward recomputes every tile). The gradients are computed in the forward; backward only scales
them by the incoming gradient. GSPO's sequence ratio needs every token's log-prob first, so it
recomputes the tiles in a second sweep: four GEMM passes.

Only unmasked tokens enter a GEMM. Peak extra memory: one (or, with softcap, two) fp32 tiles of
``memory_budget`` bytes, the fp32 gradient accumulators, and O(N) per-token vectors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .coefficients import (
    RowKernels,
    TokenCoefficients,
    concat_coefficients,
    epilogue_inputs,
    select_kernels,
    token_coefficients,
)
from .inputs import TokenBatch, prepare_batch
from .metrics import policy_metrics
from .objective import check_kl_inputs
from .options import LossOptions
from .output import PolicyLossOutput

DEFAULT_MEMORY_BUDGET = 512 * 2**20  # bytes of fp32 logits tiles
# cuBLAS writes an fp32 product of bf16/fp16 operands directly (torch >= 2.8, CUDA).
_HAS_FP32_OUT_MM = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


@dataclass(frozen=True)
class ProjectionOptions:
    """How logits are made from the projection ``y = hidden @ weight^T + bias``:
    ``logits = softcap * tanh(logit_scale * y / softcap)`` (or ``logit_scale * y``), then / temperature."""

    logit_scale: float = 1.0
    softcap: float | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET

    def __post_init__(self):
        if isinstance(self.logit_scale, bool) or not math.isfinite(self.logit_scale) or self.logit_scale <= 0:
            raise ValueError(f"logit_scale must be a finite number > 0, got {self.logit_scale!r}")
        if self.softcap is not None and (not math.isfinite(self.softcap) or self.softcap <= 0):
            raise ValueError(f"softcap must be None or a finite number > 0, got {self.softcap!r}")
        if int(self.memory_budget) < 1:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {self.memory_budget!r}")


class _Projection:
    """The GEMMs: fp32 logits tiles and the fp32-accumulated gradients of hidden, weight and bias."""

    def __init__(self, weight, bias):
        # On CUDA, bf16/fp16 operands go to cuBLAS as they are with an fp32 output; elsewhere the
        # operands are upcast once per call (CPU matmuls of bf16 would round the product).
        self.cuda_low_precision = weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and _HAS_FP32_OUT_MM
        self.tile_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        operand = weight.dtype if self.cuda_low_precision else self.tile_dtype
        self.weight = weight.detach().to(operand)
        self.bias = None if bias is None else bias.detach().to(self.tile_dtype)

    def logits(self, hidden, out):
        """out = hidden @ weight^T + bias, accumulated and stored in fp32."""
        hidden = hidden.to(self.weight.dtype)
        if self.cuda_low_precision:
            out.copy_(self.bias.expand_as(out)) if self.bias is not None else out.zero_()
            torch.addmm(out, hidden, self.weight.t(), out_dtype=torch.float32, out=out)
        else:
            torch.mm(hidden, self.weight.t(), out=out)
            if self.bias is not None:
                out.add_(self.bias)

    def accumulate_grads(self, grad_tile, hidden, grad_hidden, grad_weight, grad_bias):
        """grad_hidden = G @ W, grad_weight += G^T @ H, grad_bias += sum G (fp32 accumulators)."""
        if self.cuda_low_precision:  # tensor-core GEMMs on the tile rounded to the operands' dtype, as TRL
            grad_tile = grad_tile.to(self.weight.dtype)
            hidden = hidden.to(self.weight.dtype)
            if grad_hidden is not None:
                grad_hidden.zero_()
                torch.addmm(grad_hidden, grad_tile, self.weight, out_dtype=torch.float32, out=grad_hidden)
            if grad_weight is not None:
                torch.addmm(grad_weight, grad_tile.t(), hidden, out_dtype=torch.float32, out=grad_weight)
        else:
            hidden = hidden.to(self.tile_dtype)
            if grad_hidden is not None:
                torch.mm(grad_tile, self.weight, out=grad_hidden)
            if grad_weight is not None:
                grad_weight.addmm_(grad_tile.t(), hidden)
        if grad_bias is not None:
            grad_bias += grad_tile.sum(dim=0, dtype=grad_bias.dtype)


class _Tiles:
    """The fp32 tile buffers, and the scale the row kernels apply to what they read."""

    def __init__(self, n_tokens, vocab, dtype, device, projection_options: ProjectionOptions, temperature: float):
        self.softcap = projection_options.softcap
        self.logit_scale = projection_options.logit_scale
        buffers = 2 if self.softcap is not None else 1
        bytes_per_row = vocab * torch.finfo(dtype).bits // 8 * buffers
        rows = max(1, min(n_tokens, projection_options.memory_budget // bytes_per_row))
        self.rows = rows if rows < 16 else rows - rows % 16
        self.logits = torch.empty((self.rows, vocab), dtype=dtype, device=device)
        self.grad = torch.empty_like(self.logits) if self.softcap is not None else self.logits
        # With softcap the buffer holds t = tanh(logit_scale y / softcap) and the logits are softcap t.
        self.kernel_scale = (self.softcap if self.softcap is not None else self.logit_scale) / temperature

    def transform(self, tile):
        if self.softcap is not None:
            tile.mul_(self.logit_scale / self.softcap).tanh_()

    def chain_rule(self, tile, grad):
        """grad holds d loss / d (what the kernels read); make it d loss / d y."""
        if self.softcap is not None:
            grad.mul_((1.0 - tile * tile) * (self.logit_scale / self.softcap))


def _sweep(hidden, projection, tiles, batch, on_tile):
    """Compute each chunk's logits tile and hand it to ``on_tile``."""
    for start in range(0, hidden.shape[0], tiles.rows):
        stop = min(start + tiles.rows, hidden.shape[0])
        chunk = batch.token_slice(start, stop)
        tile = tiles.logits[: stop - start]
        projection.logits(hidden[start:stop], out=tile)
        tiles.transform(tile)
        on_tile(start, stop, chunk, tile)


class FusedLinearPolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, batch: TokenBatch, active: torch.Tensor, options: LossOptions,
                projection_options, kernels: RowKernels, needs_grad: bool, results: dict):
        """``hidden`` holds the unmasked tokens only, at positions ``active`` of ``batch``'s grid."""
        active_batch = batch.select(active)
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        projection = _Projection(weight, bias)
        tiles = _Tiles(max(n_tokens, 1), vocab, projection.tile_dtype, hidden.device, projection_options,
                       options.temperature)
        token_level = not options.sequence_level
        use_epilogue = kernels.has_epilogue and token_level
        epilogue_params = None
        wants = [needs_grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
        grad_hidden = torch.zeros(hidden.shape, dtype=projection.tile_dtype, device=hidden.device) if wants[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=projection.tile_dtype, device=weight.device) if wants[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=projection.tile_dtype, device=bias.device) if wants[2] else None
        per_token = {name: torch.zeros(n_tokens, dtype=projection.tile_dtype, device=hidden.device)
                     for name in ("row_max", "log_norm", "logp", "entropy")}
        parts: list[TokenCoefficients] = []

        def gradient(start, stop, chunk, tile, row_max, log_norm, entropy, coefficients):
            grad = tiles.grad[: stop - start]
            kernels.backward(tile[None], grad[None], chunk.target_ids, row_max, log_norm, entropy, coefficients.dloss_dlogp,
                             coefficients.dloss_dentropy, tiles.kernel_scale)
            tiles.chain_rule(tile, grad)
            projection.accumulate_grads(grad, hidden[start:stop],
                                        None if grad_hidden is None else grad_hidden[start:stop], grad_weight,
                                        grad_bias)

        def first_pass(start, stop, chunk, tile):
            nonlocal epilogue_params
            epilogue = None
            if use_epilogue:
                epilogue = epilogue_inputs(chunk, options, hidden.device, epilogue_params)
                epilogue_params = epilogue.method_params
            rows = kernels.forward(tile[None], chunk.target_ids, chunk.mask, tiles.kernel_scale, epilogue)
            for name in per_token:
                per_token[name][start:stop] = getattr(rows, name).reshape(-1)
            if token_level:
                coefficients = token_coefficients(rows, chunk, options, use_epilogue, needs_grad)
                parts.append(coefficients)
                if needs_grad:
                    gradient(start, stop, chunk, tile, rows.row_max, rows.log_norm, rows.entropy, coefficients)

        _sweep(hidden, projection, tiles, active_batch, first_pass)

        if token_level:
            coefficients = concat_coefficients(parts) if parts else None
        else:
            # GSPO: the per-response reduction needs every token's log-prob on the (B, T) grid,
            # then a second sweep recomputes the tiles for the gradient.
            from .kernels.row_io import RowForward

            def on_grid(values):
                grid = torch.zeros(batch.mask.numel(), dtype=values.dtype, device=values.device)
                grid[active] = values
                return grid.reshape(batch.mask.shape)

            rows = RowForward(*(on_grid(per_token[name]) for name in ("row_max", "log_norm", "logp", "entropy")), None)
            coefficients = token_coefficients(rows, batch, options, False, needs_grad)
            if needs_grad:
                dloss_dlogp = coefficients.dloss_dlogp.reshape(-1)[active]
                dloss_dentropy = (None if coefficients.dloss_dentropy is None
                                  else coefficients.dloss_dentropy.reshape(-1)[active])

                def second_pass(start, stop, chunk, tile):
                    sliced = TokenCoefficients(
                        loss=coefficients.loss, dloss_dlogp=dloss_dlogp[start:stop][None],
                        dloss_dentropy=None if dloss_dentropy is None else dloss_dentropy[start:stop][None],
                        log_ratio=None, psi=None, region=None, kl=None)
                    gradient(start, stop, chunk, tile, *(per_token[name][start:stop][None]
                                                         for name in ("row_max", "log_norm", "entropy")), sliced)

                _sweep(hidden, projection, tiles, active_batch, second_pass)

        results.update(per_token=per_token, coefficients=coefficients)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        loss = coefficients.loss if coefficients is not None else torch.zeros((), device=hidden.device)
        return loss.to(projection.tile_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grads = []
        unit = bool(torch.equal(grad_loss, torch.ones_like(grad_loss)))  # the usual case: skip the multiply
        for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            if grad is not None and not unit:
                grad = grad * grad_loss
            grads.append(None if grad is None else grad.to(dtype))
        return (*grads, None, None, None, None, None, None, None)


def _flatten_tokens(hidden, weight, bias):
    if not torch.is_tensor(hidden) or hidden.dim() not in (2, 3):
        raise ValueError("hidden must be a tensor of shape (B, T, H) or (N, H)")
    if not torch.is_tensor(weight) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        shape = tuple(weight.shape) if torch.is_tensor(weight) else type(weight).__name__
        raise ValueError(f"weight must have shape (V, {hidden.shape[-1]}), got {shape}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if weight.device != hidden.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None and (not torch.is_tensor(bias) or bias.shape != weight.shape[:1] or bias.device != weight.device):
        raise ValueError(f"bias must be a tensor of shape ({weight.shape[0]},) on {weight.device}")
    logits_shape = torch.Size((*hidden.shape[:-1], weight.shape[0]))
    return hidden.reshape(-1, hidden.shape[-1]), logits_shape


def fused_linear_loss_from_options(hidden, weight, bias, target_ids, advantages, mask, old_logps, ref_logps,
                                   options: LossOptions, projection_options: ProjectionOptions,
                                   loss_normalizer=None, rollout_weights=None) -> PolicyLossOutput:
    flat_hidden, logits_shape = _flatten_tokens(hidden, weight, bias)
    batch = prepare_batch(logits_shape, hidden.dtype, hidden.device, target_ids, advantages, mask, old_logps,
                          ref_logps, rollout_weights, options.aggregation, loss_normalizer, options.sequence_level)
    check_kl_inputs(batch, options)
    if options.inplace:
        raise ValueError("inplace applies to fused_dgpo_loss; the linear op never holds whole logits")
    tile_probe = torch.empty(0, dtype=torch.float64 if weight.dtype == torch.float64 else torch.float32,
                             device=hidden.device)
    kernels = select_kernels(options.backend, tile_probe)
    # Only unmasked tokens enter the GEMMs.
    active = batch.mask.reshape(-1).nonzero()[:, 0]
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    results: dict = {}
    loss = FusedLinearPolicyLossFunction.apply(
        flat_hidden.index_select(0, active), weight, bias, batch, active, options, projection_options, kernels,
        needs_grad, results)
    per_token, coefficients = results["per_token"], results["coefficients"]

    def scatter(values, dtype=torch.float32):
        full = torch.zeros(batch.mask.numel(), dtype=dtype, device=hidden.device)
        if values is not None and values.numel():
            full[active] = values.reshape(-1).to(dtype)
        return full.reshape(batch.mask.shape)

    if options.sequence_level:  # the objective ran on the whole grid
        log_ratio, psi, region, kl = (coefficients.log_ratio, coefficients.psi, coefficients.region, coefficients.kl)
    elif coefficients is not None:
        log_ratio, psi, kl = (scatter(v) if v is not None else None
                              for v in (coefficients.log_ratio, coefficients.psi, coefficients.kl))
        region = scatter(coefficients.region, torch.int8)
    else:  # no unmasked token
        log_ratio = psi = scatter(None)
        region, kl = scatter(None, torch.int8), None
    logps, entropy = scatter(per_token["logp"]), scatter(per_token["entropy"])
    metrics = policy_metrics(log_ratio, psi, region, entropy, kl, batch.mask)
    return PolicyLossOutput(loss.to(torch.float32) if weight.dtype != torch.float64 else loss,
                            batch.unflatten(logps), batch.unflatten(entropy), metrics)


def fused_linear_dgpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    aggregation: str = "token_mean",
    loss_normalizer: float | torch.Tensor | None = None,
    beta: float = 0.0,
    entropy_coef: float = 0.0,
    importance_sampling_level: str = "token",
    rollout_weights: torch.Tensor | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    backend: str = "auto",
    **method_params,
) -> PolicyLossOutput:
    """Policy loss of ``method`` from hidden states ``(B, T, H)`` or ``(N, H)`` and the lm_head
    ``weight`` ``(V, H)`` (and ``bias``), as ``fused_dgpo_loss(softcap(logit_scale (hidden @ weight.T + bias)))``
    without materialising the logits. ``memory_budget`` bounds the fp32 logits tiles (bytes).
    Gradients flow to ``hidden``, ``weight`` and ``bias``; tied embeddings need nothing special."""
    options = LossOptions.build(
        method, temperature=temperature, aggregation=aggregation, beta=beta, entropy_coef=entropy_coef,
        importance_sampling_level=importance_sampling_level, backend=backend, **method_params,
    )
    projection_options = ProjectionOptions(logit_scale=logit_scale, softcap=softcap, memory_budget=memory_budget)
    return fused_linear_loss_from_options(hidden, weight, bias, target_ids, advantages, mask, old_logps, ref_logps,
                                          options, projection_options, loss_normalizer, rollout_weights)


@torch.no_grad()
def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only (old-policy and reference log-probs): per-token log-probs and entropies, fp32,
    shaped like ``target_ids``, 0 on masked tokens. One GEMM pass, no gradient work."""
    advantages = torch.zeros(target_ids.shape, device=hidden.device)
    out = fused_linear_dgpo_loss(hidden, weight, target_ids, advantages, mask, bias=bias, method="grpo",
                                 temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                                 memory_budget=memory_budget, backend=backend)
    return out.logps, out.entropy
