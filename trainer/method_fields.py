"""Where ``DGPOConfig`` (TRL's ``GRPOConfig`` and the fields it adds) reads each method parameter, and the views
derived from that one mapping: the config fields and their defaults and help (``dgpo-ops train``'s presets and
docs/methods.md's table, written by ``python docs/generate.py``, are made from them).

The mapping is TRL's spec (``dgpo_ops.frameworks.trl``): a parameter keeps TRL's meaning where TRL has a field for
it (``epsilon``, ``epsilon_high``, ``delta``); every other field is added to ``DGPOConfig`` from here
(``config.py``). The method table itself knows no framework.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgpo_ops.frameworks.core import ConfigField
from dgpo_ops.frameworks.trl import SPEC as TRL
from dgpo_ops.methods.base import ParamSpec
from dgpo_ops.methods.catalog import MethodParam, method_params
from dgpo_ops.methods.table import METHODS


@dataclass(frozen=True)
class ConfigParam:
    """One method parameter and the config field it is read from."""

    method: str
    name: str  # the parameter's keyword in dgpo-ops
    spec: ParamSpec
    default: object
    field: ConfigField | None


def config_field(param: MethodParam) -> ConfigField | None:
    """The field ``param`` is read from (None: fixed at its default): TRL's spec (``dgpo_ops.frameworks.trl``),
    whose fields keep TRL's meaning and give any other parameter a field named after its method."""
    return TRL.fields.field_of(param)


def config_method_params(method: str) -> list[ConfigParam]:
    """Every parameter of a method with the field it is read from."""
    return [ConfigParam(p.method, p.name, p.spec, p.default, config_field(p)) for p in method_params(method)]


def config_params() -> dict[str, list[ConfigParam]]:
    """Config field -> the method parameters read from it, in table order."""
    fields: dict[str, list[ConfigParam]] = {}
    for method in METHODS:
        for p in config_method_params(method):
            if p.field is not None:
                fields.setdefault(p.field.name, []).append(p)
    return fields


def config_default(params: list[ConfigParam]):
    """The config field's default: the methods' common default (offset applied), None where they differ
    (None then means each method's own default)."""
    defaults = {p.field.to_config(p.default) for p in params}
    return defaults.pop() if len(defaults) == 1 else None


def none_means_default(params: list[ConfigParam]) -> bool:
    """Whether the field holds None by default, meaning each method's own default: the methods'
    defaults differ and one of them lets None turn its feature off (``dual_clip``)."""
    return config_default(params) is None and any(p.spec.optional for p in params)


def config_help(params: list[ConfigParam]) -> str:
    """Help text of a config field, from the specs of the parameters it feeds."""
    methods = ", ".join(p.method for p in params)
    first = params[0]
    text = f"{methods}: {first.spec.help}"
    if first.field.offset:
        text += f" (this field is {first.name} + {first.field.offset:g})"
    if none_means_default(params):
        text += "; None: the method's default (" + ", ".join(f"{p.method} {p.default}" for p in params) + ")"
    return text + f"; {first.spec.describe()}"
