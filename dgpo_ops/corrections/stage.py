"""The rollout-correction stage of a loss call: before any route (padded, packed, split vocabulary, fused
linear, compiled), the caller's ``rollout_logps`` and ``old_logps`` become per-token ``rollout_weights`` and a
shrunk mask, so every route runs the correction's one copy of the math and needs nothing of its own. The
inputs it reads are per-token values every process of a split vocabulary holds whole, so each computes the same
correction."""

from __future__ import annotations

import torch

from dgpo_ops.corrections.core import CorrectionInputs, CorrectionResult, mismatch_metrics, weight_metrics
from dgpo_ops.kernels.interface import IGNORE_INDEX, InputError
from dgpo_ops.kernels.torch_twins import above_zero


def _flat_tokens(name: str, value, token_shape, device) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if value.shape != token_shape:
        raise ValueError(f"{name} must have the shape of target_ids, {tuple(token_shape)}, got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but target_ids are on {device}")
    return value.detach().reshape(-1).to(torch.float32)


def correction_inputs(batch, cu_seqlens=None) -> CorrectionInputs:
    """The stage's view of ``batch`` (a ``LossInputs``): target ids ``(B, T)`` (each row a response), ``(N,)``
    packed with ``cu_seqlens``, or ``(N,)`` flat (no responses)."""
    target_ids = batch.target_ids
    if not torch.is_tensor(target_ids) or target_ids.dim() not in (1, 2):
        raise ValueError("target_ids must be a (B, T) or (N,) tensor")
    shape, device = target_ids.shape, target_ids.device
    if batch.old_logps is None:
        raise ValueError("rollout_logps need old_logps: a rollout correction compares the inference engine's "
                         "log-probs with the trainer's log-probs of the sampling-time policy")
    scored = target_ids.reshape(-1) != IGNORE_INDEX
    if batch.mask is not None:
        if not torch.is_tensor(batch.mask) or batch.mask.shape != shape:
            got = tuple(batch.mask.shape) if torch.is_tensor(batch.mask) else type(batch.mask).__name__
            raise ValueError(f"mask must have shape {tuple(shape)}, got {got}")
        scored = scored & (batch.mask.detach().reshape(-1) != 0)
    if cu_seqlens is not None:  # the route's PackedLayout checks the boundaries' values; the map needs their form
        if target_ids.dim() != 1:
            raise ValueError(f"packed tokens (cu_seqlens) have (total_tokens,) target_ids, got {tuple(shape)}")
        if (not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
                or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.device != device):
            raise ValueError("cu_seqlens must be a 1-D int32 or int64 tensor of at least two boundaries on the "
                             "tokens' device, [0, len_0, len_0 + len_1, ..., total_tokens]")
        n_sequences = cu_seqlens.numel() - 1
        token = torch.arange(shape.numel(), device=device)
        sequence = torch.searchsorted(cu_seqlens.to(torch.int64)[1:], token, right=True).clamp(max=n_sequences - 1)
    elif target_ids.dim() == 2:
        n_sequences = shape[0]
        sequence = torch.arange(n_sequences, device=device).repeat_interleave(shape[1])
    else:
        n_sequences, sequence = 0, None
    return CorrectionInputs(_flat_tokens("old_logps", batch.old_logps, shape, device),
                            _flat_tokens("rollout_logps", batch.rollout_logps, shape, device),
                            scored, sequence, n_sequences)


def refuse_non_finite_weights(correction, inputs: CorrectionInputs, result: CorrectionResult) -> None:
    """A ``ValueError`` naming the correction and ``rollout_logps`` where the weights it computed are not finite
    on a token that stays scored (the routes would refuse them as a ``rollout_weights`` the caller never passed).
    Host reads: only where validation is immediate."""
    kept = inputs.mask if result.keep is None else inputs.mask & result.keep
    bad = kept & ~torch.isfinite(result.weights)
    if not bad.any():
        return
    from_logps = bad & ~(torch.isfinite(inputs.rollout_logps) & torch.isfinite(inputs.old_logps))
    raise ValueError(
        f"rollout_correction {correction!r} computed non-finite weights from rollout_logps and old_logps on "
        f"{int(bad.sum())} scored token(s), {int(from_logps.sum())} of them with a NaN or infinite log-prob (the "
        "engine gave none), the others an overflowing ratio (an exponentiated sequence sum with no upper bound): "
        "mask those tokens out, or use a mode that bounds or sanitises the weight, as the framework's loss would "
        "otherwise be NaN or inf")


