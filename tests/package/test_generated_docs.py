"""The docs' generated tables are what the code writes now (``python docs/generate.py`` rewrites them): the
docs/methods.md's method table, docs/integrations.md's verl table and docs/design.md's table of method files; and the
front page's statements written from the logs and scripts: the default run's result, SkyRL's CPU install."""

from __future__ import annotations

import pathlib
import re

import pytest
from helpers import docs_tool

from dgpo_ops.methods.table import METHODS

REPO = pathlib.Path(__file__).resolve().parents[2]


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
    card = headline.TIMING.search(path.name)["card"]
    assert headline.run_of(doc["env"]["dgpo_ops_commit"], card) != "?"
# ----------------------------------------------------------------------------- the front page

DEFAULT_RESULT_PAGES = ("README.md", "docs/training.md", "docs/train/README.md")


def section_text(page: str, name: str) -> str:
    text = (REPO / page).read_text()
    match = re.search(f"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", text, re.DOTALL)
    assert match, f"{page} has no {name} section"
    return match[1]


def test_every_page_states_the_default_result_of_its_committed_log():
    """README.md, docs/training.md and docs/train/README.md state the plain run's before -> after as its
    console log's summary line does, and no page keeps a second default result beside it."""
    tool = docs_tool()
    result = tool.default_result()
    log = tool.DEFAULT_RUN_LOG.read_text()
    assert f"{result.method}: {result.before} -> {result.after} (mean over 1 seed(s)" in log
    for page in DEFAULT_RESULT_PAGES:
        stated = " ".join(section_text(page, "default-result").split())
        assert f"**{result.before} -> {result.after}**" in stated, page
        assert "a re-run gives" not in (REPO / page).read_text().lower() and "Re-run on" not in (
            REPO / page).read_text(), page


def test_the_default_result_is_read_from_the_log_and_a_log_without_one_is_refused(tmp_path):
    tool = docs_tool()
    log = tmp_path / "run.log"
    log.write_text("dgpo-ops train: grpo x seeds [3] | model: ...\nstep    1/60 | ...\n\n"
                   "held-out accuracy (greedy, n=200), before -> after RL:\n"
                   "      grpo: 0.125 -> 0.500 (mean over 1 seed(s); seed 3: 0.125 -> 0.500)\n"
                   "wall time 9 s\n")
    assert tool.default_result(log) == ("grpo", "[3]", 200, "0.125", "0.500")
    log.write_text("dgpo-ops train: grpo x seeds [3] | model: ...\n")
    with pytest.raises(ValueError, match="does not end on one method's summary"):
        tool.default_result(log)


def test_the_quick_start_says_how_to_install_the_library_alone_on_a_cpu_only_machine():
    """Before its first example, the README's Quick start gives the CPU-only install: torch's CPU build first
    (plain `pip install -e .` takes PyPI's CUDA torch and its NVIDIA wheels)."""
    readme = (REPO / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):readme.index("```python")]
    assert "CPU-only machine" in quick_start
    cpu_install = ("pip install torch --index-url https://download.pytorch.org/whl/cpu"
                   " && python -m pip install -e .")
    assert cpu_install in quick_start


def test_the_skyrl_section_lists_what_its_wheel_leaves_out_with_the_ci_install():
    """SkyRL 0.3.0's wheel declares ray, jaxtyping, loguru, omegaconf and skyrl-gym only in its extras: the
    section names them and installs them as .ci/skyrl_cpu.sh does, its lines written from the script."""
    tool = docs_tool()
    install = section_text("docs/integrations.md", "skyrl-cpu-install")
    assert install == tool.skyrl_cpu_install_markdown()
    packages = tool.skyrl_cpu_packages()
    for name in ("ray", "jaxtyping", "loguru", "omegaconf"):
        (pin,) = [package for package in packages if package.startswith(f"{name}==")]
        assert pin in install
    assert "--ignore-requires-python skyrl-gym==0.4.0" in install
    named = " ".join((REPO / "docs/integrations.md").read_text().split())
    assert "**ray, jaxtyping, loguru, omegaconf and skyrl-gym**" in named


def test_a_timing_log_gives_its_wall_time_load_commit_and_counts(tmp_path):
    log = tmp_path / "t.log"
    log.write_text("# commit abc1234, busy loops 2: python -m pytest\n"
                   "#  10:00:00 up 1:00,  0 user,  load average: 2.21, 2.04, 2.23  (uptime before)\n"
                   "==== 3 passed, 1 skipped, 4 warnings in 5.00s ====\nWALL 6.50 s\n"
                   "#  10:00:07 up 1:00,  0 user,  load average: 4.16, 3.84, 3.12  (uptime after)\n")
    run = docs_tool().timed_run(log)
    assert (run.seconds, run.load_before, run.load_after, run.commit, run.tests) == (
        6.5, "2.21", "4.16", "abc1234", "3 passed, 1 skipped")
    log.write_text(log.read_text().replace("WALL 6.50 s\n", ""))
    with pytest.raises(ValueError, match="no WALL line"):
        docs_tool().timed_run(log)
