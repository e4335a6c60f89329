"""TRL's metrics in ``DGPOTrainer``: TRL's names and definitions for what the fused ops report, dgpo-ops'
own metrics beside them (``tests/trainer/test_trainer_conformance.py`` compares each with ``GRPOTrainer``'s).
The base of ``loss.FusedLoss``, which calls them with the loss's method; they read nothing else of the trainer
but ``GRPOTrainer``'s own state (``args``, ``accelerator``, ``_metrics``, ``beta``, ``get_gamma_weights``)."""

from __future__ import annotations

import math

import torch
from dgpo_ops.kernels.interface import LOG_RATIO_CLAMP, Region
from trl.trainer.utils import nanmax, nanmin

from dgpo_ops.core.metrics import METRIC_NAMES
from dgpo_ops.core.validation import raise_deferred_errors
from dgpo_ops.methods import gspo
from dgpo_ops.methods.base import SequenceInputs
from dgpo_ops.methods.table import token_terms

from .advantages import per_token_advantages

# dgpo-ops metric -> the name logged (TRL's where the meaning is the same)
LOGGED_METRICS = {
    "ln_fraction": "clip_ratio/low_mean",
    "hp_fraction": "clip_ratio/high_mean",
    "lp_fraction": "clip_ratio/lp_mean",
    "hn_fraction": "clip_ratio/hn_mean",
    "dual_clip_fraction": "clip_ratio/dual_mean",
    "eur": "eur",
    "ratio_mean": "ratio_mean",
    "entropy_mean": "entropy",
}


class TRLMetrics:
    """The metrics of each loss call of a ``GRPOTrainer``, in TRL's ``_metrics``: ``FusedLoss``'s base."""

    @torch.no_grad()
    def _log_vespo_weights(self, method, inputs, logps, old_logps, advantages, mask, mode):
        """TRL's ``vespo/phi_seq_mean``: its own gamma weights (``get_gamma_weights``) of the current log-probs,
        averaged over the sequences of every process."""
        log_ratio = logps - (logps if old_logps is None else old_logps)
        phi = self.get_gamma_weights(
            per_token_advantages(advantages), log_ratio, mask,
            inputs.get("importance_sampling_ratio"), k_pos=method.k_pos, lambda_pos=method.lambda_pos,
            k_neg=method.k_neg, lambda_neg=method.lambda_neg)
        totals = self.accelerator.reduce(torch.stack([phi.sum(), torch.tensor(float(phi.numel()), device=phi.device)]),
                                         reduction="sum")
        self._metrics[mode]["vespo/phi_seq_mean"].append((totals[0] / totals[1].clamp(min=1.0)).item())

    @torch.no_grad()
    def _clip_fractions(self, method, logps, old_logps, advantages, scored):
        """Per sequence, the fraction of its scored tokens below the trust region with A < 0 (the method's ln
        region: TRL's ``is_low_clipped``) and above it with A > 0 (hp: ``is_high_clipped``), NaN for a sequence
        without any (TRL's ``masked_seq_mean``); and each sequence's weight in TRL's global mean: its token count,
        or 1 under ``importance_sampling_level="sequence"`` (TRL's (B, 1) ratios)."""
        logp = torch.where(scored, logps, 0.0)
        old = logp if old_logps is None else torch.where(scored, old_logps.to(logp.dtype), 0.0)
        log_ratio = logp - old
        sequence_level = self.args.importance_sampling_level == "sequence"  # TRL's coef_1
        if sequence_level:
            log_ratio = gspo.mean_log_ratio(method, SequenceInputs(log_ratio, None, scored, None))
        delta = getattr(method, "delta", None)
        if delta is not None:  # TRL's metrics read the ratio its two-sided clip capped
            log_ratio = log_ratio.clamp(max=math.log(delta))
        adv = per_token_advantages(advantages).to(logp.dtype).expand_as(logp)
        # (a batch-level selection draws nothing here: the regions TRL's metrics read are PPO's)
        region = token_terms(method, log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), adv, old,
                             logp=logp, scored=torch.zeros_like(scored)).region
        counts = scored.sum(-1).float()
        low = ((region == Region.LN.value) & scored).sum(-1) / counts
        high = ((region == Region.HP.value) & scored).sum(-1) / counts
        if sequence_level:  # TRL's ratio of a sequence without tokens is 1: not clipped
            return low.nan_to_num(0.0), high.nan_to_num(0.0), torch.ones_like(counts)
        return low, high, counts

    def _log_loss_metrics(self, method, stats, logps, old_logps, advantages, mask, mode):
        """TRL's metrics under TRL's names and definitions, ours beside them. The masked means are reduced
        across processes as (sum, count) in one vector, like TRL's global_masked_mean: one reduction and
        one host read (TRL's logging reads its metrics too), and one gather for the per-sequence extremes.
        Input errors the step's kernels found on the device (deferred validation) are raised after that read,
        which waited for them: at no extra synchronisation."""
        scored = mask.bool()
        count = scored.sum().float()
        low, high, weights = self._clip_fractions(method, logps, old_logps, advantages, scored)
        clip_sums = torch.stack([(low * weights).nansum(), (high * weights).nansum(), weights.sum()])
        local = torch.cat([stats * count, count[None], clip_sums])
        totals = self.accelerator.reduce(local, reduction="sum").tolist()
        n = len(METRIC_NAMES)
        means = {name: totals[i] / max(totals[n], 1.0) for i, name in enumerate(METRIC_NAMES)}
        low_mean, high_mean = totals[n + 1] / max(totals[n + 3], 1.0), totals[n + 2] / max(totals[n + 3], 1.0)
        raise_deferred_errors()
        metrics = self._metrics[mode]
        for name, logged in LOGGED_METRICS.items():
            metrics[logged].append(means[name])
        if self.beta != 0.0:
            metrics["kl"].append(means["kl_mean"])
        metrics["clip_ratio/low_mean"][-1] = low_mean  # TRL's: per sequence under sequence-level ratios
        metrics["clip_ratio/high_mean"][-1] = high_mean
        metrics["clip_ratio/region_mean"].append(low_mean + high_mean)
        metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(low)).item())
        metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(high)).item())
        if method.name == "cispo":  # TRL's CISPO metric: weights at the cap, A > 0
            metrics["cispo_clip_ratio"].append(high_mean)
