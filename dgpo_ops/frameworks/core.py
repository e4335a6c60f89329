"""What a framework spec is made of: its aggregation rows (what one call divides by, and what each rank's call
passes over a whole data-parallel step, in one convention), the config fields it reads method parameters from
(one field type for every framework), its correction family, and TRL's loss types.

The step convention, said once here for every row: a framework's step gradient is the sum of the per-token
gradients over every micro-batch of the step on every data-parallel rank, divided by the row's step count ``N``.
With the ranks' gradients averaged (DDP, FSDP, ZeRO: a mean over ``dp_size`` ranks) and each rank's micro-batch
gradients summed (accumulated), every call passes ``loss_normalizer = N / dp_size`` (``step_normalizer``).
Frameworks that divide by a global count multiply their loss by ``dp_size`` to cancel the ranks' mean (SkyRL's
worker, AReaL's engine, OpenRLHF's loss, ROLL's strategy, verl's ``global_batch_info``): their ``N`` is that
global count. A framework that divides each micro-batch by its own count and lets the ranks' mean stand (TRL) has
``N`` = that count x the step's micro-batches x ``dp_size``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from dgpo_ops.kernels.interface import Denominator
from dgpo_ops.methods.catalog import MethodParam


class Scope(enum.Enum):
    """What a row's count runs over, and so its step count ``N`` (``STEP_COUNTS``)."""

    STEP = "the step"  # every micro-batch of the step on every data-parallel rank: N is that count
    MICRO_BATCH_MEAN = "the micro-batch, micro-batches and ranks averaged"  # N = count x micro-batches x dp_size
    MICRO_BATCH_SUM = "the micro-batch, micro-batches and ranks summed"  # N = the micro-batch's count


# Scope -> N from (the count over the scope, the step's micro-batches per rank, dp_size)
STEP_COUNTS: dict[Scope, Callable] = {
    Scope.STEP: lambda count, micro_batches, dp_size: count,
    Scope.MICRO_BATCH_MEAN: lambda count, micro_batches, dp_size: count * micro_batches * dp_size,
    Scope.MICRO_BATCH_SUM: lambda count, micro_batches, dp_size: count,
}
if set(STEP_COUNTS) != set(Scope):
    raise AssertionError(f"STEP_COUNTS lacks {set(Scope) - set(STEP_COUNTS)}")


@dataclass(frozen=True)
class AggregationRow:
    """A framework's aggregation mode as its trainer applies it: the within-response weight, what one call divides
    the token sum by (counted from the call's mask: the framework's number for one micro-batch on one rank), what
    that count runs over in a whole step (``scope``) and the step count ``N`` in the framework's own terms, and
    where the framework's code says so. Over a step every call passes ``step_normalizer(row, ...)``."""

    mode: str  # the framework's own config value (TRL's loss_type, verl's loss_agg_mode, ...)
    per_response: bool  # each token weighs 1 / |o_i| (the response's scored tokens)
    denominator: Denominator  # what is counted: by one call from its mask, over ``scope`` in a step
    scope: Scope
    step_count: str  # N, the framework's divisor of the step's summed gradient, in its own terms
    source: str  # file and lines (loss function; the trainer's step that sets the divisor), version or commit


def step_normalizer(row: AggregationRow, count, *, micro_batches: int = 1, dp_size: int = 1):
    """The ``loss_normalizer`` each rank's call passes to give the framework's step gradient: ``N / dp_size``
    (the module's convention), ``count`` being ``row.denominator`` counted over ``row.scope`` (the step's over
    every rank, or the call's micro-batch's)."""
    return STEP_COUNTS[row.scope](count, micro_batches, dp_size) / dp_size


