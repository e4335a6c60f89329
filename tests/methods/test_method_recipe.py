"""A method is one row: every list of methods, fields, presets and variants the project keeps is derived
from ``dgpo_ops.methods.table.METHODS`` / ``ALIASES`` (the recipe in docs/design.md, "Adding a method")."""

from __future__ import annotations

import dataclasses
import math
import pathlib

import pytest
from dgpo_ops.kernels.interface import MethodId
from helpers import METHOD_VARIANTS, required_fields

from dgpo_ops.methods import catalog
from dgpo_ops.methods.base import ParamSpec
from dgpo_ops.methods.styles import STYLES, style
from dgpo_ops.methods.table import ALIASES, GATES, METHODS, method_config

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_every_row_is_complete():
    for name, spec in METHODS.items():
        assert spec.config.name == name
        assert isinstance(spec.config.method_id, MethodId)
        assert spec.summary and callable(spec.token_fn)
        assert "|" not in spec.summary + spec.paper, f"{name}: a '|' splits its row of the README's table"
        for field in dataclasses.fields(spec.config):
            assert isinstance(field.metadata.get("param"), ParamSpec), f"{name}.{field.name} has no ParamSpec"
            assert "|" not in field.metadata["param"].help, f"{name}.{field.name}: a '|' splits a README row"
        required = [f.name for f in dataclasses.fields(spec.config)
                    if f.default is None and not f.metadata["param"].optional]
        if required:  # a parameter without a default (dro's dro_beta, as verl's): leaving it out is an error
            with pytest.raises(ValueError, match=f"{name}: {required[0]} must be in .*, got None"):
                method_config(name)
            assert all(set(required) <= set(params) for params in spec.variants)
        else:
            method_config(name)  # the defaults pass the row's own checks
        for params in spec.variants:
            method_config(name, **params)
    for alias, row in ALIASES.items():
        assert alias not in METHODS and row.method in METHODS
        method_config(row.method, **row.params)


def test_the_test_variants_are_the_rows_variants():
    assert METHOD_VARIANTS == [(name, dict(p)) for name, spec in METHODS.items() for p in spec.variants]
    for name, spec in METHODS.items():
        for field in dataclasses.fields(spec.config):
            for choice in field.metadata["param"].choices or ():
                assert any(p.get(field.name, field.default) == choice for p in spec.variants), \
                    f"{name}: no test variant has {field.name}={choice!r}"


def test_every_policy_loss_and_gate_has_its_own_colour(monkeypatch):
    keys = [*catalog.POLICY_LOSSES, *(f"sapo {gate}" for gate in GATES)]
    colours = [style(key)["color"] for key in keys if key not in ("sapo", "sapo sigmoid")]
    assert len(set(colours)) == len(colours)
    # A method added without a colour gets a spare one, distinct from every chosen colour.
    monkeypatch.setattr(catalog, "POLICY_LOSSES", (*catalog.POLICY_LOSSES, "new_method"))
    assert style("new_method")["color"] not in {c for c, _ in STYLES.values()}
    with pytest.raises(KeyError, match="no style for 'ppo'"):
        style("ppo")


def test_a_parameter_check_fails_on_values_outside_its_range():
    spec = ParamSpec(help="x", low=1.0, low_open=True)
    spec.check("m", "x", 1.5)
    for bad in (1.0, 0.0, math.nan, math.inf, None, True, "2"):
        with pytest.raises(ValueError, match="m: x must be"):
            spec.check("m", "x", bad)
    ParamSpec(help="x", low=1.0, optional=True).check("m", "x", None)
    with pytest.raises(ValueError, match="one of"):
        ParamSpec(help="g", choices=("a", "b")).check("m", "g", "c")


# ---- the trainer's config and command line (need TRL) ----


@pytest.fixture(scope="module")
def trainer_modules():
    pytest.importorskip("trl")
    from dgpo_ops.trainer import config
    from dgpo_ops.trainer.app import cli

    return config, cli


