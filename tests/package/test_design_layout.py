"""docs/design.md's layout cannot drift from the tree: its table of parts names every module of each folder of
``kernels/``, ``dgpo_ops/`` and ``trainer/`` (the method families through its generated table of method files),
and every module it names is there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAYOUT = (REPO / "docs" / "design.md").read_text().split("## Layout", 1)[1]
ROW = re.compile(r"^\| `([\w/.]+)` \| (.*) \|$", re.MULTILINE)
MODULE = re.compile(r"`([\w/]*?[\w]+\.py)`")


def folder_rows() -> dict[Path, str]:
    """Each row of the layout's tables whose first cell is a folder of the package, and its text."""
    rows = {}
    for path, text in ROW.findall(LAYOUT):
        if path.endswith("/") and path.split("/")[0] in ("kernels", "dgpo_ops", "trainer"):
            rows[REPO / path] = text
    return rows


def named_modules(folder: Path, text: str) -> set[str]:
    """The modules of ``folder`` a row names: bare file names, or paths into the folder."""
    names = set()
    for name in MODULE.findall(text):
        if "/" not in name:
            names.add(name)
        elif (REPO / name).parent == folder:
            names.add(Path(name).name)
    return names


def test_every_folder_of_the_package_has_a_row():
    packages = [*(REPO / "dgpo_ops").iterdir(), *(REPO / "trainer").iterdir()]
    folders = {REPO / "kernels", REPO / "trainer"} | {path for path in packages
                                                     if (path / "__init__.py").is_file() and not path.is_symlink()}
    assert set(folder_rows()) == folders


def test_each_row_names_exactly_its_folders_modules():
    method_files = LAYOUT.split("### Method files", 1)[1].split("###", 1)[0]
    for folder, text in folder_rows().items():
        named = named_modules(folder, text)
        if folder == REPO / "dgpo_ops" / "methods":
            named |= named_modules(folder, method_files)
        present = {path.name for path in folder.glob("*.py")} - {"__init__.py"}
        assert present - named == set(), f"docs/design.md's row of {folder.relative_to(REPO)} leaves out modules"
        assert named - present == set(), f"docs/design.md's row of {folder.relative_to(REPO)} names missing files"


def test_the_check_reads_a_row():
    assert named_modules(REPO / "kernels", "`interface.py` (codes), `kernels/codes.py`, `dgpo_ops/api.py`") == {
        "interface.py", "codes.py"}
