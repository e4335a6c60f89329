"""Views of the method table that the rest of the project derives instead of listing methods again.

``methods.METHODS`` (one row per method) and ``methods.ALIASES`` are the only lists of methods. From
them come: the names a user may pass (``POLICY_LOSSES``), the trainer's config fields and their
meaning (``config_params``, read by ``trainer/config.py``), the presets of ``dgpo-ops train``
(``trainer_presets``), the parameter sets the tests run (``variants``) and the README's method table
(``method_table_markdown``; ``python -m dgpo_ops.methods.catalog`` rewrites it).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from dataclasses import dataclass

from dgpo_ops.methods.base import ParamSpec
from dgpo_ops.methods.table import ALIASES, METHODS, resolve

POLICY_LOSSES: tuple[str, ...] = (*METHODS, *ALIASES)


@dataclass(frozen=True)
class ConfigParam:
    """One method parameter read from a trainer config field."""

    method: str
    name: str  # the parameter's keyword in dgpo-ops
    spec: ParamSpec
    default: object


def method_params(method: str) -> list[ConfigParam]:
    """Every parameter of a method, with its spec and default."""
    return [ConfigParam(method, f.name, f.metadata["param"], f.default)
            for f in dataclasses.fields(METHODS[method].config)]


def config_params() -> dict[str, list[ConfigParam]]:
    """Trainer config field -> the method parameters read from it, in table order."""
    fields: dict[str, list[ConfigParam]] = {}
    for method in METHODS:
        for p in method_params(method):
            if p.spec.config_field is not None:
                fields.setdefault(p.spec.config_field, []).append(p)
    return fields


def config_default(params: list[ConfigParam]):
    """The config field's default: the methods' common default (offset applied), None where they differ
    (None then means each method's own default)."""
    defaults = {p.spec.to_config(p.default) for p in params}
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
    if first.spec.config_offset:
        text += f" (this field is {first.name} + {first.spec.config_offset:g})"
    if none_means_default(params):
        text += "; None: the method's default (" + ", ".join(f"{p.method} {p.default}" for p in params) + ")"
    return text + f"; {first.spec.describe()}"


def trainer_presets(name: str) -> dict:
    """``DGPOConfig`` values ``dgpo-ops train`` applies for a method or alias unless given: the defaults of
    parameters read with an offset (TRL's default of their field means something else), the alias's
    parameters, in config terms, then the method's own presets."""
    method, alias_params = resolve(name)
    presets = {}
    for p in method_params(method):
        if p.spec.config_field is None:
            continue
        if p.name in alias_params:
            presets[p.spec.config_field] = p.spec.to_config(alias_params[p.name])
        elif p.spec.config_offset:
            presets[p.spec.config_field] = p.spec.to_config(p.default)
    return {**presets, **METHODS[method].presets}


def required_params(name: str) -> dict:
    """Values for the parameters a method (or alias) has no default for (dro's ``dro_beta``, as verl's), from its
    first test variant: what a listing or a test of every method by name passes."""
    method, _ = resolve(name)
    required = [p.name for p in method_params(method) if p.default is None and not p.spec.optional]
    return {param: METHODS[method].variants[0][param] for param in required}


def variants() -> list[tuple[str, dict]]:
    """(method, parameters) of every test variant, in table order."""
    return [(name, dict(params)) for name, spec in METHODS.items() for params in spec.variants]


def format_value(value) -> str:
    return repr(value) if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


def method_table_markdown() -> str:
    """The README's table of methods, parameters, accepted values and trainer fields."""
    lines = ["| method | what it does | parameters: default, accepted values | `DGPOConfig` / `dgpo-ops train` field |",
             "|---|---|---|---|"]
    none_fields = {field for field, params in config_params().items() if none_means_default(params)}

    def source(p: ConfigParam) -> str:
        if p.spec.config_field is None:
            return f"`{p.name}`: fixed at its default"
        text = f"`{p.name}` <- `{p.spec.config_field}`"
        if p.spec.config_offset:
            text += f" - {p.spec.config_offset:g}"
        if p.spec.config_fallback:
            text += f" (None: `{p.spec.config_fallback}`)"
        elif p.spec.config_field in none_fields and p.default is not None:
            text += " (None: the default)"
        return text

    for name, spec in METHODS.items():
        params = method_params(name)
        described = "<br>".join(f"`{p.name}={format_value(p.default)}`: {p.spec.describe()}" for p in params) or "none"
        fields = "<br>".join(source(p) for p in params) or "-"
        presets = ", ".join(f"`{k}={format_value(v)}`" for k, v in trainer_presets(name).items())
        lines.append(f"| `{name}` | {spec.summary}" + (f"; `dgpo-ops train` presets {presets}" if presets else "")
                     + f" | {described} | {fields} |")
    for name, alias in ALIASES.items():
        params = ", ".join(f"`{k}={format_value(v)}`" for k, v in alias.params.items())
        lines.append(f"| `{name}` | {alias.summary}: `{alias.method}` with {params} where unset | as `{alias.method}` "
                     f"| as `{alias.method}` |")
    return "\n".join(lines) + "\n"


START, END = "<!-- methods:start -->", "<!-- methods:end -->"


def readme_with_section(text: str, start: str, end: str, body: str) -> str:
    """``text`` with the part between the markers ``start`` and ``end`` replaced by ``body``."""
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {start} ... {end} section")
    return pattern.sub(lambda _: f"{start}\n{body}{end}", text)


def readme_with_method_table(text: str) -> str:
    """``text`` with the part between the method-table markers replaced by the current table."""
    return readme_with_section(text, START, END, method_table_markdown())


README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def main() -> None:
    README.write_text(readme_with_method_table(README.read_text()))
    print(f"wrote the method table of {README}")


if __name__ == "__main__":
    main()