def test_the_readme_method_table_is_generated_from_the_table():
    from dgpo_ops.trainer.method_fields import readme_with_method_table

    text = README.read_text()
    assert readme_with_method_table(text) == text, "run `python -m dgpo_ops.trainer.method_fields`"
    for name in catalog.POLICY_LOSSES:
        assert f"| `{name}` |" in text


def test_a_parameter_without_a_listed_field_gets_one_named_after_its_method():
    """A new method's parameters reach DGPOConfig without an edit of the trainer: the field is derived."""
    from dgpo_ops.trainer import method_fields

    spec = ParamSpec(help="x")
    assert method_fields.config_field(catalog.MethodParam("new_method", "k", spec, 1.0)).name == "new_method_k"
    assert method_fields.config_field(catalog.MethodParam("new_method", "new_method_k", spec, 1.0)).name == \
        "new_method_k"
    # every listed field is read by a method, and listing a parameter that would derive the same name is redundant
    params = [p for method in METHODS for p in catalog.method_params(method)]
    assert set(method_fields.FIELDS) <= {p.name for p in params}, "FIELDS names a parameter no method has"
    for name, field in method_fields.FIELDS.items():
        readers = [p for p in params if p.name == name]
        derived = [p.name if p.name.startswith(p.method) else f"{p.method}_{p.name}" for p in readers]
        assert any(field.name != d for d in derived), f"FIELDS[{name!r}] is the field it would derive anyway"
    assert {method for method, _ in method_fields.METHOD_FIELDS} <= set(METHODS)
    assert set(method_fields.PRESETS) <= set(METHODS)


def test_the_verl_mapping_names_only_parameters_of_the_table():
    from dgpo_ops.integrations import verl_params

    names = {p.name for method in METHODS for p in catalog.method_params(method)}
    assert set(verl_params.VERL_FIELDS) <= names
    assert {method for method, _ in verl_params.METHOD_VERL_FIELDS} <= set(METHODS)
    assert set(verl_params.METHOD_AGGREGATIONS) <= set(METHODS)


def make_config(config_module, tmp_path, **fields):
    return config_module.DGPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **fields)


def test_dgpo_config_has_a_field_for_every_config_field_of_the_table(trainer_modules):
    config, _ = trainer_modules
    fields = {f.name: f for f in dataclasses.fields(config.DGPOConfig)}
    from dgpo_ops.trainer import method_fields

    for field_name, params in method_fields.config_params().items():
        assert field_name in fields, field_name
        if field_name not in config.TRL_FIELDS:  # added from the table: its default and help come from it
            assert fields[field_name].default == method_fields.config_default(params)
            assert fields[field_name].metadata["help"] == method_fields.config_help(params)
    assert set(config.method_field_names()) == set(method_fields.config_params())


@pytest.mark.parametrize("name", catalog.POLICY_LOSSES)
def test_each_config_field_reaches_its_parameter(trainer_modules, tmp_path, name):
    """Setting a field to a value other than the default moves exactly the parameter that reads it."""
    from dgpo_ops.trainer import method_fields

    config, _ = trainer_modules
    method, alias_params = catalog.resolve(name)
    presets = {**method_fields.trainer_presets(name), **required_fields(name)}
    params = method_fields.config_method_params(method)
    base = make_config(config, tmp_path, policy_loss=name, **presets).method()
    assert base.name == method
    for param, value in alias_params.items():
        assert getattr(base, param) == value
    for p in params:  # a field read with an offset is preset to the method's default
        if p.field is not None and p.field.offset and p.name not in alias_params:
            assert presets[p.field.name] == p.field.to_config(p.default)
            assert getattr(base, p.name) == p.default
    for p in params:
        if p.field is None:
            continue
        current = getattr(base, p.name)
        if p.spec.choices:
            new_value = next(c for c in p.spec.choices if c != current)
            field_value = new_value
        else:
            new_value = (current or 2.0) * 1.25 if p.spec.high is None else (current + (p.spec.low or 0.0)) / 2
            field_value = p.field.to_config(new_value)
        changed = make_config(config, tmp_path, **{**presets, "policy_loss": name,
                                                   p.field.name: field_value}).method()
        assert getattr(changed, p.name) == pytest.approx(new_value) if not p.spec.choices \
            else getattr(changed, p.name) == new_value
        others = {q.name for q in params
                  if q.field is not None and q.field.name != p.field.name and q.field.fallback != p.field.name}
        for other in others:
            assert getattr(changed, other) == getattr(base, other), (p.name, other)


