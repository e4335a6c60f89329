"""A framework's policy-loss call on padded ``(batch, response_length)`` per-token log-probs, as the package's torch
objective: what the verl and SkyRL plugins share. Both frameworks hand a registered policy loss the current
log-probs (differentiable), the old ones, the advantages and a mask on one grid, and expect a scalar back; each
plugin names the inputs as its framework does (the errors name them so) and brings its own per-token scales (its
aggregation) and rollout weights.
"""

from __future__ import annotations

import torch

from dgpo_ops.core.inputs import TokenBatch
from dgpo_ops.core.metrics import policy_metrics
from dgpo_ops.core.objective import ObjectiveTerms, policy_objective
from dgpo_ops.core.options import LossOptions
from dgpo_ops.kernels.interface import Region

# The package's own metrics, beside each framework's: fractions of the scored tokens in each region of the
# method's atlas, the mean ratio and the effective update ratio.
OWN_METRICS = ("ln_fraction", "hp_fraction", "lp_fraction", "hn_fraction", "dual_clip_fraction", "ratio_mean", "eur")


def grid_log_probs(name: str, log_prob) -> torch.dtype:
    """Check the current log-probs ``(B, T)``; the dtype the objective runs in (fp32 at least)."""
    if not torch.is_tensor(log_prob) or log_prob.dim() != 2 or not log_prob.is_floating_point():
        raise ValueError(f"{name} must be a floating-point (batch, response_length) tensor")
    return torch.promote_types(log_prob.dtype, torch.float32)


def grid_tensor(name: str, value, log_prob: torch.Tensor) -> torch.Tensor:
    """``value`` checked to lie on ``log_prob``'s grid: a tensor of its shape, on its device."""
    shape, device = log_prob.shape, log_prob.device
    if not torch.is_tensor(value):
        raise ValueError(f"{name} must be a tensor of shape {tuple(shape)}, got {type(value).__name__}")
    if value.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} (the log-probs'), got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the log-probs are on {device}")
    return value


def grid_objective(options: LossOptions, log_prob: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor,
                   advantages: tuple[str, torch.Tensor], old_logps: tuple[str, torch.Tensor],
                   rollout_weights: tuple[str, torch.Tensor | None] = ("rollout_weights", None),
                   ) -> tuple[ObjectiveTerms, torch.Tensor, TokenBatch]:
    """``(terms, logp, batch)``: the objective on ``log_prob`` (its ``terms.loss`` is ``sum(scale * L)`` over the
    ``mask``), the log-probs it read (detached, 0 off the mask) and the batch it ran on. ``advantages``,
    ``old_logps`` and ``rollout_weights`` are ``(the framework's name, tensor)`` pairs, checked against the grid
    and detached; each is 0 where not scored, so nothing from a padded position reaches the loss."""
    dtype = grid_log_probs("log_probs", log_prob)

    def on_grid(named):
        name, value = named
        if value is None:
            return None
        return torch.where(mask, grid_tensor(name, value, log_prob).detach().to(dtype), 0.0)

    batch = TokenBatch(target_ids=None, mask=mask, advantages=on_grid(advantages),  # no targets: the objective
                       old_logps=on_grid(old_logps), ref_logps=None,  # reads the log-probs themselves
                       rollout_weights=on_grid(rollout_weights), scale=scale.to(dtype), flat=False)
    logp = torch.where(mask, log_prob.to(dtype), 0.0)
    terms = policy_objective(logp, None, batch, options)
    return terms, logp.detach(), batch


def grid_metrics(terms: ObjectiveTerms, batch: TokenBatch) -> dict[str, torch.Tensor]:
    """``OWN_METRICS`` of one call (0-dim tensors, on the device)."""
    ours = policy_metrics(terms.log_ratio, terms.tokens.psi, terms.tokens.region,
                          torch.zeros_like(terms.log_ratio), None, batch.mask)
    return {name: ours[name] for name in OWN_METRICS}


def ppo_clip_fraction(terms: ObjectiveTerms, mask: torch.Tensor) -> torch.Tensor:
    """The fraction of the scored tokens in LN or HP, where PPO's clip zeroes the gradient: verl's
    ``pg_clipfrac`` and SkyRL's ``clip_ratio``."""
    region = terms.tokens.region
    return masked_mean((region == Region.LN.value) | (region == Region.HP.value), mask)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over the scored tokens, fp32 (0 where there is none)."""
    count = mask.sum().clamp(min=1).to(torch.float32)
    return torch.where(mask, values.to(torch.float32), 0.0).sum() / count


def to_host(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Python floats for a framework's logging, read to the host in one transfer."""
    if not values:
        return {}
    return dict(zip(values, torch.stack([value.to(torch.float32) for value in values.values()]).tolist()))
