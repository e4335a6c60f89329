"""What every method is made of: its parameters (``ParamSpec``), its config (``MethodConfig``), the per-token
inputs and terms of its torch function, the optional stages around it (a sequence statistic, a token
selection) and its row of the table (``MethodSpec``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple

import torch

from dgpo_ops.kernels.interface import FLOAT32_MAX, NUM_KERNEL_PARAMS, Gate, KernelParam, MethodId


@dataclass(frozen=True)
class ParamSpec:
    """What a method parameter accepts: ``low``/``high`` bound the value (``low_open``: strictly above ``low``);
    ``optional``: None is allowed (it turns the feature off); ``choices``: the allowed strings. Where a framework's
    config reads the parameter from is the integration's business (``trainer/method_fields.py`` for TRL,
    ``dgpo_ops.integrations.verl_params`` for verl)."""

    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    optional: bool = False
    choices: tuple[str, ...] | None = None

    def check(self, method: str, name: str, value) -> None:
        if value is None:
            if self.optional:
                return
            raise ValueError(f"{method}: {name} must be in {self.describe()}, got None")
        if self.choices is not None:
            if value not in self.choices:
                raise ValueError(f"{method}: {name} must be one of {sorted(self.choices)}, got {value!r}")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{method}: {name} must be a finite number, got {value!r}")
        if abs(value) > FLOAT32_MAX:  # the kernels read the parameters as float32
            raise ValueError(f"{method}: {name} must be a finite float32 number (at most {FLOAT32_MAX:.2g}), "
                             f"got {value!r}")
        low, high = self.low, self.high
        too_low = low is not None and (value <= low if self.low_open else value < low)
        if too_low or (high is not None and value > high):
            bracket = "(" if self.low_open or low is None else "["
            closing = ")" if high is None else "]"
            raise ValueError(f"{method}: {name} must be in {bracket}{'-inf' if low is None else low}, "
                             f"{'inf' if high is None else high}{closing}, got {value!r}")

    def describe(self) -> str:
        """The accepted values in words, for docs/methods.md's table and ``--help``."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        text = f"{'(' if self.low_open or self.low is None else '['}{low}, {high}{')' if self.high is None else ']'}"
        return text + (" or None (off)" if self.optional else "")


def param(default, help: str, **spec):
    """A method parameter: a dataclass field whose metadata is its ``ParamSpec``."""
    return dataclasses.field(default=default, metadata={"param": ParamSpec(help=help, **spec)})


@dataclass(frozen=True)
class MethodConfig:
    """Base of the per-method configs. Field names are the public keyword names; each field's
    ``ParamSpec`` (its metadata) says what it accepts. A per-token method (``MethodSpec.token_local``) names the
    ``MethodId`` of its Triton branch and the ``KernelParam`` slots its parameters fill (``_kernel_slots``); any
    other method has neither: the row kernels never evaluate it."""

    name: ClassVar[str]
    method_id: ClassVar[MethodId | None] = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            field.metadata["param"].check(self.name, field.name, getattr(self, field.name))

    def kernel_params(self) -> list[float]:
        """The fp32 parameter vector of ``KernelParam`` slots; slots a method does not read stay 0."""
        if self.method_id is None:
            raise ValueError(f"{self.name} has no Triton branch (it is not per-token): the torch objective "
                             "evaluates it, and there are no kernel parameters to lower")
        values = [0.0] * NUM_KERNEL_PARAMS
        values[KernelParam.DUAL_CLIP] = math.inf
        values[KernelParam.DELTA] = math.inf
        for slot, value in self._kernel_slots().items():
            values[slot] = math.inf if value is None else float(value)
        return values

    def _kernel_slots(self) -> dict[KernelParam, float | None]:
        raise NotImplementedError

    @property
    def gate_id(self) -> Gate:
        return Gate.SIGMOID


class TokenInputs(NamedTuple):
    log_ratio: torch.Tensor  # clamped straight-through; differentiable
    ratio: torch.Tensor  # exp(log_ratio); differentiable
    ratio_detached: torch.Tensor
    advantage: torch.Tensor
    logp: torch.Tensor  # l = log_ratio + old_logp; differentiable
    old_logp: torch.Tensor
    score: torch.Tensor | None = None  # the response's score (LossInputs.scores), where the caller passed one


