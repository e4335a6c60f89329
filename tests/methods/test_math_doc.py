"""docs/math.md, the repository's document of the math of every method, cannot drift from the method table:
its method sections, parameters and defaults, aggregations, clamps and metrics are read here and compared
with the code; the README links it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from dgpo_ops.kernels.interface import LOG_RATIO_CLAMP, LOGP_FLOOR

from dgpo_ops.core.aggregation import AGGREGATIONS
from dgpo_ops.core.metrics import METRIC_NAMES
from dgpo_ops.methods.table import ALIASES, METHODS

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "math.md").read_text()


def section(title: str) -> str:
    """The text of ``## title`` up to the next ``## ``."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", DOC, re.S | re.M)
    assert match, f"docs/math.md has no section '## {title}'"
    return match.group(1)


def method_sections() -> dict[str, str]:
    methods = section("Methods")
    parts = re.split(r"^### `([a-z0-9_]+)`\n", methods, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_method_and_alias_has_a_section_in_table_order():
    assert list(method_sections()) == [*METHODS, *ALIASES]


@pytest.mark.parametrize("method", list(METHODS))
def test_parameters_and_defaults_are_the_tables(method):
    text = method_sections()[method]
    (line,) = [line for line in text.splitlines() if line.startswith("Parameters:")]
    documented = dict(re.findall(r"`(\w+)` = ([^ ,]+)", line))
    fields = {f.name: repr(f.default) for f in dataclasses.fields(METHODS[method].config)}
    assert documented == fields
    assert METHODS[method].paper.split(":")[0].split(" (")[0] in text  # the paper's name


def test_alias_presets_are_documented():
    text = method_sections()
    for name, alias in ALIASES.items():
        assert f"`{alias.method}`" in text[name]
        for param, value in alias.params.items():
            assert f"{param} = {value!r}" in text[name] or f"`{param}` = {value!r}" in text[name]


def test_aggregations_clamps_and_metrics():
    aggregations = section("Aggregations")
    for name in AGGREGATIONS:
        assert f"`{name}`" in aggregations
    clamps = section("Clamps and floors")
    assert repr(float(LOG_RATIO_CLAMP)) in clamps
    assert repr(float(LOGP_FLOOR)) in clamps or f"{LOGP_FLOOR:.1e}" in clamps
    metrics = section("Metrics")
    for name in METRIC_NAMES:
        assert f"`{name}`" in metrics


def test_readme_links_the_document():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/math.md)" in readme
    assert "LOSS_FAMILY.md" not in readme  # a file the repository does not have
