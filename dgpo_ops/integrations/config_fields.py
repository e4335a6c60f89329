"""Reading a method's parameters from a framework's config, shared by the verl and SkyRL integrations: a field of
a dataclass, a mapping or an OmegaConf node, the ``method_params`` mapping checked against the method's
parameters (an unknown or misspelt name fails, naming the field and the names the method takes), and a value
checked by its ``ParamSpec`` with an error that names the config field it came from."""

from __future__ import annotations

from collections.abc import Mapping

from dgpo_ops.methods.base import ParamSpec
from dgpo_ops.methods.catalog import method_params as table_params

REQUIRED = object()


def read_field(config, name: str, where: str, expected: str, default=REQUIRED):
    """``config.name`` from a dataclass that may also be a mapping (verl's ``ActorConfig``), a mapping or an
    OmegaConf node; missing: ``default``, or a ``ValueError`` naming ``where.name`` and what config the caller
    expected."""
    try:
        return config[name]
    except (KeyError, AttributeError, TypeError):
        try:
            return getattr(config, name)
        except AttributeError:
            if default is not REQUIRED:
                return default
            raise ValueError(f"{where}.{name} is missing: {expected}, got {type(config).__name__}") from None


def checked_value(method: str, name: str, spec: ParamSpec, value, source: str):
    """``value`` if ``spec`` accepts it for ``method``'s parameter ``name``; else a ``ValueError`` naming ``source``
    (the config field it was read from)."""
    try:
        spec.check(method, name, value)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    return value


def check_method_params(method: str, given, where: str) -> dict:
    """A ``method_params`` mapping (the config field ``where``) checked against ``method``'s parameters: names and
    values."""
    if not isinstance(given, Mapping):
        raise ValueError(f"{where} must be a mapping of parameter names to values, got {given!r}")
    params = {p.name: p for p in table_params(method)}
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: {method} has no parameter {unknown[0]!r}; "
                         f"it takes {', '.join(params) or 'none'}")
    return {name: checked_value(method, name, params[name].spec, value, f"{where}.{name}")
            for name, value in given.items()}