class SequenceInputs(NamedTuple):
    """What a sequence statistic reads, on the ``(B, T)`` grid."""

    log_ratio: torch.Tensor  # l - l_old per token; differentiable
    advantage: torch.Tensor
    mask: torch.Tensor  # the scored tokens
    rollout_weights: torch.Tensor | None


class TokenTerms(NamedTuple):
    loss: torch.Tensor
    psi: torch.Tensor
    region: torch.Tensor
    # dL/dl = -A psi + penalty_slope: a penalty whose slope is not proportional to A (dro's quadratic one,
    # kl_cov's |l - l_old| on its chosen tokens); None: no penalty
    penalty_slope: torch.Tensor | None = None


@dataclass(frozen=True)
class MethodSpec:
    """One row of the table: everything about a method that is not its Triton function.

    ``variants``: the parameter sets the tests run for it (the defaults first; every value of a
    ``choices`` parameter somewhere). ``paper``: where the method comes from.
    """

    config: type[MethodConfig]
    token_fn: Callable[..., TokenTerms]
    summary: str
    paper: str
    variants: tuple[dict, ...] = ({},)
    # How a method that is evaluated at a statistic of its response's token log-ratios forms it:
    # (config, SequenceInputs) -> that statistic on the token grid. The rollout weights enter the statistic (as TRL's
    # vespo folds vLLM's importance ratio into its log-weight) instead of multiplying the loss. Such a method is
    # sequence-level by itself: the torch objective evaluates it (vespo's summed log-ratio, GMPO's clipped mean).
    sequence_statistic: Callable[..., torch.Tensor] | None = None
    # Whether the statistic folds the rollout weights in (vespo's, geo_mean's); False: they multiply the loss as for a
    # per-token method (fipo's future KL weighs the token's own PPO term, which ms-swift's rollout weights multiply).
    statistic_folds_rollout_weights: bool = True
    # A batch-level stage after the per-token terms: (config, terms, inputs, scored, generator) -> terms, with
    # statistics over every scored token of the call (the torch objective evaluates such a method).
    token_selection: Callable[..., TokenTerms] | None = None
    # The method reads each response's score (``TokenInputs.score``, the ``scores`` input: topr's sample split), which
    # the row kernels' epilogue does not load: the torch objective evaluates it.
    reads_scores: bool = False
    # The aggregation the method's authors or framework fix: the default of every loss function and of DGPOConfig
    # (TRL's loss_type has none for a method TRL lacks); an explicit aggregation wins. None: token_mean.
    aggregation: str | None = None

    def __post_init__(self):
        # The row kernels' epilogue evaluates exactly the per-token methods: each has a Triton branch, no other has.
        has_id = self.config.method_id is not None
        if has_id != self.token_local:
            raise TypeError(f"{self.config.name}: a per-token method names a MethodId (its Triton branch) and a "
                            f"method with a sequence statistic, a token selection or scores names none; "
                            f"this one is {'' if self.token_local else 'not '}per-token and its method_id is "
                            f"{self.config.method_id!r}")

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def token_local(self) -> bool:
        """Each token's terms depend on that token's inputs alone (no sequence statistic, no batch-level selection,
        no response score): what the row kernels' epilogue can evaluate where it finishes a row."""
        return self.sequence_statistic is None and self.token_selection is None and not self.reads_scores


@dataclass(frozen=True)
class MethodAlias:
    """Another name for a method with some parameters preset (``dapo`` is grpo with clip-higher). The
    preset parameters apply where the caller leaves them unset."""

    name: str
    method: str
    params: dict
    summary: str


class _StraightThroughClamp(torch.autograd.Function):
    """Clamps the value and passes the gradient unchanged. Unlike ``x + (x.clamp(...) - x).detach()``
    it stays finite for infinite ``x`` (inf - inf would be nan); NaN stays NaN."""

    @staticmethod
    def forward(x, low, high):
        return x.clamp(low, high)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def straight_through_clamp(x: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    return _StraightThroughClamp.apply(x, low, high)
