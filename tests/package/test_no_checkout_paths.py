"""The library (``dgpo_ops/`` and ``kernels/``) reads no path of the checkout: installed, a module's folder is
site-packages, where ``Path(__file__).parents[2] / "README.md"`` names nothing of this project. Files of the
checkout (the README, docs/, bench/ results, the git metadata) are read and written by the tools beside the
package: ``docs/generate.py``, ``bench/``, the app (``trainer/app/``, which is not scanned, nor is the trainer).

Every module is parsed; a module fails if it reads ``__file__``, the working directory, or builds a path from a
string naming a checkout file (``README.md``, ``docs/...``, ``pyproject.toml``)."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = (REPO / "dgpo_ops", REPO / "kernels")
APP_FOLDERS = ("trainer", "kernels")  # dgpo_ops/trainer and dgpo_ops/kernels: a worktree's links, not the library
CHECKOUT_FILES = ("README", ".md", "pyproject", "docs/", "bench/", "tests/", ".git")
PATH_CALLS = {"Path", "PurePath", "open"}


def library_modules() -> list[pathlib.Path]:
    modules = []
    for root in LIBRARY:
        for path in sorted(root.rglob("*.py")):
            inner = path.relative_to(REPO).parts
            if inner[0] == "dgpo_ops" and len(inner) > 2 and inner[1] in APP_FOLDERS:
                continue
            modules.append(path)
    return modules


def checkout_reads(source: str) -> list[str]:
    """What in ``source`` reads a path of the checkout, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "__file__":
            found.append(f"{node.lineno}: __file__")
        elif isinstance(node, ast.Attribute) and node.attr in ("cwd", "getcwd"):
            found.append(f"{node.lineno}: the working directory ({node.attr})")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in PATH_CALLS:
                found += [f"{node.lineno}: {name}({arg.value!r})" for arg in node.args
                          if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                          and any(key in arg.value for key in CHECKOUT_FILES)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            found += [f"{node.lineno}: / {side.value!r}" for side in (node.left, node.right)
                      if isinstance(side, ast.Constant) and isinstance(side.value, str)
                      and any(key in side.value for key in CHECKOUT_FILES)]
    return found


def test_the_check_finds_each_kind_of_checkout_read():
    source = ('import os, pathlib\nA = pathlib.Path(__file__).parents[2] / "README.md"\nB = os.getcwd()\n'
              'C = open("docs/math.md")\nD = pathlib.Path("pyproject.toml")\n'
              '"""a docstring naming README.md is no read"""\n')
    assert sorted(checkout_reads(source)) == ["2: / 'README.md'", "2: __file__", "3: the working directory (getcwd)",
                                              "4: open('docs/math.md')", "5: Path('pyproject.toml')"]


def test_no_library_module_reads_the_checkout():
    modules = library_modules()
    assert any(path.name == "method_table.py" for path in modules) and any(path.name == "api.py" for path in modules)
    reads = {str(path.relative_to(REPO)): checkout_reads(path.read_text()) for path in modules}
    offenders = {path: found for path, found in reads.items() if found}
    assert offenders == {}, "the library reads checkout paths (move that code to docs/generate.py, bench/ or the app)"
