"""The verl integration's names, hyperparameters and aggregations, derived from the method table
without importing verl (``dgpo_ops.integrations.verl`` registers them; docs/integrations.md's verl table comes
from here).

* Every method and alias of the table (``catalog.POLICY_LOSSES``) is the verl policy loss
  ``dgpo_ops.<name>``: verl has its own ``cispo``, ``gspo`` and ``sapo``, so the prefix keeps every name
  apart from verl's, now and later. An alias's parameters (dapo's ``eps_high=0.28``) win over verl's
  fields, as ``method_params`` does, since verl's fields always hold a value.
* A parameter comes from ``policy_loss.method_params.<name>`` when set there, else from the field of
  verl's actor config that means the same (``VERL_FIELDS``: ``clip_ratio_low/high``, ``clip_ratio_c``,
  ``tau_pos/neg``, ``policy_loss.<field>``), else it keeps the table's default.
* verl's five aggregations (``agg_loss``) are per-token scales with verl's normalisation across
  data-parallel ranks and micro-batches (``global_batch_info``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dgpo_ops.core.aggregation import FRAMEWORK_AGGREGATIONS
from dgpo_ops.core.options import IMPORTANCE_SAMPLING_LEVELS, LossOptions
from dgpo_ops.integrations import config_fields
from dgpo_ops.integrations.config_fields import REQUIRED, checked_value
from dgpo_ops.methods.catalog import POLICY_LOSSES, MethodParam
from dgpo_ops.methods.catalog import method_params as table_params
from dgpo_ops.methods.table import METHODS, resolve

PREFIX = "dgpo_ops."
ACTOR = "actor_rollout_ref.actor"
POLICY_LOSS = f"{ACTOR}.policy_loss"
# verl's clip_ratio_low / clip_ratio_high: None means clip_ratio (as verl's own losses read them).
VERL_FALLBACKS = {"clip_ratio_low": "clip_ratio", "clip_ratio_high": "clip_ratio"}


@dataclass(frozen=True)
class VerlField:
    """A field of verl's actor config (``policy_loss.<name>``: of its policy-loss config) that means a method
    parameter; ``when_null``: the value verl's own loss uses where the field is null (verl's code constant, which
    may differ from its config's default)."""

    path: str
    when_null: float | None = None


# The verl field of each method parameter, by the parameter's name; a parameter without one is read from
# policy_loss.method_params only.
VERL_FIELDS: dict[str, VerlField] = {
    "eps_low": VerlField("clip_ratio_low"),
    "eps_high": VerlField("clip_ratio_high"),
    "dual_clip": VerlField("clip_ratio_c"),
    # dppo's divergence thresholds and weight cap are what verl's dppo losses read its clip fields as
    "delta_low": VerlField("clip_ratio_low"),
    "delta_high": VerlField("clip_ratio_high"),
    "is_cap": VerlField("clip_ratio_c"),
    "tau_pos": VerlField("tau_pos"),
    "tau_neg": VerlField("tau_neg"),
    "dro_beta": VerlField("policy_loss.dro_beta"),  # no constant: None raises in verl too
    "clip_cov_ratio": VerlField("policy_loss.clip_cov_ratio", when_null=2e-4),
    "clip_cov_lb": VerlField("policy_loss.clip_cov_lb", when_null=1.0),
    "clip_cov_ub": VerlField("policy_loss.clip_cov_ub", when_null=5.0),
    "kl_cov_ratio": VerlField("policy_loss.kl_cov_ratio", when_null=2e-4),
    "ppo_kl_coef": VerlField("policy_loss.ppo_kl_coef", when_null=1.0),  # the config's default is 0.1
}
# A method whose parameter of that name verl's field does not mean: DCPO's eps bound the old probability.
METHOD_VERL_FIELDS: dict[tuple[str, str], VerlField | None] = {("dcpo", "eps_low"): None, ("dcpo", "eps_high"): None}
# verl's loss of this name aggregates its own way, whatever loss_agg_mode says.
METHOD_AGGREGATIONS: dict[str, str] = {"geo_mean": "row-mean"}


def verl_field(param: MethodParam) -> VerlField | None:
    """The verl field that means ``param``, None where only ``policy_loss.method_params`` sets it."""
    return METHOD_VERL_FIELDS.get((param.method, param.name), VERL_FIELDS.get(param.name))


def loss_mode(name: str) -> str:
    """verl's ``policy_loss.loss_mode`` name of a method or alias of the table."""
    resolve(name)  # unknown names raise
    return PREFIX + name


LOSS_MODES: dict[str, str] = {loss_mode(name): name for name in POLICY_LOSSES}


@dataclass(frozen=True)
class VerlAggregation:
    """verl's ``agg_loss`` mode as per-token scales: each token weighs 1 (or ``1/|o_i|``), divided by the
    global count ``denominator`` names (or 1), times ``dp_size`` (data-parallel gradients are averaged),
    and by the horizon ``loss_scale_factor`` (None: the padded response length)."""

    per_response: bool
    denominator: str | None  # "batch_num_tokens", "global_batch_size" or None
    horizon: bool = False


