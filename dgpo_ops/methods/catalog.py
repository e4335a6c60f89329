"""Views of the method table that the rest of the project derives instead of listing methods again.

``table.METHODS`` (one row per method) and ``table.ALIASES`` are the only lists of methods. From them come: the
names a user may pass (``POLICY_LOSSES``), each method's parameters with their specs (``method_params``), the
parameters a call by name must add (``required_params``) and the parameter sets the tests run (``variants``).
What a framework's config reads each parameter from lives with that integration (``trainer/method_fields.py``,
``dgpo_ops.integrations.verl_params``, ``dgpo_ops.integrations.skyrl_params``); ``docs/generate.py`` writes
docs/methods.md's and docs/integrations.md's tables from those mappings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dgpo_ops.methods.base import ParamSpec
from dgpo_ops.methods.table import ALIASES, METHODS, resolve

POLICY_LOSSES: tuple[str, ...] = (*METHODS, *ALIASES)


@dataclass(frozen=True)
class MethodParam:
    """One parameter of a method: its keyword, spec and default."""

    method: str
    name: str
    spec: ParamSpec
    default: object


def method_params(method: str) -> list[MethodParam]:
    """Every parameter of a method, with its spec and default."""
    return [MethodParam(method, f.name, f.metadata["param"], f.default)
            for f in dataclasses.fields(METHODS[method].config)]


def required_params(name: str) -> dict:
    """Values for the parameters a method (or alias) has no default for (dro's ``dro_beta``, as verl's; kimi15, an
    alias, presets it), from its first test variant: what a listing or a test of every method by name passes."""
    method, presets = resolve(name)
    required = [p.name for p in method_params(method)
                if p.default is None and not p.spec.optional and p.name not in presets]
    return {param: METHODS[method].variants[0][param] for param in required}


def variants() -> list[tuple[str, dict]]:
    """(method, parameters) of every test variant, in table order."""
    return [(name, dict(params)) for name, spec in METHODS.items() for params in spec.variants]
