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
from dataclasses import dataclass
from typing import NamedTuple

import torch


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

    def check_method(self, method: str) -> None:
        """Refuse (``ValueError``) a method the framework refuses with this correction; ``LossOptions`` asks."""

    def __call__(self, inputs: CorrectionInputs) -> CorrectionResult:
        raise NotImplementedError


def largest(values: torch.Tensor, empty: float) -> torch.Tensor:
    """``values.max()``, or ``empty`` for no values (a shape, known on the host)."""
    return values.max() if values.numel() else values.new_full((), empty)


def mismatch_metrics(inputs: CorrectionInputs) -> dict[str, torch.Tensor]:
    """What the frameworks log about the mismatch itself, whatever the correction: verl's ``kl`` (k1, mean of
    ``rollout - old``) and ``k3_kl`` (mean of ``exp(r) - r - 1``, ``r = old - rollout``) and TRL's
    ``sampling_logp_difference`` mean and max (``|old - rollout|``, NaN left out), over the scored tokens."""
    log_ratio = inputs.log_ratio
    finite = inputs.mask & ~torch.isnan(log_ratio)
    difference = torch.where(finite, log_ratio.abs(), 0.0)
    n_finite = finite.sum().clamp(min=1).to(torch.float32)
    safe = torch.where(finite, log_ratio, 0.0)
    return {
        "mismatch_kl_k1": inputs.token_mean(-safe),
        "mismatch_kl_k3": inputs.token_mean(torch.exp(safe) - safe - 1.0),
        "sampling_logp_difference_mean": difference.sum() / n_finite,
        "sampling_logp_difference_max": largest(difference, 0.0),
    }


def weight_metrics(inputs: CorrectionInputs, result: CorrectionResult) -> dict[str, torch.Tensor]:
    """The weights' min, mean and max over the tokens that stay scored (TRL's ``importance_sampling_ratio``,
    verl's ``rollout_is_*``, per token) and the fraction of scored tokens a correction takes out of the loss:
    rejected from the mask or weighted 0."""
    keep = inputs.mask if result.keep is None else inputs.mask & result.keep
    weights = torch.ones_like(inputs.old_logps) if result.weights is None else result.weights
    count = keep.sum().clamp(min=1).to(torch.float32)
    any_kept = keep.any()
    dropped = inputs.mask & ~(keep & (weights != 0))
    return {
        "rollout_weight_min": torch.where(any_kept, -largest(torch.where(keep, -weights, float("-inf")), 0.0), 0.0),
        "rollout_weight_mean": torch.where(keep, weights, 0.0).sum() / count,
        "rollout_weight_max": torch.where(any_kept, largest(torch.where(keep, weights, float("-inf")), 0.0), 0.0),
        "rollout_masked_fraction": dropped.sum() / inputs.mask.sum().clamp(min=1).to(torch.float32),
    }