# verl's geo_mean: torch.mean over the micro-batch's rows of each response's loss (its length plus 1e-8 divides
# the token sum), whatever loss_agg_mode and global_batch_info say (METHOD_AGGREGATIONS).
ROW_MEAN = "row-mean"

def _verl_row(loss_agg_mode: str, denominator: str | None, horizon: bool = False) -> VerlAggregation:
    """The plugin's reading of verl's ``global_batch_info`` for a mode, its within-response weight from the
    mode's row of ``FRAMEWORK_AGGREGATIONS`` (one copy of what verl's trainer divides by)."""
    row = FRAMEWORK_AGGREGATIONS[f"verl:{loss_agg_mode}"]
    return VerlAggregation(row.per_response, denominator, horizon)


VERL_AGGREGATIONS: dict[str, VerlAggregation] = {
    "token-mean": _verl_row("token-mean", "batch_num_tokens"),
    "token-sum": _verl_row("token-sum", None),
    "seq-mean-token-sum": _verl_row("seq-mean-token-sum", "global_batch_size"),
    "seq-mean-token-sum-norm": _verl_row("seq-mean-token-sum-norm", "global_batch_size", horizon=True),
    "seq-mean-token-mean": _verl_row("seq-mean-token-mean", "global_batch_size"),
}


def check_loss_agg_mode(loss_agg_mode) -> VerlAggregation:
    if loss_agg_mode not in VERL_AGGREGATIONS:
        raise ValueError(f"{ACTOR}.loss_agg_mode: verl has no aggregation {loss_agg_mode!r}; "
                         f"its aggregations are {', '.join(VERL_AGGREGATIONS)}")
    return VERL_AGGREGATIONS[loss_agg_mode]


def _positive_count(name: str, value):
    """A count from ``global_batch_info``: a number > 0 is checked here (no device read for tensors)."""
    if isinstance(value, bool) or not (torch.is_tensor(value) or isinstance(value, (int, float))):
        raise ValueError(f"global_batch_info[{name!r}] must be a number, got {value!r}")
    if not torch.is_tensor(value) and not (math.isfinite(value) and value > 0):
        raise ValueError(f"global_batch_info[{name!r}] must be > 0, got {value!r}")
    return value


def verl_token_scales(mask: torch.Tensor, loss_agg_mode: str, global_batch_info, dtype) -> torch.Tensor:
    """Per-token scales ``s`` (0 on masked tokens) with ``sum(s * L)`` equal to verl's
    ``agg_loss(L, mask, loss_agg_mode, **global_batch_info)`` on a ``(B, T)`` boolean mask.

    Without a global count (one process, ``dp_size`` 1) verl counts this micro-batch: its tokens, or its
    responses that have a scored token (fully masked responses are left out of the count, as verl does;
    ``dgpo_ops.token_scales`` counts them, as TRL does). An empty micro-batch gives 0, not verl's 0/0.
    ``ROW_MEAN`` (a method's own, not a ``loss_agg_mode``): ``1 / ((|o_i| + 1e-8) B)``, nothing global."""
    if loss_agg_mode == ROW_MEAN:
        lengths = mask.sum(dim=-1, keepdim=True).to(dtype) + 1e-8
        return mask.to(dtype) / lengths / max(mask.shape[0], 1)
    aggregation = check_loss_agg_mode(loss_agg_mode)
    info = dict(global_batch_info or {})
    dp_size = info.get("dp_size")
    dp_size = 1 if dp_size is None else dp_size
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"global_batch_info['dp_size'] must be a positive integer, got {dp_size!r}")
    scale = mask.to(dtype)
    if aggregation.per_response:
        scale = scale / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    if aggregation.denominator is not None:
        count = info.get(aggregation.denominator)
        if count is None:
            if dp_size > 1:
                raise ValueError(f"loss_agg_mode {loss_agg_mode!r} with dp_size {dp_size} needs "
                                 f"global_batch_info[{aggregation.denominator!r}] (verl's engine sets it)")
            local = mask.sum() if aggregation.denominator == "batch_num_tokens" else mask.any(dim=-1).sum()
            count = local.clamp(min=1).to(dtype)
        else:
            count = _positive_count(aggregation.denominator, count)
        scale = scale / count
    if aggregation.horizon:
        horizon = info.get("loss_scale_factor")
        scale = scale / (mask.shape[-1] if horizon is None else _positive_count("loss_scale_factor", horizon))
    return scale * dp_size


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
            if value is None and field in VERL_FALLBACKS:
                field = VERL_FALLBACKS[field]
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
    if _method not in METHODS or _mode not in (ROW_MEAN, *VERL_AGGREGATIONS):
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
