"""verl's ``algorithm.rollout_correction`` (``verl/trainer/ppo/rollout_corr_helper.py``, decoupled mode): IS
weights (``rollout_is``: token or sequence product, truncated (TIS) at an upper threshold or, with an ``"L_U"``
threshold, zeroed outside ``[L, U]`` (IcePop); optionally normalised to mean 1 over the call) and rejection
(``rollout_rs``: comma-separated k1/k2/k3 criteria at token, sequence-sum, sequence-mean or sequence-max level,
ANDed), whose rejections leave the response mask, so the normaliser counts only the tokens kept.

As verl: log-ratios clamped to +-``SAFETY_BOUND`` before any exponential, sums over the scored tokens,
``masked_mean``'s ``1e-8``, thresholds parsed by verl's own rules. The weights and the mask are both computed
from the caller's mask, before either is applied."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dgpo_ops.corrections.core import (KL_ESTIMATORS, SAFETY_BOUND, CorrectionInputs, CorrectionResult,
                                       RolloutCorrection, check_branches, check_known, clamped_exp,
                                       kl_estimates)

RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
IS_LEVELS = ("token", "sequence")
# rollout_is: whether the weight is the response's product of ratios (else the token's own ratio)
IS_PER_RESPONSE = {"token": False, "sequence": True}
# A rollout_rs option is "<level>_<estimator>". Each level's statistic on every token, from the estimator's
# per-token values (``what`` names the option in the error of a layout without responses).
RS_LEVELS = {
    "token": lambda x, values, what: values,
    "seq_sum": lambda x, values, what: x.to_tokens(x.sequence_sum(values, what)),
    "seq_mean": lambda x, values, what: x.to_tokens(x.sequence_mean(values, what, eps=1e-8)),
    "seq_max": lambda x, values, what: x.to_tokens(x.sequence_max(values)),
}
# whether an estimator's threshold is two ratio bounds "L_U", compared with it in log space (k1, the negated
# log-ratio: either sign), or a single upper bound (k2, k3: never negative)
RS_TWO_SIDED = {"k1": True, "k2": False, "k3": False}


def rs_parts(option: str) -> tuple[str, str]:
    """``(level, estimator)`` of a ``rollout_rs`` option."""
    level, estimator = option.rsplit("_", 1)
    return level, estimator


def check_dispatch() -> None:
    """Every IS level and every rollout_rs option's level and estimator has its branch (run at import)."""
    check_branches("rollout_is", IS_LEVELS, IS_PER_RESPONSE)
    check_branches("rollout_rs levels", dict.fromkeys(rs_parts(option)[0] for option in RS_OPTIONS), RS_LEVELS)
    check_branches("rollout_rs estimators", dict.fromkeys(rs_parts(option)[1] for option in RS_OPTIONS),
                   RS_TWO_SIDED)
    check_known("rollout_rs estimators", RS_TWO_SIDED, KL_ESTIMATORS)


check_dispatch()
# verl 0.9.1's RolloutCorrectionConfig fields (rollout_correction.yaml's keys, and Hydra's _target_)
VERL_CONFIG_FIELDS = ("_target_", "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                      "rollout_rs_threshold", "bypass_mode", "loss_type")


def parse_is_threshold(spec) -> tuple[float, float | None]:
    """``(upper, lower)`` from ``rollout_is_threshold``: a number or ``"U"`` (TIS), ``"L_U"`` (IcePop)
    (verl's ``_parse_rollout_is_threshold``)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"rollout_is_threshold must be a number or a 'U' / 'L_U' string, got {spec!r}")
    lower = None
    if isinstance(spec, str):
        text = spec.strip()
        try:
            if "_" in text:
                lower_text, upper_text = text.split("_", 1)
                lower, upper = float(lower_text), float(upper_text)
            else:
                upper = float(text)
        except ValueError:
            raise ValueError(f"Invalid rollout_is_threshold {spec!r}") from None
    else:
        upper = float(spec)
    if not upper > 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"rollout_is_threshold lower bound must be positive and <= the upper bound, got {spec!r}")
    return upper, lower


def _rs_number(text: str, option: str) -> float:
    """A number of ``rollout_rs_threshold`` (verl's message where it is none; NaN, which verl takes and which
    would reject every token, refused too)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"Invalid numeric threshold {text!r} for option {option!r}") from None
    if math.isnan(value):
        raise ValueError(f"Invalid numeric threshold {text!r} for option {option!r}")
    return value


