"""A method is one row: every list of methods, fields, presets and variants the project keeps is derived
from ``dgpo_ops.methods.table.METHODS`` / ``ALIASES`` (the recipe in docs/design.md, "Adding a method")."""

from __future__ import annotations

import dataclasses
import math
import pathlib

import pytest
from helpers import METHOD_VARIANTS, required_fields

from dgpo_ops.kernels.interface import MethodId
from dgpo_ops.methods import catalog
from dgpo_ops.methods.styles import STYLES, style
from dgpo_ops.methods.table import ALIASES, GATES, METHODS, ParamSpec, method_config

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


def test_the_readme_method_table_is_generated_from_the_table():
    text = README.read_text()
    assert catalog.readme_with_method_table(text) == text, "run `python -m dgpo_ops.methods.catalog`"
    for name in catalog.POLICY_LOSSES:
        assert f"| `{name}` |" in text


def test_a_parameter_check_fails_on_values_outside_its_range():
    spec = ParamSpec(help="x", low=1.0, low_open=True, config_field="x")
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
    from dgpo_ops.trainer import cli, config

    return config, cli


def make_config(config_module, tmp_path, **fields):
    return config_module.DGPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **fields)


def test_dgpo_config_has_a_field_for_every_config_field_of_the_table(trainer_modules):
    config, _ = trainer_modules
    fields = {f.name: f for f in dataclasses.fields(config.DGPOConfig)}
    for field_name, params in catalog.config_params().items():
        assert field_name in fields, field_name
        if field_name not in config.TRL_FIELDS:  # added from the table: its default and help come from it
            assert fields[field_name].default == catalog.config_default(params)
            assert fields[field_name].metadata["help"] == catalog.config_help(params)
    assert set(config.method_field_names()) == set(catalog.config_params())


@pytest.mark.parametrize("name", catalog.POLICY_LOSSES)
def test_each_config_field_reaches_its_parameter(trainer_modules, tmp_path, name):
    """Setting a field to a value other than the default moves exactly the parameter that reads it."""
    config, _ = trainer_modules
    method, alias_params = catalog.resolve(name)
    presets = {**catalog.trainer_presets(name), **required_fields(name)}
    base = make_config(config, tmp_path, policy_loss=name, **presets).method()
    assert base.name == method
    for param, value in alias_params.items():
        assert getattr(base, param) == value
    for p in catalog.method_params(method):  # a field read with an offset is preset to the method's default
        if p.spec.config_offset and p.name not in alias_params:
            assert presets[p.spec.config_field] == p.spec.to_config(p.default)
            assert getattr(base, p.name) == p.default
    for p in catalog.method_params(method):
        if p.spec.config_field is None:
            continue
        current = getattr(base, p.name)
        if p.spec.choices:
            new_value = next(c for c in p.spec.choices if c != current)
            field_value = new_value
        else:
            new_value = (current or 2.0) * 1.25 if p.spec.high is None else (current + (p.spec.low or 0.0)) / 2
            field_value = new_value + p.spec.config_offset
        changed = make_config(config, tmp_path, **{**presets, "policy_loss": name,
                                                   p.spec.config_field: field_value}).method()
        assert getattr(changed, p.name) == pytest.approx(new_value) if not p.spec.choices \
            else getattr(changed, p.name) == new_value
        others = {q.name for q in catalog.method_params(method)
                  if q.spec.config_field not in (p.spec.config_field, None) and q.spec.config_fallback
                  != p.spec.config_field}
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
    for field_name in catalog.config_params():
        assert field_name in flags, f"dgpo-ops train has no flag for {field_name}"
    assert cli.METHOD_PRESETS == {n: catalog.trainer_presets(n) for n in catalog.POLICY_LOSSES
                                  if catalog.trainer_presets(n)}
