"""The docs' generated tables are what the code writes now (``python docs/generate.py`` rewrites them): the
README's method table, docs/integrations.md's verl table and docs/design.md's table of method files."""

from __future__ import annotations

import pytest
from helpers import docs_tool

from dgpo_ops.methods.table import METHODS


def test_every_generated_table_is_current():
    assert docs_tool().stale_sections() == [], "run `python docs/generate.py`"


def test_a_stale_table_is_found(tmp_path):
    tool = docs_tool()
    pages = {}  # a page may hold several sections (docs/integrations.md: verl's and SkyRL's)
    for section in tool.SECTIONS:
        pages[section.page] = pages.get(section.page, "before\n") + f"{section.start}\n{section.body()}{section.end}\n"
    for page, text in pages.items():
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text(text + "after\n")
    assert tool.stale_sections(tmp_path) == []
    page = tmp_path / "docs" / "design.md"
    page.write_text(page.read_text().replace("| `grpo` |", "| `ppo` |"))
    assert tool.stale_sections(tmp_path) == ["docs/design.md: <!-- method-files:start -->"]
    page.write_text("no markers")
    with pytest.raises(ValueError, match="expected one <!-- method-files:start -->"):
        tool.stale_sections(tmp_path)


def test_the_design_table_names_each_methods_file_and_stage():
    table = docs_tool().method_files_markdown()
    for name, spec in METHODS.items():
        (row,) = [line for line in table.splitlines() if line.startswith(f"| `{name}` |")]
        assert ("`MethodId." in row) == spec.token_local, row
    assert "| `vespo` | `dgpo_ops/methods/vespo.py` | - | the torch objective, at its sequence statistic " \
           "`summed_log_ratio` |" in table
    assert "| `dgpo` | `dgpo_ops/methods/dgpo.py` | `MethodId.DGPO` | per token: the row kernels' epilogue |" in table


def test_every_gpu_figure_of_the_benchmarks_page_and_readme_is_generated():
    # a figure in ms, GB or a ratio to another library outside the generated sections is typed by hand and drifts
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    figure = re.compile(r"\b\d+(\.\d+)? ?(ms|GB)\b|\b\d+\.\d+x\b")
    for page, generated in (("docs/benchmarks.md", [("<!-- headline:start -->", "<!-- headline:end -->"),
                                                     ("<!-- bench:start -->", "<!-- bench:end -->")]),
                            ("README.md", [])):
        text = (repo / page).read_text()
        for start, end in generated:
            text = re.sub(re.escape(start) + ".*?" + re.escape(end), "", text, flags=re.DOTALL)
        assert not [m.group(0) for m in figure.finditer(text)], page


def test_the_headline_takes_the_newest_logits_timing_and_names_its_run_card_and_commit():
    import json

    tool = docs_tool()
    headline = tool.headline
    path = headline.newest_timing()
    doc = json.loads(path.read_text())
    text = headline.logits_markdown()
    assert path.name in text and doc["env"]["dgpo_ops_commit"] in text and doc["env"]["device_name"] in text
    row = next(r for r in doc["logits_timing"] if r["impl"] == "ours-dgpo" and "error" not in r)
    assert f"{row['do_bench_ms']:.2f} / {row['sync_ms']:.2f}" in text
    assert headline.run_of(doc["env"]["dgpo_ops_commit"], "h100") != "?"
