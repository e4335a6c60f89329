"""Where ``DGPOConfig`` (TRL's ``GRPOConfig`` and the fields it adds) reads each method parameter, and the views
derived from that one mapping: the config fields and their defaults and help (``dgpo-ops train``'s presets and
docs/methods.md's table, written by ``python docs/generate.py``, are made from them).

A parameter keeps TRL's meaning where TRL has a field for it (``epsilon``, ``epsilon_high``, ``delta``); every
other field is added to ``DGPOConfig`` from here (``config.py``). The method table itself knows no framework.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgpo_ops.methods.base import ParamSpec
from dgpo_ops.methods.catalog import MethodParam, method_params
from dgpo_ops.methods.table import METHODS


@dataclass(frozen=True)
class ConfigField:
    """A config field that a method parameter is read from. None in the field means the method's default, except
    where ``fallback`` names the field whose value stands in (TRL's ``epsilon_high=None`` means ``epsilon``).
    ``offset`` is added on the way to the config (CISPO's cap ``1 + eps_high`` is TRL's ``epsilon_high``)."""

    name: str
    fallback: str | None = None
    offset: float = 0.0

    def to_config(self, value):
        """The parameter's value in the field's terms."""
        return value if value is None or isinstance(value, str) else value + self.offset

    def from_config(self, value):
        """The parameter's value from the field's value."""
        return value if value is None or isinstance(value, str) else value - self.offset


# The field of a method parameter that is not named after its method, by the parameter's name: TRL's own fields
# (a parameter keeps TRL's meaning), and names several methods share. Any other parameter is read from a field of
# its own named after the method (``config_field``): dgpo's ``n`` from ``dgpo_n``, dro's ``dro_beta`` from itself.
FIELDS: dict[str, ConfigField] = {
    "eps_low": ConfigField("epsilon"),
    "eps_high": ConfigField("epsilon_high", fallback="epsilon"),
    "dual_clip": ConfigField("dual_clip"),
    "delta": ConfigField("delta"),
    "beta1": ConfigField("gppo_beta1"),  # ce_gppo's (gppo's boundary scales are fixed at 1)
    "beta2": ConfigField("gppo_beta2"),
    "tau_pos": ConfigField("sapo_temperature_pos"),  # TRL's names for SAPO's temperatures
    "tau_neg": ConfigField("sapo_temperature_neg"),
    "delta_low": ConfigField("dppo_delta_low"),  # dppo_tv's and dppo_kl's
    "delta_high": ConfigField("dppo_delta_high"),
    "is_cap": ConfigField("dppo_is_cap"),
    "ppo_kl_coef": ConfigField("ppo_kl_coef"),  # kl_cov's, verl's name
    "adv_tau": ConfigField("prime_adv_tau"),  # prime_dppo's and prime_ipo's
    "kl_tau": ConfigField("prime_kl_tau"),
}
# A method that reads a parameter of that name otherwise; None: the trainer leaves it at its default.
METHOD_FIELDS: dict[tuple[str, str], ConfigField | None] = {
    # TRL's CISPO has no lower bound on the weight and calls the cap itself epsilon_high
    ("cispo", "eps_low"): None,
    ("cispo", "eps_high"): ConfigField("epsilon_high", fallback="epsilon", offset=1.0),
}


@dataclass(frozen=True)
class ConfigParam:
    """One method parameter and the config field it is read from."""

    method: str
    name: str  # the parameter's keyword in dgpo-ops
    spec: ParamSpec
    default: object
    field: ConfigField | None


def config_field(param: MethodParam) -> ConfigField | None:
    """The field ``param`` is read from (None: fixed at its default): ``METHOD_FIELDS``, else ``FIELDS``, else a
    field named after the method (the parameter's own name where it already starts with the method's)."""
    key = (param.method, param.name)
    if key in METHOD_FIELDS:
        return METHOD_FIELDS[key]
    if param.name in FIELDS:
        return FIELDS[param.name]
    return ConfigField(param.name if param.name.startswith(param.method) else f"{param.method}_{param.name}")


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