def parse_rs(rollout_rs: str, spec) -> dict[str, tuple[float | None, float]]:
    """``{option: (lower, upper)}`` from ``rollout_rs`` and ``rollout_rs_threshold`` (verl's
    ``compute_rollout_rejection_mask`` option list, de-duplicated in order, and ``_parse_rollout_rs_thresholds``:
    one threshold for every option or one per option; a k1 option's ``"L_U"`` or ``"U"`` meaning ``L = 1/U``)."""
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs must be a comma-separated string of {RS_OPTIONS}, got {rollout_rs!r}")
    options = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    if not options:
        raise ValueError("rollout_rs must contain at least one option")
    for option in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"Invalid rollout_rs option {option!r}: must be one of {RS_OPTIONS}")
    if spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold must be a string or a number, got {spec!r}")
    specs = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if not specs or len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold needs one threshold for every option or exactly {len(options)}, "
                         f"got {spec!r}")
    specs = specs * len(options) if len(specs) == 1 else specs
    thresholds = {}
    for option, text in zip(options, specs):
        if RS_TWO_SIDED[rs_parts(option)[1]]:
            upper = _rs_number(text.split("_", 1)[1] if "_" in text else text, option)
            lower = _rs_number(text.split("_", 1)[0], option) if "_" in text else (1.0 / upper if upper else 0.0)
            if lower <= 0 or upper <= 0 or lower > upper:
                raise ValueError(f"Thresholds for option {option!r} must be positive with lower <= upper, "
                                 f"got {text!r}")
        else:
            if "_" in text:
                raise ValueError(f"rollout_rs_threshold for option {option!r} is a single upper bound, "
                                 f"got {text!r}")
            lower, upper = None, _rs_number(text, option)
            if upper <= 0:
                raise ValueError(f"Threshold for option {option!r} must be positive, got {text!r}")
        thresholds[option] = (lower, upper)
    return thresholds


