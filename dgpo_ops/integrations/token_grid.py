"""What the verl and SkyRL plugins share: both frameworks hand a registered policy loss the current log-probs
(differentiable), the old ones, the advantages and a mask on one padded ``(batch, response_length)`` grid, and
expect a scalar and Python-float metrics back. Each plugin checks the inputs under its framework's names (the
errors name them so), then calls ``dgpo_ops.policy_loss(inputs, options, logps=..., token_scales=...)`` with its
framework's normalisation as the per-token scales.
"""

from __future__ import annotations

import torch

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


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over the scored tokens, fp32 (0 where there is none)."""
    count = mask.sum().clamp(min=1).to(torch.float32)
    return torch.where(mask, values.to(torch.float32), 0.0).sum() / count


def to_host(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Python floats for a framework's logging, read to the host in one transfer."""
    if not values:
        return {}
    return dict(zip(values, torch.stack([value.to(torch.float32) for value in values.values()]).tolist()))
