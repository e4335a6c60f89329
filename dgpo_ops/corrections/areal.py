"""AReaL's decoupled PPO corrections (``areal/utils/functional/functional.py: apply_rejection_sampling`` and
``areal/trainer/ppo/actor.py``'s M2PO masking). AReaL has three policies: the current one, the proximal one (a
recomputed forward pass: here ``old_logps``) and the behaviour one that sampled (the inference engine's: here
``rollout_logps``). Its decoupled loss is PPO's clip against the proximal policy (a method row such as grpo
with ``dual_clip`` for AReaL's ``c_clip``), times the behaviour weight ``pi_prox / pi_behave`` this stage gives.

* the behaviour weight (``PPOActorConfig.rejection_sampling``): a metric of the proximal-behaviour gap (the ratio,
  or the k1, k2, k3 estimates of it) per token or aggregated per sequence (sum, mean or max; the ratio in log
  space, so its sequence weight is the geometric mean), out-of-bounds tokens or sequences masked (their weight
  0; the normaliser keeps counting them, as AReaL's ``loss_mask_count`` is taken before rejection) or their
  ratio clamped;
* M2PO (``m2_threshold``): the scored tokens of largest ``(behave - prox)^2`` leave the mask until the mean of
  the rest is under the threshold (at most all but one), before anything else, so the normaliser counts only the
  tokens kept, as AReaL's loss function (given the masked ``loss_mask``) does. One sort and a suffix mean on the
  device, no host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpo_ops.corrections.core import (KL_ESTIMATORS, CorrectionInputs, CorrectionResult, RolloutCorrection,
                                       check_branches, check_known, check_number, kl_estimates)

LEVELS = ("token", "sequence")
ACTIONS = ("mask", "clamp")
METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
AGGREGATIONS = ("sum", "mean", "max")
# whether a level bounds each response's aggregated metric (else each token's own)
LEVEL_PER_RESPONSE = {"token": False, "sequence": True}
# whether an action zeroes the weight outside the bounds (else clamps it into them)
ACTION_MASKS = {"mask": True, "clamp": False}
# each metric's KL estimator (a key of kl_estimates); None: the ratio itself, aggregated in log space
METRIC_ESTIMATORS = {"ratio": None, "kl_k1": "k1", "kl_k2": "k2", "kl_k3": "k3"}
SEQUENCE_AGGREGATIONS = {"sum": lambda x, values: x.sequence_sum(values, "AReaL's sequence level"),
                         "mean": lambda x, values: x.sequence_mean(values, "AReaL's sequence level"),
                         "max": lambda x, values: x.sequence_max(values, empty=0.0)}


def check_dispatch() -> None:
    """Every level, action, metric and aggregation has its branch (run at import)."""
    for field, values, branches in (("level", LEVELS, LEVEL_PER_RESPONSE), ("action", ACTIONS, ACTION_MASKS),
                                    ("metric", METRICS, METRIC_ESTIMATORS),
                                    ("agg", AGGREGATIONS, SEQUENCE_AGGREGATIONS)):
        check_branches(f"AReaL's rejection_sampling.{field}", values, branches)
    check_known("AReaL's KL metrics", [name for name in METRIC_ESTIMATORS.values() if name is not None],
                KL_ESTIMATORS)


check_dispatch()


def m2po_keep(x: CorrectionInputs, threshold: float) -> torch.Tensor:
    """AReaL's M2PO mask on the scored tokens: sorted by ``m2 = (behave - prox)^2`` descending, the first ``k``
    leave, ``k`` the first index whose suffix mean is under ``threshold`` (``n - 1`` if none is)."""
    m2 = (x.rollout_logps - x.old_logps) ** 2
    # unscored tokens sort last (-inf) and never count: the scored ones are the first n of the order
    order = torch.sort(torch.where(x.mask, m2, float("-inf")), descending=True).indices
    sorted_m2 = m2[order]
    n = x.mask.sum()
    position = torch.arange(m2.numel(), device=m2.device)
    in_scored = position < n
    suffix_sum = torch.where(in_scored, sorted_m2, 0.0).flip(0).cumsum(0).flip(0)
    suffix_mean = suffix_sum / (n - position).clamp(min=1).to(m2.dtype)
    below = in_scored & (suffix_mean < threshold)
    first_below = torch.where(below, position, m2.numel()).min() if m2.numel() else n
    n_drop = torch.where(below.any(), first_below, n - 1).clamp(min=0)
    keep_sorted = position >= n_drop
    return torch.empty_like(x.mask).scatter(0, order, keep_sorted) | ~x.mask


@dataclass(frozen=True)
class ArealCorrection(RolloutCorrection):
    """AReaL's ``RejectionSamplingConfig`` fields (its defaults: token, mask, ratio, mean, upper 5.0, no lower),
    ``rejection_sampling=False`` for none, and ``PPOActorConfig.m2_threshold`` (None: no M2PO)."""

    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    agg: str = "mean"
    upper: float = 5.0
    lower: float | None = None
    rejection_sampling: bool = True
    m2_threshold: float | None = None

    def __post_init__(self):
        for name, allowed in (("level", LEVELS), ("action", ACTIONS), ("metric", METRICS), ("agg", AGGREGATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"AReaL's rejection_sampling.{name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")
        check_number("upper", self.upper)
        check_number("lower", self.lower, optional=True)
        check_number("m2_threshold", self.m2_threshold, optional=True)
        if not isinstance(self.rejection_sampling, bool):
            raise ValueError(f"rejection_sampling must be a bool, got {self.rejection_sampling!r}")
        if not self.rejection_sampling and self.m2_threshold is None:
            raise ValueError("ArealCorrection needs rejection_sampling or an m2_threshold")
        if self.m2_threshold is not None and self.m2_threshold <= 0:
            raise ValueError(f"m2_threshold must be > 0, got {self.m2_threshold}")
        # AReaL's RejectionSamplingConfig checks
        if self.metric == "ratio" and (self.upper <= 1.0 or (self.lower is not None and self.lower <= 0)):
            raise ValueError("metric 'ratio' needs upper > 1 and lower > 0 (or None), as AReaL requires")
        if self.metric != "ratio" and self.upper <= 0:
            raise ValueError(f"metric {self.metric!r} needs upper > 0, as AReaL requires")
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError("action 'clamp' applies to metric 'ratio' only, as in AReaL")
        if self.lower is not None and self.lower > self.upper:
            raise ValueError(f"lower ({self.lower}) must be <= upper ({self.upper})")

    def __call__(self, x: CorrectionInputs) -> CorrectionResult:
        keep = None
        metrics = {}
        if self.m2_threshold is not None:
            keep = m2po_keep(x, self.m2_threshold)
            metrics["m2po_masked_fraction"] = x.token_mean((~keep).float())
            x = x._replace(mask=x.mask & keep)
        weights = None
        if self.rejection_sampling:
            weights, metrics["rs_filtered_fraction"] = self.behaviour_weight(x)
        return CorrectionResult(weights, keep, metrics)

    def in_bounds(self, metric: torch.Tensor) -> torch.Tensor:
        inside = metric <= self.upper
        return inside if self.lower is None else inside & (metric >= self.lower)

    def behaviour_weight(self, x: CorrectionInputs):
        """AReaL's ``apply_rejection_sampling``: the weight (0 where it masks) and its filtered fraction."""
        difference = x.log_ratio  # log pi_prox / pi_behave
        log_ratio = torch.where(torch.isfinite(difference), difference, 0.0)
        estimator = METRIC_ESTIMATORS[self.metric]
        is_ratio = estimator is None
        if is_ratio:
            metric = torch.exp(log_ratio)
        else:  # AReaL's KLEstimator._compute_approx_kl(prox, behave): its log-ratio is behave - prox, unsanitised
            metric = kl_estimates(-difference)[estimator]
        weight = torch.exp(log_ratio)
        lower = self.lower if self.lower is not None else 0.0
        per_response = LEVEL_PER_RESPONSE[self.level]
        if per_response:
            values = log_ratio if is_ratio else metric
            if is_ratio:  # the weight is the sequence's geometric mean
                weight = x.to_tokens(torch.exp(x.sequence_mean(log_ratio, "AReaL's sequence level")))
            aggregate = SEQUENCE_AGGREGATIONS[self.agg](x, values)
            inside = x.to_tokens(self.in_bounds(torch.exp(aggregate) if is_ratio else aggregate))
        else:
            inside = self.in_bounds(metric)
        if ACTION_MASKS[self.action]:
            filtered = x.token_mean((~inside).float())
            return torch.where(x.mask & inside, weight, 0.0), filtered
        clamped = weight.clamp(min=lower, max=self.upper)
        if per_response:  # only the out-of-bounds sequences' tokens are clamped
            clamped = torch.where(inside, weight, clamped)
        filtered = x.token_mean((clamped != weight).float())
        return torch.where(x.mask, clamped, 0.0), filtered


def m2po(m2_threshold: float, **rejection_sampling) -> ArealCorrection:
    """AReaL's M2PO: ``m2_threshold`` with no behaviour weight unless ``rejection_sampling`` fields are given."""
    return ArealCorrection(m2_threshold=m2_threshold, rejection_sampling=bool(rejection_sampling),
                           **rejection_sampling)


def decoupled_ppo(**rejection_sampling) -> ArealCorrection:
    """AReaL's decoupled PPO behaviour weight (``use_decoupled_loss=True`` with ``rejection_sampling``; its
    defaults unless fields are given); pair it with a PPO-clip method (grpo, with ``dual_clip`` for ``c_clip``)."""
    return ArealCorrection(**rejection_sampling)
