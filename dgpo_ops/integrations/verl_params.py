"""The verl integration's names, hyperparameters and aggregations, derived from the method table
without importing verl (``dgpo_ops.integrations.verl`` registers them; docs/integrations.md's verl table comes
from here).

* Every method and alias of the table (``catalog.POLICY_LOSSES``) is the verl policy loss
  ``dgpo_ops.<name>``: verl has its own ``cispo``, ``gspo`` and ``sapo``, so the prefix keeps every name
  apart from verl's, now and later. An alias's parameters (dapo's ``eps_high=0.28``) win over verl's
  fields, as ``method_params`` does, since verl's fields always hold a value.
* A parameter comes from ``policy_loss.method_params.<name>`` when set there, else from the field of
  verl's actor config that means the same (verl's spec, ``dgpo_ops.frameworks.verl``: ``clip_ratio_low/high``,
  ``clip_ratio_c``, ``tau_pos/neg``, ``policy_loss.<field>``), else it keeps the table's default.
* verl's five aggregations (``agg_loss``) are per-token scales: the rows of verl's spec over verl's step
  (``global_batch_info``'s counts across data-parallel ranks and micro-batches).
"""

from __future__ import annotations

import math

import torch

from dgpo_ops.core.options import IMPORTANCE_SAMPLING_LEVELS, LossOptions
from dgpo_ops.frameworks.core import AggregationRow, ConfigField, step_normalizer
from dgpo_ops.frameworks.verl import ACTOR, COUNT_KEYS, HORIZON_DENOMINATORS, METHOD_AGGREGATIONS, ROW_MEAN
from dgpo_ops.frameworks.verl import SPEC as VERL
from dgpo_ops.integrations import config_fields
from dgpo_ops.integrations.config_fields import REQUIRED, checked_value
from dgpo_ops.methods.catalog import POLICY_LOSSES, MethodParam
from dgpo_ops.methods.catalog import method_params as table_params
from dgpo_ops.methods.table import METHODS, resolve

PREFIX = "dgpo_ops."
POLICY_LOSS = f"{ACTOR}.policy_loss"
FIELDS = VERL.fields


def verl_field(param: MethodParam) -> ConfigField | None:
    """The verl field that means ``param`` (verl's spec), None where only ``policy_loss.method_params`` sets it."""
    return FIELDS.field_of(param)


def loss_mode(name: str) -> str:
    """verl's ``policy_loss.loss_mode`` name of a method or alias of the table."""
    resolve(name)  # unknown names raise
    return PREFIX + name


LOSS_MODES: dict[str, str] = {loss_mode(name): name for name in POLICY_LOSSES}
LOSS_AGG_MODES = tuple(row.mode for row in VERL.aggregations)


def check_loss_agg_mode(loss_agg_mode) -> AggregationRow:
    """verl's row of ``loss_agg_mode`` (``dgpo_ops.frameworks.verl``)."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"{ACTOR}.loss_agg_mode: verl has no aggregation {loss_agg_mode!r}; "
                         f"its aggregations are {', '.join(LOSS_AGG_MODES)}")
    return VERL.row(loss_agg_mode)


def _positive_count(name: str, value):
    """A count from ``global_batch_info``: a number > 0 is checked here (no device read for tensors)."""
    if isinstance(value, bool) or not (torch.is_tensor(value) or isinstance(value, (int, float))):
        raise ValueError(f"global_batch_info[{name!r}] must be a number, got {value!r}")
    if not torch.is_tensor(value) and not (math.isfinite(value) and value > 0):
        raise ValueError(f"global_batch_info[{name!r}] must be > 0, got {value!r}")
    return value


# Without global_batch_info's count (one process), verl counts this micro-batch: its tokens, or its responses that
# have a scored token.
LOCAL_COUNTS = {"batch_num_tokens": lambda mask: mask.sum(),
                "global_batch_size": lambda mask: mask.any(dim=-1).sum()}


def step_count(row: AggregationRow, mask: torch.Tensor, info: dict, dp_size: int, dtype):
    """``row.denominator`` counted over verl's step: the global count ``global_batch_info`` holds for it
    (``COUNT_KEYS``), times the horizon where the row divides by it; without it (one process) the micro-batch's."""
    key = COUNT_KEYS[row.denominator]
    count = 1.0
    if key is not None:
        count = info.get(key)
        if count is None:
            if dp_size > 1:
                raise ValueError(f"loss_agg_mode {row.mode!r} with dp_size {dp_size} needs "
                                 f"global_batch_info[{key!r}] (verl's engine sets it)")
            count = LOCAL_COUNTS[key](mask).clamp(min=1).to(dtype)
        else:
            count = _positive_count(key, count)
    if row.denominator in HORIZON_DENOMINATORS:
        horizon = info.get("loss_scale_factor")
        count = count * (mask.shape[-1] if horizon is None else _positive_count("loss_scale_factor", horizon))
    return count


