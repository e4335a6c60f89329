"""A framework is one spec: every list of rows, fields, loss types and corrections the project keeps is derived from
``dgpo_ops.frameworks`` (the recipe in docs/design.md, "Adding a framework")."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

import dgpo_ops
from dgpo_ops import corrections, frameworks
from dgpo_ops.frameworks import FRAMEWORK_AGGREGATIONS, FRAMEWORKS, MODULES, trl
from dgpo_ops.frameworks.core import AggregationRow, FrameworkSpec, Scope, step_normalizer
from dgpo_ops.kernels.interface import Denominator
from dgpo_ops.methods import catalog
from dgpo_ops.methods.table import METHODS

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARAMS = [p for method in METHODS for p in catalog.method_params(method)]


def recipe() -> str:
    design = (ROOT / "docs" / "design.md").read_text()
    return design[design.index("## Adding a framework"):design.index("## Layout")]


def test_the_recipe_names_real_files():
    paths = set(re.findall(r"`((?:dgpo_ops|tests|docs|\.ci)/[\w/.]+\.(?:py|md|sh))`", recipe()))
    assert {"dgpo_ops/frameworks/core.py", "dgpo_ops/frameworks/__init__.py", "tests/frameworks/dp_steps.py",
            "tests/frameworks/test_data_parallel_steps.py", ".ci/frameworks_cpu.sh"} <= paths
    for path in paths:
        assert (ROOT / path).exists(), f"the recipe names {path}, which is not in the repository"


def test_every_framework_module_is_registered_and_holds_its_spec():
    files = {path.stem for path in (ROOT / "dgpo_ops" / "frameworks").glob("*.py")} - {"__init__", "core"}
    assert {module.__name__.rpartition(".")[2] for module in MODULES} == files
    for module in MODULES:
        assert isinstance(module.SPEC, FrameworkSpec) and module.SPEC.name == module.__name__.rpartition(".")[2]
    assert list(FRAMEWORKS) == [module.SPEC.name for module in MODULES]


def test_every_row_is_in_the_table_the_page_and_the_ops():
    page = (ROOT / "docs" / "normalization.md").read_text()
    assert dgpo_ops.FRAMEWORK_AGGREGATIONS is FRAMEWORK_AGGREGATIONS
    for spec in FRAMEWORKS.values():
        for row in spec.aggregations:
            name = f"{spec.name}:{row.mode}"
            assert FRAMEWORK_AGGREGATIONS[name] is row
            assert f"| `{name}` |" in page
            assert isinstance(row.scope, Scope) and isinstance(row.denominator, Denominator)
            assert row.step_count and row.source and "|" not in row.step_count + row.source
    assert len(FRAMEWORK_AGGREGATIONS) == sum(len(spec.aggregations) for spec in FRAMEWORKS.values())


def test_a_new_frameworks_rows_reach_the_table():
    row = AggregationRow("mean", False, Denominator.TOKENS, Scope.STEP, "the step's tokens", "new 1.0 loss.py L1")
    new = FrameworkSpec(name="new_framework", title="New", aggregations=(row,))
    table = frameworks.aggregation_table([*FRAMEWORKS.values(), new])
    assert table["new_framework:mean"] is row and list(table)[:-1] == list(FRAMEWORK_AGGREGATIONS)
    with pytest.raises(AssertionError, match="an aggregation mode twice"):
        FrameworkSpec(name="twice", title="Twice", aggregations=(row, row))
    with pytest.raises(AssertionError, match="no aggregation row 'sum'"):
        FrameworkSpec(name="t", title="T", aggregations=(row,), loss_types=(trl.LossType("x", "grpo", "sum"),))


def test_the_step_convention_divides_by_dp_size_once():
    rows = {scope: AggregationRow("m", False, Denominator.TOKENS, scope, "N", "s") for scope in Scope}
    assert step_normalizer(rows[Scope.STEP], 120.0, micro_batches=3, dp_size=4) == 30.0
    assert step_normalizer(rows[Scope.MICRO_BATCH_MEAN], 10.0, micro_batches=3, dp_size=4) == 30.0
    assert step_normalizer(rows[Scope.MICRO_BATCH_SUM], 8.0, micro_batches=3, dp_size=4) == 2.0


def test_every_spec_field_names_a_parameter_of_the_table():
    names = {p.name for p in PARAMS}
    for spec in FRAMEWORKS.values():
        if spec.fields is None:
            continue
        assert set(spec.fields.by_param) <= names, spec.name
        for method, param in spec.fields.by_method:
            assert param in {p.name for p in catalog.method_params(method)}, (spec.name, method, param)


def test_the_plugins_and_the_trainer_read_the_specs():
    from dgpo_ops.frameworks import skyrl, verl
    from dgpo_ops.integrations import skyrl_params, verl_params

    for p in PARAMS:
        assert verl_params.verl_field(p) == verl.SPEC.fields.field_of(p)
        field = skyrl.SPEC.fields.field_of(p)
        assert skyrl_params.skyrl_field(p) == (None if field is None else field.path)
    assert skyrl_params.CORRECTION_FIELDS == tuple(f.name for f in dataclasses.fields(corrections.SkyRLCorrection))
    assert verl_params.LOSS_AGG_MODES == tuple(row.mode for row in verl.SPEC.aggregations)
    pytest.importorskip("trl")
    from dgpo_ops.trainer import method_fields

    for p in PARAMS:
        assert method_fields.config_field(p) == trl.SPEC.fields.field_of(p)


def test_every_correction_family_belongs_to_a_framework():
    families = {getattr(corrections, name) for name in corrections.__all__}
    families = {cls for cls in families if isinstance(cls, type) and issubclass(cls, corrections.RolloutCorrection)
                and cls is not corrections.RolloutCorrection}
    assert families == {spec.correction for spec in FRAMEWORKS.values() if spec.correction is not None}


def test_trls_loss_types_are_the_specs():
    assert trl.LOSS_TYPES == ("grpo", "sapo", "bnpo", "dr_grpo", "dapo", "cispo", "vespo", "luspo")
    assert trl.OBJECTIVE_LOSS_TYPES == ("sapo", "cispo", "vespo")
    assert {name: trl.same_aggregation(name) for name in trl.OBJECTIVE_LOSS_TYPES} == \
        {"sapo": "grpo", "cispo": "dapo", "vespo": "dapo"}


def trl_step(mask, accumulation=4, processes=2, num_items=40.0):
    return trl.TrlStep(mask=mask, max_completion_length=7, num_items_in_batch=torch.tensor(num_items),
                       accumulation=accumulation, window=accumulation / 4, processes=processes)


@pytest.mark.parametrize("mode, expected, metric_scale", [
    ("grpo", 3 * 4, 4), ("bnpo", 5 * 4, 4), ("dr_grpo", 3 * 7 * 4, 4), ("dapo", 40 / 2 * 4 / 4, 1),
    ("luspo", 3 * 4, 4)])
def test_the_trainers_divisor_is_trls(mode, expected, metric_scale):
    """GRPOTrainer._compute_loss's divisors (trl 1.16.0, L3153-3184) from the rows: B x accumulation, the
    micro-batch's tokens x accumulation, B x max_completion_length x accumulation, num_items_in_batch / processes x
    accumulation / steps_per_generation."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    row = trl.trainer_row(f"trl:{mode}", False, Denominator.ONE)
    normalizer, scale = trl.trainer_normalizer(row, trl_step(mask))
    assert float(normalizer) == pytest.approx(expected) and scale == metric_scale


def test_bnpo_counts_a_micro_batch_without_a_token_as_one():
    """TRL clamps bnpo's count at 1 (``mask.sum().clamp(min=1.0)``): a micro-batch with no scored token divides by
    the accumulation steps, where the count read literally would be 0, a normaliser the op refuses."""
    normalizer, _ = trl.trainer_normalizer(trl.SPEC.row("bnpo"), trl_step(torch.zeros(3, 4)))
    assert float(normalizer) == 4.0
    assert "at least 1" in trl.SPEC.row("bnpo").step_count
