"""The SkyRL integration's names, hyperparameters and off-policy correction, derived from the method table without
importing SkyRL (``dgpo_ops.integrations.skyrl`` registers them; docs/integrations.md's SkyRL table comes from here,
through ``docs/generate.py``).

* Every method and alias of the table (``catalog.POLICY_LOSSES``) is the SkyRL policy loss ``dgpo_ops.<name>``
  (SkyRL has its own ``cispo``, ``gspo``, ``sapo``, ... : the prefix keeps every name apart from SkyRL's).
* A parameter comes from ``trainer.algorithm.method_params.<name>`` when set there (a field of
  ``dgpo_ops.integrations.skyrl.AlgorithmConfig``), else from the field of SkyRL's ``AlgorithmConfig`` that means the
  same (SkyRL's spec, ``dgpo_ops.frameworks.skyrl``: ``eps_clip_low/high``, ``sapo.tau_pos/neg``, ``cispo.cispo_eps_clip_low/high``,
  ``dppo.delta_low/high``, ``clip_cov.*``, ``kl_cov.*``), else it keeps the table's default. An alias's parameters
  (dapo's ``eps_high=0.28``) win over SkyRL's fields, as ``method_params`` does.
* SkyRL's ``clip_ratio_c`` is its ``dual_clip`` loss's parameter, not ``regular``'s: the dual clip of
  ``dgpo_ops.grpo`` (and of gppo, ce_gppo, aspo) is ``method_params.dual_clip`` (default off), as SkyRL's ``regular``.
* ``off_policy_correction`` becomes a ``SkyRLCorrection`` (None where SkyRL's ``off_policy_correction_enabled`` is
  false).
"""

from __future__ import annotations

import dataclasses

from dgpo_ops.core.options import IMPORTANCE_SAMPLING_LEVELS, LossOptions
from dgpo_ops.corrections.skyrl import SkyRLCorrection
from dgpo_ops.frameworks.skyrl import SPEC as SKYRL
from dgpo_ops.integrations.config_fields import (
    check_method_params,
    checked_value,
    read_field,
)
from dgpo_ops.methods.catalog import POLICY_LOSSES, MethodParam
from dgpo_ops.methods.catalog import method_params as table_params
from dgpo_ops.methods.table import METHODS, resolve

PREFIX = "dgpo_ops."
ALGORITHM = SKYRL.fields.root
METHOD_PARAMS = f"{ALGORITHM}.{SKYRL.fields.params_field}"
CORRECTION = SKYRL.correction_config
EXPECTED = "the policy losses dgpo_ops.* take SkyRL's algorithm config (trainer.algorithm, an AlgorithmConfig)"

# The methods whose behaviour policy is the inference engine's where SkyRL passes its log-probs, as SkyRL's own
# rollout_is (which needs them) and dppo (which takes them when given) form their ratio against rollout_logprobs;
# old_log_probs still feed the off-policy correction.
ROLLOUT_BEHAVIOUR = ("rollout_is", "dppo_tv", "dppo_kl", "prime_dppo", "prime_ipo")
NEEDS_ROLLOUT_LOGPROBS = ("rollout_is",)


def skyrl_field(param: MethodParam) -> str | None:
    """The path under ``trainer.algorithm`` of the SkyRL field that means ``param`` (SkyRL's spec,
    ``dgpo_ops.frameworks.skyrl``), None where only ``method_params`` sets it."""
    field = SKYRL.fields.field_of(param)
    return None if field is None else field.path


def loss_type(name: str) -> str:
    """SkyRL's ``trainer.algorithm.policy_loss_type`` name of a method or alias of the table."""
    resolve(name)  # unknown names raise
    return PREFIX + name


LOSS_TYPES: dict[str, str] = {loss_type(name): name for name in POLICY_LOSSES}


def read_path(config, path: str):
    """The field at a dotted ``path`` of SkyRL's algorithm config."""
    where = ALGORITHM
    for part in path.split("."):
        config = read_field(config, part, where, EXPECTED)
        where = f"{where}.{part}"
    return config