@dataclass(frozen=True)
class VerlCorrection(RolloutCorrection):
    """``algorithm.rollout_correction``'s fields (verl's YAML defaults: no IS, threshold 2.0, no RS).
    ``bypass_mode`` (the current policy's detached log-probs in place of old ones) is not supported: it needs the
    current log-probs before the loss, which this stage runs before."""

    rollout_is: str | None = None
    rollout_is_threshold: str | float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None

    def __post_init__(self):
        if self.rollout_is is None and self.rollout_rs is None:
            raise ValueError("VerlCorrection needs rollout_is or rollout_rs (without either verl computes only "
                             "the mismatch metrics, which rollout_logps alone give)")
        if self.rollout_is is not None:
            if self.rollout_is not in IS_LEVELS:
                raise ValueError(f"rollout_is must be one of {IS_LEVELS} or None, got {self.rollout_is!r}")
            parse_is_threshold(self.rollout_is_threshold)
        if not isinstance(self.rollout_is_batch_normalize, bool):
            raise ValueError(f"rollout_is_batch_normalize must be a bool, got {self.rollout_is_batch_normalize!r}")
        if self.rollout_rs is not None:
            parse_rs(self.rollout_rs, self.rollout_rs_threshold)

    @classmethod
    def from_config(cls, rollout_correction) -> "VerlCorrection":
        """From verl's ``algorithm.rollout_correction`` (its ``RolloutCorrectionConfig``, a presets' result such as
        ``RolloutCorrectionConfig.decoupled_geo_rs()``, or the YAML's mapping), as verl's
        ``compute_rollout_correction_and_add_to_batch`` reads it."""
        def read(name, default):
            if isinstance(rollout_correction, dict) or hasattr(rollout_correction, "get"):
                return rollout_correction.get(name, default)
            return getattr(rollout_correction, name, default)

        if isinstance(rollout_correction, dict) or hasattr(rollout_correction, "keys"):  # a mapping: a misspelt
            unknown = sorted(set(rollout_correction.keys()) - set(VERL_CONFIG_FIELDS))  # field would be ignored
            if unknown:
                raise ValueError(f"unknown algorithm.rollout_correction field(s) {unknown}: verl's are "
                                 f"{VERL_CONFIG_FIELDS}")

        if read("bypass_mode", False):
            raise ValueError("verl's bypass_mode is not supported: it computes the weights from the current "
                             "policy's log-probs, which this stage (run before the loss) does not have; use "
                             "decoupled mode (old_logps from the trainer's forward pass)")
        return cls(rollout_is=read("rollout_is", None), rollout_is_threshold=read("rollout_is_threshold", 2.0),
                   rollout_is_batch_normalize=read("rollout_is_batch_normalize", False),
                   rollout_rs=read("rollout_rs", None), rollout_rs_threshold=read("rollout_rs_threshold", None))

    def __call__(self, x: CorrectionInputs) -> CorrectionResult:
        log_ratio = x.log_ratio
        metrics = {}
        weights = keep = None
        if self.rollout_is is not None:
            weights, metrics = self.is_weights(x, log_ratio)
        if self.rollout_rs is not None:
            keep = self.rejection_keep(x, log_ratio)
        return CorrectionResult(weights, keep, metrics)

    def is_weights(self, x: CorrectionInputs, log_ratio: torch.Tensor):
        """verl's ``compute_rollout_correction_weights``."""
        upper, lower = parse_is_threshold(self.rollout_is_threshold)
        if IS_PER_RESPONSE[self.rollout_is]:
            raw = x.to_tokens(clamped_exp(x.sequence_sum(log_ratio, "verl's rollout_is='sequence'")))
        else:
            raw = clamped_exp(log_ratio)
        raw = x.masked(raw)
        if lower is None:
            weights = raw.clamp(max=upper)
            metrics = {}
        else:
            weights = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
            # verl's metric: a NaN ratio (weight 0 above) is not counted out of bounds
            metrics = {"rollout_is_oob_ratio": x.token_mean(((raw < lower) | (raw > upper)).float(), eps=1e-8)}
        if self.rollout_is_batch_normalize:
            if IS_PER_RESPONSE[self.rollout_is]:
                per_sequence = x.sequence_mean(weights, eps=1e-8)
                present = (x.sequence_count() > 0).float()
                mean = (per_sequence * present).sum() / present.sum().clamp(min=1e-8)
            else:
                mean = x.token_mean(weights, eps=1e-8)
            normalise = mean > 1e-8  # verl's guard, as a select: no host read
            weights = torch.where(normalise, weights / mean, weights)
            metrics["rollout_is_batch_norm_factor"] = torch.where(normalise, mean, 1.0)
        return weights, metrics

    def rejection_keep(self, x: CorrectionInputs, log_ratio: torch.Tensor) -> torch.Tensor:
        """verl's ``compute_rollout_rejection_mask``: the tokens every option keeps."""
        k = kl_estimates(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        keep = torch.ones_like(x.mask)
        for option, (lower, upper) in parse_rs(self.rollout_rs, self.rollout_rs_threshold).items():
            level, estimator = rs_parts(option)
            values = RS_LEVELS[level](x, k[estimator], f"verl's {option}")
            if RS_TWO_SIDED[estimator]:
                inside = (values >= math.log(lower)) & (values <= math.log(upper))
            else:
                inside = values <= upper
            keep = keep & inside
        return keep
