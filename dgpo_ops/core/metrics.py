"""Per-call metrics: masked means over scored tokens, held on the device as one fp32 vector.

``LossMetrics`` is a read-only mapping from metric name to a 0-dim tensor. The fused ops fill its
vector in the finalize kernel, so producing the metrics costs no op per metric; a value is sliced
out only when it is read (TRL's logging reads them once per step), and ``as_tensor()`` hands the
whole vector over for one reduction across processes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dgpo_ops.kernels.interface import NUM_STATS, Region, Stat

METRIC_NAMES = tuple(stat.name.lower() for stat in Stat)
REGION_METRICS = {
    "ln_fraction": Region.LN,
    "hp_fraction": Region.HP,
    "lp_fraction": Region.LP,
    "hn_fraction": Region.HN,
    "dual_clip_fraction": Region.DUAL,
}


class LossMetrics(Mapping):
    """``metrics["eur"]`` is a 0-dim fp32 tensor on the loss's device; no value is read on the host.

    ``rollout``: the metrics of the rollout-correction stage (``dgpo_ops.corrections``), present only in calls
    given ``rollout_logps``; they follow ``METRIC_NAMES`` in iteration, but not in ``as_tensor()`` (the
    vector whose layout the kernels and the trainer's logging fix)."""

    def __init__(self, stats: torch.Tensor, rollout: Mapping[str, torch.Tensor] | None = None):
        if stats.shape != (NUM_STATS,):
            raise ValueError(f"expected a ({NUM_STATS},) statistics vector, got {tuple(stats.shape)}")
        self._stats = stats
        self._rollout = dict(rollout or {})

    def with_rollout(self, rollout: Mapping[str, torch.Tensor]) -> "LossMetrics":
        """These metrics and the rollout-correction stage's."""
        return LossMetrics(self._stats, {**self._rollout, **rollout})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._rollout:
            return self._rollout[name]
        try:
            slot = Stat[name.upper()]
        except KeyError:
            raise KeyError(name) from None
        return self._stats[slot]

    def __iter__(self):
        yield from METRIC_NAMES
        yield from self._rollout

    def __len__(self) -> int:
        return NUM_STATS + len(self._rollout)

    def as_tensor(self) -> torch.Tensor:
        """The metrics in ``METRIC_NAMES`` order, as one ``(NUM_STATS,)`` fp32 tensor."""
        return self._stats

    def __repr__(self) -> str:
        return f"LossMetrics({', '.join(self)})"


def policy_metrics(
    log_ratio: torch.Tensor,
    psi: torch.Tensor,
    region: torch.Tensor,
    entropy: torch.Tensor,
    kl: torch.Tensor | None,
    mask: torch.Tensor,
) -> LossMetrics:
    """The metrics from per-token tensors with torch ops (the reference and the objective route)."""
    count = mask.sum().clamp(min=1).to(torch.float32)

    def masked_mean(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values.detach().to(torch.float32), 0.0).sum() / count

    ratio = torch.exp(log_ratio)
    values = {name: masked_mean(region == int(code)) for name, code in REGION_METRICS.items()}
    values["ratio_mean"] = masked_mean(ratio)
    values["eur"] = masked_mean(psi / ratio)
    values["entropy_mean"] = masked_mean(entropy)
    values["kl_mean"] = masked_mean(kl) if kl is not None else torch.zeros((), device=mask.device)
    return LossMetrics(torch.stack([values[name] for name in METRIC_NAMES]))