def verl_token_scales(mask: torch.Tensor, loss_agg_mode: str, global_batch_info, dtype) -> torch.Tensor:
    """Per-token scales ``s`` (0 on masked tokens) with ``sum(s * L)`` equal to verl's
    ``agg_loss(L, mask, loss_agg_mode, **global_batch_info)`` on a ``(B, T)`` boolean mask: the row's
    within-response weight over its step normaliser (``dgpo_ops.frameworks.step_normalizer``: the global count
    over ``dp_size``).

    Without a global count (one process, ``dp_size`` 1) verl counts this micro-batch: its tokens, or its
    responses that have a scored token (fully masked responses are left out of the count, as verl does;
    ``dgpo_ops.token_scales`` counts them, as TRL does). An empty micro-batch gives 0, not verl's 0/0.
    ``ROW_MEAN`` (a method's own, not a ``loss_agg_mode``): ``1 / ((|o_i| + 1e-8) B)``, nothing global."""
    if loss_agg_mode == ROW_MEAN:
        lengths = mask.sum(dim=-1, keepdim=True).to(dtype) + 1e-8
        return mask.to(dtype) / lengths / max(mask.shape[0], 1)
    row = check_loss_agg_mode(loss_agg_mode)
    info = dict(global_batch_info or {})
    dp_size = info.get("dp_size")
    dp_size = 1 if dp_size is None else dp_size
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"global_batch_info['dp_size'] must be a positive integer, got {dp_size!r}")
    scale = mask.to(dtype)
    if row.per_response:
        scale = scale / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    return scale / step_normalizer(row, step_count(row, mask, info, dp_size, dtype), dp_size=dp_size)


def read_field(config, name: str, where: str = ACTOR, default=REQUIRED):
    """``config.name`` from verl's ``ActorConfig`` (a dataclass that is also a mapping) or a DictConfig."""
    return config_fields.read_field(config, name, where, f"the policy losses of dgpo_ops.* take verl's actor config "
                                    f"({ACTOR}, a verl ActorConfig)", default)


def check_method_params(method: str, given) -> dict:
    """``policy_loss.method_params`` checked against ``method``'s parameters (names and values)."""
    return config_fields.check_method_params(method, given, f"{POLICY_LOSS}.method_params")


def params_from_verl(name: str, config) -> dict:
    """The parameters of the method or alias ``name`` from verl's actor ``config``: ``policy_loss.method_params``
    first, then the alias's presets, then the verl field that means the same, else the table's default (left
    out here)."""
    method, presets = resolve(name)
    policy_loss = read_field(config, "policy_loss")
    given = {**presets, **check_method_params(
        method, read_field(policy_loss, "method_params", POLICY_LOSS, default=None) or {})}
    values = {}
    for name, p in ((p.name, p) for p in table_params(method)):
        if name in given:
            values[name] = given[name]
        elif (source := verl_field(p)) is not None:
            field = source.path
            value = read_verl_field(config, field)
            if value is None and source.fallback is not None:
                field = source.fallback
                value = read_verl_field(config, field)
            if value is None and source.when_null is not None:
                value = source.when_null  # what verl's own loss reads a null field as
            values[name] = checked_value(method, name, p.spec, value, f"{ACTOR}.{field}")
    return values


def read_verl_field(config, field: str):
    """A field of verl's actor config, ``policy_loss.<name>`` one of its policy-loss config."""
    if field.startswith("policy_loss."):
        return read_field(read_field(config, "policy_loss"), field.split(".", 1)[1], POLICY_LOSS)
    return read_field(config, field)


for _method, _mode in METHOD_AGGREGATIONS.items():  # a method's own aggregation must be one this module computes
    if _method not in METHODS or _mode not in (ROW_MEAN, *LOSS_AGG_MODES):
        raise AssertionError(f"METHOD_AGGREGATIONS[{_method!r}] = {_mode!r}: not a method, or not {ROW_MEAN!r} or a mode")


def aggregation_mode(method: str, loss_agg_mode: str) -> str:
    """The aggregation of verl's call: ``loss_agg_mode``, unless verl's loss of that name has its own."""
    return METHOD_AGGREGATIONS.get(method, loss_agg_mode)


def loss_options(mode: str, config) -> LossOptions:
    """The loss options of verl's ``loss_mode`` ``dgpo_ops.<method>`` under ``config``."""
    if mode not in LOSS_MODES:
        raise ValueError(f"{POLICY_LOSS}.loss_mode: unknown dgpo-ops loss {mode!r}; known: {', '.join(LOSS_MODES)}")
    name = LOSS_MODES[mode]
    policy_loss = read_field(config, "policy_loss")
    level = read_field(policy_loss, "importance_sampling_level", POLICY_LOSS, default="token")
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"{POLICY_LOSS}.importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                         f"got {level!r}")
    return LossOptions.build(resolve(name)[0], importance_sampling_level=level, **params_from_verl(name, config))
