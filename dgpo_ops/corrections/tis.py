"""The tis / icepop / seq-mask-tis family as OpenRLHF (``openrlhf/models/loss.py: PolicyLoss``, with its binary-KL
and total-variation gates) and NeMo-RL
(``nemo_rl/algorithms/loss/loss_functions.py: ClippedPGLossFn``) apply it: the token ratio
``pi_old / pi_rollout`` truncated to ``[L, U]`` (tis), zeroed outside it (icepop, bounds kept), or kept raw on the
responses whose geometric-mean ratio lies in ``[L, U]`` and zeroed on the others (seq-mask-tis: the token weights
are NOT truncated, whatever OpenRLHF's comment says). No clamp before the exponential. Every mode zeroes a weight
and keeps the normaliser.

The two differ only where a value is not finite or a response is empty, so they are two classes over one math:
NeMo-RL maps NaN and +-inf weights to 0 (``nan_to_num``) and NaN log-ratios to 0 in the geometric mean, whose
``masked_mean`` adds ``1e-8`` to the count; OpenRLHF does neither (an empty response's mean is NaN, so it is
masked). NeMo-RL also has the weight without truncation (``use_importance_sampling_correction`` alone: type None)
and the sequence product (``sequence_level_importance_ratios``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dgpo_ops.corrections.core import (CorrectionInputs, CorrectionResult, RolloutCorrection, check_branches,
                                       check_known, check_number, check_order)

TIS_TYPES = ("tis", "icepop", "seq-mask-tis")


class Truncation(NamedTuple):
    """One kind's weights ``(token_ratio, low, high, geometric_mean)``, and whether they read the response's
    geometric-mean ratio (per token, its response's; None for the kinds that do not)."""

    weights: Callable
    per_response: bool


# the mask kinds keep the survivors' ratio, 0 elsewhere (where: a NaN ratio, out of every band, gives 0, not NaN)
TRUNCATIONS = {
    "tis": Truncation(lambda ratio, low, high, geometric: ratio.clamp(min=low, max=high), per_response=False),
    "icepop": Truncation(lambda ratio, low, high, geometric: torch.where((ratio >= low) & (ratio <= high), ratio,
                                                                         0.0), per_response=False),
    "seq-mask-tis": Truncation(lambda ratio, low, high, geometric: torch.where(
        (geometric >= low) & (geometric <= high), ratio, 0.0), per_response=True),
}


def truncated_weights(kind: str, token_ratio, low, high, geometric_mean=None):
    """``token_ratio`` (per token) under ``kind``; ``geometric_mean`` (per token, its response's) for seq-mask-tis."""
    return TRUNCATIONS[kind].weights(token_ratio, low, high, geometric_mean)


OPENRLHF_LEVELS = ("token", "seq")  # "off" is no correction: rollout_correction=None
OPENRLHF_MODES = ("mask", "clip")
OPENRLHF_GATINGS = ("ratio", "binary_kl", "tv")
# whether a level's statistic is the response's (its geometric-mean ratio, or its mean gated statistic)
OPENRLHF_PER_RESPONSE = {"token": False, "seq": True}
# OpenRLHF's named schemes in its three fields (its --algo.advantage help): (level, mode) -> this module's kind
RATIO_SCHEMES = {("token", "clip"): "tis", ("token", "mask"): "icepop", ("seq", "mask"): "seq-mask-tis"}


def binary_kl(rollout_p: torch.Tensor, train_p: torch.Tensor) -> torch.Tensor:
    """The sampled token's KL between the two Bernoulli distributions ``(p, 1 - p)``."""
    return rollout_p * torch.log(rollout_p / train_p) + (1 - rollout_p) * torch.log((1 - rollout_p) / (1 - train_p))


# the gatings other than the ratio: a statistic of the sampled token's two probabilities, zeroed outside [0, delta]
PROBABILITY_GATES = {"binary_kl": binary_kl, "tv": lambda rollout_p, train_p: (rollout_p - train_p).abs()}


def refused_clip(level: str, mode: str, gating: str) -> bool:
    """OpenRLHF's ``clip`` mode is token level under ratio gating only."""
    return mode == "clip" and (level != "token" or gating != "ratio")


def check_dispatch() -> None:
    """Every type, level and gating, and every (level, mode) the ratio gating takes, has its branch (run at
    import)."""
    check_branches("truncated_importance_sampling_type", TIS_TYPES, TRUNCATIONS)
    check_branches("is_correction_level", OPENRLHF_LEVELS, OPENRLHF_PER_RESPONSE)
    check_branches("is_correction_gating", OPENRLHF_GATINGS, {"ratio": RATIO_SCHEMES, **PROBABILITY_GATES})
    taken = [(level, mode) for level in OPENRLHF_LEVELS for mode in OPENRLHF_MODES
             if not refused_clip(level, mode, "ratio")]
    check_branches("(is_correction_level, is_correction_mode) of the ratio gating", taken, RATIO_SCHEMES)
    check_known("the ratio gating's kinds", RATIO_SCHEMES.values(), TRUNCATIONS)


check_dispatch()


@dataclass(frozen=True)
class OpenRLHFCorrection(RolloutCorrection):
    """OpenRLHF 0.11.2's ``--algo.advantage.is_correction_level`` (token, seq), ``_mode`` (mask, clip),
    ``_gating`` (ratio, binary_kl, tv) and ``_threshold`` ``(LOW, HIGH)`` or a single HIGH (an upper bound only,
    ``(0, HIGH)``, as its CLI reads it); its defaults but the level, whose default ``off`` is no correction.
    OpenRLHF applies it with ``policy_loss_type='ppo'`` (``PolicyLoss.forward``): the gated statistic is the
    ratio ``pi_train / pi_rollout`` (per token, or the response's geometric mean) or the sampled token's
    binary KL / total variation between the two probabilities (clamped to ``[1e-6, 1 - 1e-6]``; per token or the
    response's mean); ``clip`` clamps the token ratio into the band (token level, ratio gating only), ``mask``
    zeroes the units outside it and keeps the survivors' raw token ratio."""

    is_correction_level: str = "token"
    is_correction_mode: str = "mask"
    is_correction_gating: str = "ratio"
    is_correction_threshold: tuple | float = (0.5, 5.0)

    def __post_init__(self):
        for name, allowed in (("is_correction_level", OPENRLHF_LEVELS), ("is_correction_mode", OPENRLHF_MODES),
                              ("is_correction_gating", OPENRLHF_GATINGS)):
            if getattr(self, name) not in allowed:
                off = " ('off' is no correction: pass rollout_correction=None)" if name.endswith("level") else ""
                raise ValueError(f"{name} must be one of {allowed}{off}, got {getattr(self, name)!r}")
        threshold = self.is_correction_threshold
        if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
            threshold = (0.0, threshold)  # a single value is an upper bound only, as OpenRLHF's CLI reads it
        if isinstance(threshold, (tuple, list)) and len(threshold) == 1:
            threshold = (0.0, threshold[0])
        if not isinstance(threshold, (tuple, list)) or len(threshold) != 2:
            raise ValueError(f"is_correction_threshold must be (LOW, HIGH) or a single HIGH, got {threshold!r}")
        for name, value in zip(("low", "high"), threshold):
            check_number(f"is_correction_threshold {name}", value, minimum=0.0)
        check_order("is_correction_threshold low", threshold[0], "high", threshold[1])
        object.__setattr__(self, "is_correction_threshold", tuple(float(v) for v in threshold))
        if refused_clip(self.is_correction_level, self.is_correction_mode, self.is_correction_gating):
            raise ValueError("is_correction_mode=clip requires is_correction_level=token and "
                             "is_correction_gating=ratio, as OpenRLHF requires")
        if self.is_correction_gating != "ratio" and self.is_correction_threshold[0] > 0:
            raise ValueError(f"is_correction_gating={self.is_correction_gating} takes an upper bound only (a single "
                             "delta), as OpenRLHF requires")

    def __call__(self, x: CorrectionInputs) -> CorrectionResult:
        low, high = self.is_correction_threshold
        log_ratio = x.log_ratio
        token_ratio = torch.exp(log_ratio)
        sequence_level = OPENRLHF_PER_RESPONSE[self.is_correction_level]
        if self.is_correction_gating == "ratio":
            kind = RATIO_SCHEMES[(self.is_correction_level, self.is_correction_mode)]
            geometric = None
            if sequence_level:  # OpenRLHF's sum / count (NaN for a response without tokens, whose weights nothing
                # reads: 0 here)
                geometric = x.to_tokens(torch.exp(x.sequence_mean(log_ratio, "OpenRLHF's seq level")))
            return CorrectionResult(weights=truncated_weights(kind, token_ratio, low, high, geometric))
        # float64: the binary KL of two close probabilities is a difference of near-equal terms, which float32
        # can round below 0, outside a [0, delta] band it lies in (an O(tokens) vector: no cost to speak of)
        rollout_p = torch.exp(x.rollout_logps.double()).clamp(1e-6, 1 - 1e-6)  # keeps the binary KL's logs finite
        train_p = torch.exp(x.old_logps.double()).clamp(1e-6, 1 - 1e-6)
        statistic = PROBABILITY_GATES[self.is_correction_gating](rollout_p, train_p)
        if sequence_level:
            statistic = x.to_tokens(x.sequence_mean(statistic, "OpenRLHF's seq level"))
        keep = (statistic >= low) & (statistic <= high)
        return CorrectionResult(weights=torch.where(keep, token_ratio, 0.0))


@dataclass(frozen=True)
class NemoRLCorrection(RolloutCorrection):
    """``ClippedPGLossConfig``'s ``truncated_importance_sampling_type`` (None: the untruncated weight of
    ``use_importance_sampling_correction``), ``truncated_importance_sampling_ratio`` (U),
    ``truncated_importance_sampling_ratio_min`` (L; tis: None is 0) and ``sequence_level_importance_ratios``."""

    truncated_importance_sampling_type: str | None = None
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_ratio_min: float | None = None
    sequence_level_importance_ratios: bool = False

    def __post_init__(self):
        kind, high, low = (self.truncated_importance_sampling_type, self.truncated_importance_sampling_ratio,
                           self.truncated_importance_sampling_ratio_min)
        if kind is None:
            if high is not None or low is not None:
                raise ValueError("truncated_importance_sampling_ratio(_min) need a truncated_importance_sampling_type")
        else:
            if kind not in TIS_TYPES:
                raise ValueError(f"truncated_importance_sampling_type must be one of {TIS_TYPES} or None, got "
                                 f"{kind!r}")
            check_number("truncated_importance_sampling_ratio", high, positive=True)  # NeMo-RL requires > 0
            if low is not None:
                check_number("truncated_importance_sampling_ratio_min", low, minimum=0.0)
                check_order("truncated_importance_sampling_ratio_min", low, "truncated_importance_sampling_ratio",
                            high)
            elif kind != "tis":
                raise ValueError(f"{kind} needs truncated_importance_sampling_ratio_min, as NeMo-RL requires")
        if not isinstance(self.sequence_level_importance_ratios, bool):
            raise ValueError("sequence_level_importance_ratios must be a bool")
        if kind == "seq-mask-tis" and self.sequence_level_importance_ratios:
            raise ValueError("seq-mask-tis is incompatible with sequence_level_importance_ratios, as in NeMo-RL")

    def __call__(self, x: CorrectionInputs) -> CorrectionResult:
        log_ratio = x.log_ratio
        kind = self.truncated_importance_sampling_type
        if self.sequence_level_importance_ratios:
            # NeMo-RL sums (prev - gen) * mask over the whole row: NaN anywhere in it makes the weight 0
            sequence = x.require_sequences("NeMo-RL's sequence_level_importance_ratios")
            total = log_ratio.new_zeros(x.n_sequences).index_add(0, sequence, log_ratio * x.mask)
            ratio = x.to_tokens(torch.nan_to_num(torch.exp(total), nan=0.0, posinf=0.0, neginf=0.0))
        else:
            ratio = torch.nan_to_num(torch.exp(log_ratio), nan=0.0, posinf=0.0, neginf=0.0)
        metrics = {}
        if kind is None:
            weights = ratio
        else:
            low = self.truncated_importance_sampling_ratio_min
            low = 0.0 if low is None else low
            high = self.truncated_importance_sampling_ratio
            geometric = None
            if TRUNCATIONS[kind].per_response:
                safe = torch.nan_to_num(log_ratio, nan=0.0, posinf=0.0, neginf=0.0)
                geometric = torch.exp(x.sequence_mean(safe, "seq-mask-tis", eps=1e-8))
                kept = (geometric >= low) & (geometric <= high)
                metrics["is_oob_ratio"] = (~kept).float().sum() / (x.n_sequences + 1e-8)
                geometric = x.to_tokens(geometric)
            else:
                inside = (ratio >= low) & (ratio <= high)
                metrics["is_oob_ratio"] = x.token_mean((~inside).float(), eps=1e-8)
            weights = truncated_weights(kind, ratio, low, high, geometric)
        return CorrectionResult(weights=weights, metrics=metrics)