def test_policy_loss_and_method_choices_are_the_table(trainer_modules, tmp_path):
    config, cli = trainer_modules
    with pytest.raises(ValueError) as error:
        make_config(config, tmp_path, policy_loss="ppo")
    for name in catalog.POLICY_LOSSES:
        assert name in str(error.value)
    parser = cli.build_parser()
    method_action = next(a for a in parser._actions if a.dest == "method")
    assert tuple(method_action.choices) == catalog.POLICY_LOSSES
    flags = {a.dest for a in parser._actions}
    from dgpo_ops.trainer.method_fields import config_params, trainer_presets

    for field_name in config_params():
        assert field_name in flags, f"dgpo-ops train has no flag for {field_name}"
    assert cli.METHOD_PRESETS == {n: trainer_presets(n) for n in catalog.POLICY_LOSSES if trainer_presets(n)}


def test_the_recipe_names_real_files_and_commands_and_its_derived_lists_cover_every_method():
    """docs/design.md, "Adding a method": every path it names exists, every `python -m` module it runs is a
    module with a main, and each list it says is derived covers every method of the table."""
    import importlib
    import re

    from dgpo_ops.trainer import method_fields

    import dgpo_ops
    from dgpo_ops.integrations import verl_params
    from dgpo_ops.methods import table

    root = README.parent
    design = (root / "docs" / "design.md").read_text()
    recipe = design[design.index("## Adding a method"):design.index("## Layout")]
    paths = set(re.findall(r"`((?:dgpo_ops|kernels|trainer|docs|tests|bench)/[\w/.]+\.(?:py|md))`", recipe))
    assert {"dgpo_ops/methods/table.py", "trainer/method_fields.py", "docs/math.md", "kernels/method_table.py",
            "dgpo_ops/integrations/verl_params.py"} <= paths
    for path in paths:
        assert (root / path).exists(), f"the recipe names {path}, which is not in the repository"
    for module in re.findall(r"python -m ([\w.]+)", recipe):
        assert callable(getattr(importlib.import_module(module), "main", None)), module
    # each file named after a method holds that method's row, and table.FAMILIES lists every family file
    family_files = {path.stem for path in (root / "dgpo_ops" / "methods").glob("*.py")} - {
        "__init__", "base", "clip", "gspo", "selection", "table", "catalog", "styles", "atlas"}
    assert {family.__name__.rpartition(".")[2] for family in table.FAMILIES} == family_files
    for name, spec in METHODS.items():
        module = spec.config.__module__.rpartition(".")[2]
        assert name == module or name.startswith(module) or module in family_files, name
        # its torch terms beside it, or a piece several methods share (geo_mean's and kl_cov's unclipped ratio)
        assert spec.token_fn.__module__ in (spec.config.__module__, "dgpo_ops.methods.clip"), name
    # the derived lists
    readme, integrations = README.read_text(), (root / "docs" / "integrations.md").read_text()
    for name, spec in METHODS.items():
        assert getattr(dgpo_ops, spec.config.__name__) is spec.config
        assert name in catalog.POLICY_LOSSES and any(method == name for method, _ in catalog.variants())
        assert f"| `{name}` |" in readme and f"| `{verl_params.loss_mode(name)}` |" in integrations
        assert f"### `{name}`" in (root / "docs" / "math.md").read_text()
        assert all(p.field is None or p.field.name for p in method_fields.config_method_params(name))