def refused_values(batch, inputs: CorrectionInputs) -> torch.Tensor:
    """The scored tokens holding a value the routes refuse (a mask value other than 0 and 1, a NaN or infinite
    old log-prob): a rejection never takes them out of the mask, so the route's own check (immediate or deferred)
    still sees and refuses them, as it does for every other token, and as the frameworks do before they mask."""
    bad = inputs.mask & ~torch.isfinite(inputs.old_logps)
    if batch.mask is not None and batch.mask.dtype != torch.bool:
        values = batch.mask.detach().reshape(-1)
        bad = bad | (inputs.mask & (values != 1))  # scored means non-zero here
    return bad


def rollout_logps_errors(inputs: CorrectionInputs) -> torch.Tensor:
    """``InputError.ROLLOUT_LOGPS`` where ``rollout_logps`` are above 0 beyond rounding on a scored token
    (probabilities, or shifted log-probs: every correction would weigh by a quietly wrong ratio), else 0: an
    int64 scalar on the device, no host read (the call raises it now or poisons its loss and names it later,
    ``dgpo_ops.api``). A NaN is no error here: an engine may give none for a token, and the corrections treat it
    as such."""
    above = (inputs.mask & above_zero(inputs.rollout_logps)).any()
    return torch.where(above, int(InputError.ROLLOUT_LOGPS), 0)


def apply_rollout_correction(batch, correction, cu_seqlens=None, immediate: bool = True):
    """``(batch, metrics, errors)``: the batch the routes run on (the correction's weights as
    ``rollout_weights``, its rejections out of the mask, no ``rollout_logps``), the stage's metrics and
    ``rollout_logps_errors``; ``(batch, None, None)`` for a call without ``rollout_logps``. Where the call's
    validation is ``immediate`` (and not while compiling) non-finite weights are refused here, by the
    correction's name; otherwise the route's own check refuses them later (deferred: NaN, then an error naming
    rollout_weights and rollout_correction)."""
    if batch.rollout_logps is None:
        if correction is not None:
            raise ValueError(f"rollout_correction {correction!r} needs rollout_logps (the inference engine's "
                             "per-token log-probs) and old_logps")
        return batch, None, None
    if correction is not None and batch.rollout_weights is not None:
        raise ValueError("pass rollout_weights or a rollout_correction, not both: the correction computes the "
                         "rollout weights from rollout_logps")
    inputs = correction_inputs(batch, cu_seqlens)
    errors = rollout_logps_errors(inputs)
    result = CorrectionResult() if correction is None else correction(inputs)
    if result.weights is not None and immediate and not torch.compiler.is_compiling():
        refuse_non_finite_weights(correction, inputs, result)
    metrics = mismatch_metrics(inputs)
    if correction is not None:
        metrics.update(weight_metrics(inputs, result))
        metrics.update(result.metrics or {})
    shape = batch.target_ids.shape
    changes = {"rollout_logps": None}
    if result.weights is not None:
        changes["rollout_weights"] = result.weights.reshape(shape)
    if result.keep is not None:
        keep = (result.keep | refused_values(batch, inputs)).reshape(shape)
        # the caller's mask values where kept (its checks still apply to them), 0 where rejected
        changes["mask"] = keep & (batch.target_ids != IGNORE_INDEX) if batch.mask is None else torch.where(
            keep, batch.mask, torch.zeros_like(batch.mask))
    return batch._replace(**changes), metrics, errors
