"""docs/design.md's layout cannot drift from the tree: its list of the package (written by
``docs/generate.py`` from the docstrings) has a section for every folder of ``kernels/``, ``dgpo_ops/`` and
``trainer/`` and an entry for every module of each, nothing more, and the paths it names outside the package
are there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = (REPO / "docs" / "design.md").read_text()
LAYOUT = DESIGN.split("<!-- package-layout:start -->", 1)[1].split("<!-- package-layout:end -->", 1)[0]
FOLDER = re.compile(r"^\*\*`([\w/]+)/`\*\*: ", re.MULTILINE)
MODULE = re.compile(r"^\* `(\w+\.py)`: ", re.MULTILINE)


def listed() -> dict[Path, set[str]]:
    """Each folder of the layout's list and the modules listed under it."""
    sections = FOLDER.split(LAYOUT)[1:]
    return {REPO / folder: set(MODULE.findall(text)) for folder, text in zip(sections[::2], sections[1::2])}


def test_every_folder_and_module_of_the_package_is_listed():
    packages = [*(REPO / "dgpo_ops").iterdir(), *(REPO / "trainer").iterdir()]
    folders = {REPO / "kernels", REPO / "trainer", REPO / "dgpo_ops"} | {
        path for path in packages if (path / "__init__.py").is_file() and not path.is_symlink()}
    layout = listed()
    assert set(layout) == folders
    for folder, modules in layout.items():
        present = {path.name for path in folder.glob("*.py")} - {"__init__.py"}
        assert modules == present, folder.relative_to(REPO)


def test_the_paths_outside_the_package_are_there():
    outside = DESIGN.split("### Outside the package", 1)[1].split("###", 1)[0]
    paths = re.findall(r"^\* `([\w./-]+)`: ", outside, re.MULTILINE)
    assert {"bench/", "docs/", "tests/", ".ci/", "csrc_notes.md"} <= set(paths)
    assert [path for path in paths if not (REPO / path).exists()] == []
