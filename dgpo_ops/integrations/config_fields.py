"""Reading a method's parameters from a framework's config, shared by the verl and SkyRL integrations: a field of
a dataclass, a mapping or an OmegaConf node, the ``method_params`` mapping checked against the method's
parameters (an unknown or misspelt name fails, naming the field and the names the method takes), and a value
checked by its ``ParamSpec`` with an error that names the config field it came from; and the docs' table of
where each parameter is read from."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dgpo_ops.methods.base import ParamSpec
from dgpo_ops.methods.catalog import MethodParam, format_value
from dgpo_ops.methods.catalog import method_params as table_params
from dgpo_ops.methods.table import ALIASES, METHODS

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


def method_table_markdown(framework: str, name_field: str, config_path: str, params_field: str,
                          loss_name: Callable[[str], str], field_text: Callable[[MethodParam], str | None]) -> str:
    """A framework's table of loss names (``loss_name(method)``), papers and where each parameter is read from:
    ``field_text(param)`` describes the field of the framework's config at ``config_path`` that means it (None:
    ``params_field``, the ``method_params`` mapping, with the table's default)."""
    lines = [f"| `{name_field}` | paper | from `{config_path}` | from `{params_field}` (default) |",
             "|---|---|---|---|"]
    for method, spec in METHODS.items():
        params = table_params(method)
        fields = [text for p in params if (text := field_text(p)) is not None]
        own = [f"`{p.name}={format_value(p.default)}`" for p in params if field_text(p) is None]
        lines.append(f"| `{loss_name(method)}` | {spec.paper} | {'<br>'.join(fields) or '-'} | "
                     f"{', '.join(own) or '-'} |")
    for name, alias in ALIASES.items():
        presets = ", ".join(f"`{k}={format_value(v)}`" for k, v in alias.params.items())
        lines.append(f"| `{loss_name(name)}` | {alias.summary}: `{loss_name(alias.method)}` with {presets} (over "
                     f"{framework}'s field) | as `{loss_name(alias.method)}` | as `{loss_name(alias.method)}` |")
    return "\n".join(lines) + "\n"
