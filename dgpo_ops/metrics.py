"""Per-call metrics (masked means over unmasked tokens), as 0-dim fp32 tensors: no host sync."""

from __future__ import annotations

import torch

from .methods import Region

REGION_METRICS = {
    "ln_fraction": Region.LN,
    "hp_fraction": Region.HP,
    "lp_fraction": Region.LP,
    "hn_fraction": Region.HN,
    "dual_clip_fraction": Region.DUAL,
}


def policy_metrics(
    log_ratio: torch.Tensor,
    psi: torch.Tensor,
    region: torch.Tensor,
    entropy: torch.Tensor,
    kl: torch.Tensor | None,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    count = mask.sum().clamp(min=1).to(torch.float32)

    def masked_mean(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values.detach().to(torch.float32), 0.0).sum() / count

    ratio = torch.exp(log_ratio)
    metrics = {name: masked_mean(region == code) for name, code in REGION_METRICS.items()}
    metrics["ratio_mean"] = masked_mean(ratio)
    # Effective update ratio: the share of the on-policy gradient a token keeps.
    metrics["eur"] = masked_mean(psi / ratio)
    metrics["entropy_mean"] = masked_mean(entropy)
    metrics["kl_mean"] = masked_mean(kl) if kl is not None else torch.zeros((), device=mask.device)
    return metrics
