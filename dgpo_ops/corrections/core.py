"""What every rollout correction is made of: the per-token log-probs it reads, laid flat with the response each
token belongs to, the segment reductions the sequence-level modes need, and what a correction gives back.

A correction (``RolloutCorrection`` subclasses, one module per framework family) reads the trainer's log-probs
of the sampling-time policy (``old_logps``) and the inference engine's (``rollout_logps``) on the scored tokens,
and returns per-token weights on the policy term and/or which scored tokens stay scored (a rejection shrinks
the mask, so the aggregation's normaliser changes, as verl's modified ``response_mask`` does). Everything is
torch ops on O(tokens) vectors: no host read, nothing the compiler cannot trace.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

SAFETY_BOUND = 20.0  # verl's, SkyRL's and ms-swift's clamp on a log-ratio before its exponential


def clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(log_ratio, -20, 20))``: verl's, SkyRL's (``safe_exp_delta``) and ms-swift's ratio (NaN stays
    NaN)."""
    return torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))


def kl_estimates(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """Schulman's per-token estimators of ``KL(q || p)`` from ``log_ratio = log p / q`` on tokens sampled from
    ``q``: ``k1 = -log_ratio``, ``k2 = log_ratio^2 / 2``, ``k3 = exp(log_ratio) - 1 - log_ratio``. verl's
    rejection and mismatch metrics take them at ``old - rollout``; AReaL's ``KLEstimator`` at ``rollout - old``."""
    return {"k1": -log_ratio, "k2": 0.5 * log_ratio ** 2, "k3": torch.exp(log_ratio) - 1.0 - log_ratio}


KL_ESTIMATORS = tuple(kl_estimates(torch.zeros(())))  # their names, for the modules' dispatch checks


def check_number(name: str, value, *, optional: bool = False, minimum: float | None = None,
                 positive: bool = False) -> None:
    """Refuse (``ValueError``) a field that is not a finite number (``None`` too, unless ``optional``), or below
    ``minimum``, or not above 0 when ``positive``: a string, a bool or NaN would otherwise compare silently."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{' or None' if optional else ''}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def check_order(low_name: str, low, high_name: str, high) -> None:
    """Refuse bounds in the wrong order (either may be None: no bound), which would reject every token."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"{low_name} ({low}) must be <= {high_name} ({high})")


def check_branches(field: str, values, branches) -> None:
    """Refuse (``AssertionError``) a dispatch table whose keys are not exactly ``values``, the values ``field``
    takes. Each correction module builds its modes, levels and gates as such tables and checks them when it is
    imported, so a value added to a field's list without its own branch stops the import instead of taking
    another value's math at a call."""
    missing = [value for value in values if value not in branches]
    unknown = [key for key in branches if key not in values]
    if missing or unknown:
        raise AssertionError(f"{field}: no branch for {missing}, a branch for no value {unknown} (the values: "
                             f"{tuple(values)})")


def check_known(field: str, names, known) -> None:
    """Refuse (``AssertionError``) a table entry that names something ``known`` lacks (a KL estimator, a kind
    of weights), which would otherwise fail only at a call."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise AssertionError(f"{field}: {unknown} are not among {tuple(known)}")


class CorrectionInputs(NamedTuple):
    """One call's tokens, flat ``(N,)``: a padded ``(B, T)`` grid row by row, packed tokens in packed order."""

    old_logps: torch.Tensor  # fp32, the trainer's log-probs of the sampling-time policy (AReaL: proximal)
    rollout_logps: torch.Tensor  # fp32, the inference engine's (AReaL: behaviour); may hold NaN
    mask: torch.Tensor  # bool, the token is scored
    sequence: torch.Tensor | None  # int64, the response each token belongs to; None: no response structure
    n_sequences: int

    @property
    def log_ratio(self) -> torch.Tensor:
        """``old_logps - rollout_logps`` (log pi_train / pi_rollout), as the frameworks form it: NaN stays NaN."""
        return self.old_logps - self.rollout_logps

    def masked(self, values: torch.Tensor, fill=0.0) -> torch.Tensor:
        return torch.where(self.mask, values, fill)

    def require_sequences(self, what: str) -> torch.Tensor:
        if self.sequence is None:
            raise ValueError(f"{what} reduces over each response's tokens: flat (N, V) logits carry no response "
                             "structure (use (B, T, V) logits or cu_seqlens)")
        return self.sequence

    def sequence_sum(self, values: torch.Tensor, what: str = "a sequence-level correction") -> torch.Tensor:
        """``(n_sequences,)`` sums of ``values`` over each response's scored tokens (others add 0, NaN or not)."""
        sequence = self.require_sequences(what)
        return values.new_zeros(self.n_sequences).index_add(0, sequence, self.masked(values))

    def sequence_count(self) -> torch.Tensor:
        return self.sequence_sum(self.mask.to(torch.float32))

    def sequence_max(self, values: torch.Tensor, empty=0.0) -> torch.Tensor:
        """``(n_sequences,)`` maxima over each response's scored tokens, ``empty`` for a response without any."""
        sequence = self.require_sequences("a sequence maximum")
        found = values.new_full((self.n_sequences,), float("-inf")).scatter_reduce(
            0, sequence, self.masked(values, float("-inf")), reduce="amax")
        return torch.where(self.sequence_count() > 0, found, empty)

    def sequence_mean(self, values: torch.Tensor, what: str = "a sequence-level correction",
                      eps: float = 0.0) -> torch.Tensor:
        """``(n_sequences,)`` means over each response's scored tokens: ``sum / (count + eps)``, with ``eps = 0``
        as ``sum / max(count, 1)`` (a response without tokens: 0)."""
        count = self.sequence_count()
        return self.sequence_sum(values, what) / ((count + eps) if eps else count.clamp(min=1.0))

    def to_tokens(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """A per-response value on each of its tokens."""
        return per_sequence[self.require_sequences("a sequence-level correction")]

    def token_mean(self, values: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
        """Mean over the scored tokens: ``sum / (count + eps)``, with ``eps = 0`` as ``sum / max(count, 1)``."""
        count = self.mask.sum().to(values.dtype)
        total = self.masked(values).sum()
        return total / (count + eps) if eps else total / count.clamp(min=1)


class CorrectionResult(NamedTuple):
    """Per-token weights on the policy term (None: 1) and which scored tokens stay scored (None: all), flat."""

    weights: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    metrics: dict | None = None


@dataclass(frozen=True)
class RolloutCorrection:
    """A training-inference mismatch correction: each subclass is one framework family's modes, with that
    framework's names and defaults (``dgpo_ops.corrections``). Frozen and hashable: it travels in
    ``LossOptions.rollout_correction``."""

    KINDS = {}  # class name -> class: how a correction crosses a torch.compile trace as constants (as_constants)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        RolloutCorrection.KINDS[cls.__name__] = cls

    def as_constants(self) -> tuple:
        """``(class name, ((field, value), ...))``: what ``torch.compile`` can hand a constant function (it cannot
        rebuild a frozen dataclass it did not make); ``from_constants`` makes the correction again."""
        return type(self).__name__, tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))

    @staticmethod
    def from_constants(constants: tuple) -> "RolloutCorrection":
        name, fields = constants
        return RolloutCorrection.KINDS[name](**dict(fields))

    def check_options(self, options) -> None:
        """Refuse (``ValueError``) loss options (a ``LossOptions``: the method, ``beta``, ...) with which this
        correction would not give its framework's numbers, or that the framework refuses; ``LossOptions`` asks."""

    def __call__(self, inputs: CorrectionInputs) -> CorrectionResult:
        raise NotImplementedError


def largest(values: torch.Tensor, empty: float) -> torch.Tensor:
    """``values.max()``, or ``empty`` for no values (a shape, known on the host)."""
    return values.max() if values.numel() else values.new_full((), empty)


def min_mean_max(values: torch.Tensor, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``values``' min, mean and max over the entries ``where`` is True (each 0 where there is none)."""
    count = where.sum()
    present = count > 0
    smallest = -largest(torch.where(where, -values, -math.inf), 0.0)
    biggest = largest(torch.where(where, values, -math.inf), 0.0)
    mean = torch.where(where, values, 0.0).sum() / count.clamp(min=1).to(values.dtype)
    return torch.where(present, smallest, 0.0), mean, torch.where(present, biggest, 0.0)


def mismatch_metrics(inputs: CorrectionInputs) -> dict[str, torch.Tensor]:
    """What the frameworks log about the mismatch itself, whatever the correction: verl's ``kl`` (k1, mean of
    ``rollout - old``) and ``k3_kl`` (mean of ``exp(r) - r - 1``, ``r = old - rollout``) and TRL's
    ``sampling_logp_difference`` mean and max (``|old - rollout|``), all over the same tokens: the scored ones
    whose log-ratio is not NaN (TRL leaves NaN out; verl's would be NaN), so the four describe one set."""
    log_ratio = inputs.log_ratio
    counted = inputs.mask & ~torch.isnan(log_ratio)
    n_counted = counted.sum().clamp(min=1).to(torch.float32)
    safe = torch.where(counted, log_ratio, 0.0)
    k = kl_estimates(safe)

    def mean(values):
        return torch.where(counted, values, 0.0).sum() / n_counted

    return {
        "mismatch_kl_k1": mean(k["k1"]),
        "mismatch_kl_k3": mean(k["k3"]),
        "sampling_logp_difference_mean": mean(safe.abs()),
        "sampling_logp_difference_max": largest(safe.abs(), 0.0),
    }


def weight_metrics(inputs: CorrectionInputs, result: CorrectionResult) -> dict[str, torch.Tensor]:
    """The weights' min, mean and max over the tokens that stay scored (TRL's ``importance_sampling_ratio``,
    verl's ``rollout_is_*``, per token) and the fraction of scored tokens a correction takes out of the loss:
    rejected from the mask or weighted 0."""
    keep = inputs.mask if result.keep is None else inputs.mask & result.keep
    weights = torch.ones_like(inputs.old_logps) if result.weights is None else result.weights
    smallest, mean, biggest = min_mean_max(weights, keep)
    return {
        "rollout_weight_min": smallest,
        "rollout_weight_mean": mean,
        "rollout_weight_max": biggest,
        "rollout_masked_fraction": inputs.token_mean((~(keep & (weights != 0))).float()),
    }