@dataclass(frozen=True)
class ConfigField:
    """The field of a framework's config that a method parameter is read from: ``path`` (dotted, under the
    spec's ``MethodFields.root``). Where it holds None: ``fallback``'s value stands in (TRL's
    ``epsilon_high=None`` means ``epsilon``, verl's ``clip_ratio_low`` ``clip_ratio``), else ``when_null`` (the
    framework's code constant for a null field), else the method's default. ``offset`` is added on the way to
    the config (CISPO's cap ``1 + eps_high`` is TRL's ``epsilon_high``)."""

    path: str
    fallback: str | None = None
    offset: float = 0.0
    when_null: float | None = None

    @property
    def name(self) -> str:
        return self.path

    def to_config(self, value):
        """The parameter's value in the field's terms."""
        return value if value is None or isinstance(value, str) else value + self.offset

    def from_config(self, value):
        """The parameter's value from the field's value."""
        return value if value is None or isinstance(value, str) else value - self.offset


def named_after_method(param: MethodParam) -> ConfigField:
    """A field of its own named after the method (the parameter's own name where it already starts with the
    method's): dgpo's ``n`` from ``dgpo_n``, dro's ``dro_beta`` from itself."""
    return ConfigField(param.name if param.name.startswith(param.method) else f"{param.method}_{param.name}")


@dataclass(frozen=True)
class MethodFields:
    """Where a framework's config holds the method parameters: ``by_param`` the field of a parameter by its
    name, ``by_method`` a method's own field for a parameter of that name (None: none, the default or
    ``params_field`` only); any other parameter from ``own_field(param)`` where the framework adds a field per
    parameter (TRL's ``DGPOConfig``), else only from ``params_field`` (the mapping by dgpo-ops' names), under
    ``root``."""

    root: str
    by_param: dict[str, ConfigField]
    by_method: dict[tuple[str, str], ConfigField | None] = field(default_factory=dict)
    params_field: str | None = None
    own_field: Callable[[MethodParam], ConfigField] | None = None

    def field_of(self, param: MethodParam) -> ConfigField | None:
        key = (param.method, param.name)
        if key in self.by_method:
            return self.by_method[key]
        if param.name in self.by_param:
            return self.by_param[param.name]
        return None if self.own_field is None else self.own_field(param)


@dataclass(frozen=True)
class LossType:
    """A loss name of the framework's own (TRL's ``loss_type``): the method it trains and its aggregation row's
    mode."""

    name: str
    method: str
    aggregation: str


@dataclass(frozen=True)
class FrameworkSpec:
    """One framework: its aggregation rows, where its config holds method parameters, its training-inference
    mismatch correction (a ``RolloutCorrection`` class whose fields are named as the framework's config names
    them) and where that config is, its own loss names."""

    name: str  # the prefix of its rows' names, ``"name:mode"``
    title: str  # the framework's name in messages and docs
    aggregations: tuple[AggregationRow, ...] = ()
    fields: MethodFields | None = None
    correction: type | None = None
    correction_config: str | None = None  # where the framework's config holds the correction's fields
    loss_types: tuple[LossType, ...] = ()

    def __post_init__(self):
        modes = [row.mode for row in self.aggregations]
        if len(set(modes)) != len(modes):
            raise AssertionError(f"{self.name}: an aggregation mode twice in {modes}")
        for loss_type in self.loss_types:
            if loss_type.aggregation not in modes:
                raise AssertionError(f"{self.name} loss type {loss_type.name}: no aggregation row "
                                     f"{loss_type.aggregation!r}")
        if (self.correction is None) != (self.correction_config is None):
            raise AssertionError(f"{self.name}: a correction needs the place of its config, and only it")

    def row(self, mode: str) -> AggregationRow:
        rows = {row.mode: row for row in self.aggregations}
        if mode not in rows:
            raise ValueError(f"{self.name} has no aggregation {mode!r}; its aggregations: {', '.join(rows)}")
        return rows[mode]

    def loss_type(self, name: str) -> LossType:
        types = {loss_type.name: loss_type for loss_type in self.loss_types}
        if name not in types:
            raise ValueError(f"loss_type must be one of {self.title}'s {', '.join(types)}, got {name!r}")
        return types[name]

    @property
    def correction_fields(self) -> tuple[str, ...]:
        """The correction's field names: the framework's config keys."""
        return () if self.correction is None else tuple(f.name for f in dataclasses.fields(self.correction))
