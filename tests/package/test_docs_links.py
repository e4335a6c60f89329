"""The documentation holds together: every relative link in README.md, csrc_notes.md and docs/**/*.md names a
file that exists, and every ``#anchor`` into a markdown file names a heading there (GitHub's slugs); the
README stays short; the trainer's sources and the tests' module docstrings cite only files the repository has;
and the generated parts of the docs pages are what their generators write now (the
benchmark tables of docs/benchmarks.md, the compile report's markers in docs/aot_report.md).

docs/methods.md's method table, docs/integrations.md's verl table and docs/design.md's table of method files have
their own test (tests/package/test_generated_docs.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200


def markdown_files() -> list[Path]:
    return [REPO / "README.md", REPO / "csrc_notes.md", *sorted((REPO / "docs").rglob("*.md"))]


FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
# [text](target) and ![alt](target); the text may hold one level of brackets; an optional "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: links reduced to their text, lowercase, punctuation other than '-' and
    '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated slug gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(without_code_blocks(path.read_text())):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[str]:
    return LINK.findall(without_code_blocks(path.read_text()))


def test_slugs_follow_githubs_rules():
    assert slug("The main job: `dgpo-ops train`") == "the-main-job-dgpo-ops-train"
    assert slug("Memory traffic per token (units of V * 2 bytes, i.e. one read)") == (
        "memory-traffic-per-token-units-of-v--2-bytes-ie-one-read")
    assert slug("Row forward: `logprob_entropy.py`") == "row-forward-logprob_entropypy"
    assert slug("See [the docs](docs/api.md)") == "see-the-docs"


def test_the_link_parser_finds_links_and_skips_code():
    text = "a [b](c.md) ![d](e.png) [`f`](g/h.md#i) [j [k]](l.md)\n```\n[m](n.md)\n```\n"
    assert LINK.findall(without_code_blocks(text)) == ["c.md", "e.png", "g/h.md#i", "l.md"]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
            continue
        if REPO not in linked.parents and linked != REPO:
            broken.append(f"{target}: outside the repository")
        if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading '#{anchor}' in {linked.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


# A file named in code text: a .py or .md path, relative or absolute
CITED_FILE = re.compile(r"(?<![\w.-])(/?(?:[\w.-]+/)*[\w-]+\.(?:py|md))\b")


def missing_citations(source: Path, text: str) -> list[str]:
    """The files ``text`` (of ``source``) names that the checkout lacks: a path is read from the repository's
    root or from ``source``'s folder, and a markdown file may also be a page of docs/."""
    missing = []
    for cited in CITED_FILE.findall(text):
        candidates = [REPO / cited.lstrip("/"), source.parent / cited]
        if cited.endswith(".md"):
            candidates.append(REPO / "docs" / cited)
        if cited.startswith("/") or not any(path.exists() for path in candidates):
            missing.append(cited)
    return missing


def test_the_trainer_and_the_tests_cite_files_the_repository_has():
    """Every file a source of trainer/ names, and every file a test module's docstring names, is in the checkout
    (a file that moved or was never committed, such as a design note kept outside, is a stale reference)."""
    import ast

    missing = []
    for source in sorted((REPO / "trainer").rglob("*.py")):
        missing += [f"{source.relative_to(REPO)}: {cited}" for cited in missing_citations(source, source.read_text())]
    for source in sorted((REPO / "tests").rglob("test_*.py")):
        docstring = ast.get_docstring(ast.parse(source.read_text())) or ""
        missing += [f"{source.relative_to(REPO)}: {cited}" for cited in missing_citations(source, docstring)]
    assert not missing, "\n".join(missing)


def test_the_docs_pages_are_linked_from_the_readme():
    linked = {(REPO / target.partition("#")[0]).resolve() for target in links(REPO / "README.md")}
    for page in (REPO / "docs").glob("*.md"):
        assert page.resolve() in linked, f"README.md does not link {page.relative_to(REPO)}"


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/")


def test_design_doc_describes_every_part_of_the_layout():
    """tests/package/test_imports.py enforces the layout; docs/design.md's "Layout" section describes it."""
    from test_imports import LAYERS, part_folder

    text = (REPO / "docs" / "design.md").read_text()
    assert "layout" in anchors(REPO / "docs" / "design.md")
    layout = text[text.index("\n## Layout\n"):]
    end = layout.find("\n## ", 1)
    layout = layout if end < 0 else layout[:end]
    for part in LAYERS:
        folder = f"`{part_folder(part).relative_to(REPO).as_posix()}"
        assert folder in layout, f"docs/design.md, Layout: no {folder}`"


def test_benchmark_tables_are_what_bench_report_writes():
    """docs/benchmarks.md's generated section is ``python -m bench.report``'s for the results in bench/results/
    (run it after adding results)."""
    sys.path.insert(0, str(REPO))
    try:
        from bench import report
    finally:
        sys.path.remove(str(REPO))
    assert report.PAGE == REPO / "docs" / "benchmarks.md"
    expected = report.bench_section(report.load_runs(), report.traffic_summary_from_file())
    assert report.current_section() == expected, "run `python -m bench.report --no-traffic`"


def test_the_compile_report_lives_in_its_page():
    """``python -m bench.aot --notes docs/aot_report.md`` writes between these markers."""
    text = (REPO / "docs" / "aot_report.md").read_text()
    start, end = "<!-- aot:start -->", "<!-- aot:end -->"
    assert text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end)
    report = text[text.index(start):text.index(end)]
    assert re.search(r"^(\d+) of \1 specialisations compiled without problems$", report, re.M)
    assert "--notes docs/aot_report.md" in text
    assert start not in (REPO / "csrc_notes.md").read_text()


def test_the_api_page_names_every_aggregation():
    from dgpo_ops import AGGREGATIONS

    options = (REPO / "docs" / "api.md").read_text().split("## Options", 1)[1]
    missing = [name for name in AGGREGATIONS if f"`{name}`" not in options]
    assert missing == [], f"docs/api.md's options omit {missing}"


def test_the_api_page_names_every_field_of_the_call_object():
    """The call object's section lists both classes' fields by hand: a field added to either is named
    there."""
    from dgpo_ops.core.call import INPUT_FIELDS, OPTION_FIELDS

    text = (REPO / "docs" / "api.md").read_text()
    section = text.split("## The call object", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in (*INPUT_FIELDS, *OPTION_FIELDS) if f"`{name}`" not in section]
    assert missing == [], f"docs/api.md's call-object section omits {missing}"