def params_from_skyrl(name: str, config) -> dict:
    """The parameters of the method or alias ``name`` from SkyRL's algorithm ``config``: ``method_params`` first,
    then the alias's presets, then the SkyRL field that means the same, else the table's default (left out here)."""
    method, presets = resolve(name)
    given = {**presets, **check_method_params(method, read_field(config, "method_params", ALGORITHM, EXPECTED,
                                                                 default=None) or {}, METHOD_PARAMS)}
    values = {}
    for p in table_params(method):
        if p.name in given:
            values[p.name] = given[p.name]
        elif (path := skyrl_field(p)) is not None:
            values[p.name] = checked_value(method, p.name, p.spec, read_path(config, path), f"{ALGORITHM}.{path}")
    return values


def check_level(level) -> str:
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"{ALGORITHM}.importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                         f"got {level!r}")
    return level


def loss_options(policy_loss_type: str, config) -> LossOptions:
    """The loss options of SkyRL's ``policy_loss_type`` ``dgpo_ops.<method>`` under ``config`` (SkyRL's trainer
    normalises by ``loss_reduction`` before the loss: the options sum, ``token_sum``)."""
    if policy_loss_type not in LOSS_TYPES:
        raise ValueError(f"{ALGORITHM}.policy_loss_type: unknown dgpo-ops loss {policy_loss_type!r}; known: "
                         f"{', '.join(LOSS_TYPES)}")
    name = LOSS_TYPES[policy_loss_type]
    level = check_level(read_field(config, "importance_sampling_level", ALGORITHM, EXPECTED, default="token"))
    return LossOptions.build(resolve(name)[0], aggregation="token_sum", importance_sampling_level=level,
                             **params_from_skyrl(name, config))


CORRECTION_FIELDS = SKYRL.correction_fields
# the parts of off_policy_correction each of which turns it on (off_policy_correction_enabled)
CORRECTION_SWITCHES = ("tis_ratio_type", "sequence_mask_metric", "outlier_token_is_threshold_low",
                       "outlier_token_is_threshold_high", "token_mask_is_threshold_low", "token_mask_is_threshold_high")


def correction_from_skyrl(config) -> SkyRLCorrection | None:
    """SkyRL's ``off_policy_correction`` as a ``SkyRLCorrection``, None where none of its parts is set. A field of
    SkyRL's correction config that ``SkyRLCorrection`` does not know fails, naming it (a mapping's keys too)."""
    correction = read_field(config, "off_policy_correction", ALGORITHM, EXPECTED, default=None)
    if correction is None:
        return None
    if dataclasses.is_dataclass(correction):
        names = [f.name for f in dataclasses.fields(correction)]
    elif hasattr(correction, "keys"):
        names = list(correction.keys())
    else:
        raise ValueError(f"{CORRECTION} must be SkyRL's OffPolicyCorrectionConfig or a mapping, got "
                         f"{type(correction).__name__}")
    unknown = sorted(set(names) - set(CORRECTION_FIELDS))
    if unknown:
        raise ValueError(f"{CORRECTION}.{unknown[0]}: not a field of SkyRL's off-policy correction that dgpo-ops "
                         f"knows ({', '.join(CORRECTION_FIELDS)})")
    fields = {name: read_field(correction, name, CORRECTION, EXPECTED) for name in names}
    if all(fields.get(name) is None for name in CORRECTION_SWITCHES):
        return None
    try:
        return SkyRLCorrection(**fields)
    except ValueError as error:
        raise ValueError(f"{CORRECTION}: {error}") from None


for _method, _param in SKYRL.fields.by_method:  # every override names a real parameter
    if _param not in {p.name for p in table_params(_method)}:
        raise AssertionError(f"SkyRL's by_method[({_method!r}, {_param!r})]: {_method} has no such parameter")
if not set(ROLLOUT_BEHAVIOUR) <= set(METHODS):
    raise AssertionError(f"ROLLOUT_BEHAVIOUR names a method the table lacks: {set(ROLLOUT_BEHAVIOUR) - set(METHODS)}")

