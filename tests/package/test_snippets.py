"""Every ```python block of README.md and docs/*.md runs as written on a CPU: each is saved as a script and
run as ``__main__``, in an empty folder, with nothing from a model hub. A block with an ``if __name__ ==
"__main__":`` guard or a trainer (whose worker pools start processes) runs in a fresh interpreter of its own,
as a reader would run it; the library's blocks run one after another in one fresh interpreter
(``snippet_runner.py``), sparing a second of imports each. A block that cannot run here says why in the
markdown, on the line before its fence: ``<!-- not run: needs CUDA -->``; such a block must still parse. A block
that runs ends by printing what it computes, so that run as a script it shows its result."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import dgpo_ops

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>\S.*\S) -->$")
TIMEOUT_S = 900  # a few seconds idle; a loaded 2-core machine has taken 40 s for torch's import alone


def python_blocks(path: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """(line of the fence, code, the not-run reason or None) of each ```python block of a page."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{path.name}:{i + 1}: a ```python block that never closes"
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marked = NOT_RUN.match(before)
            blocks.append((i + 1, "\n".join(lines[i + 1 : end]) + "\n", marked and marked["reason"]))
            i = end
        i += 1
    return blocks


BLOCKS = [(path.relative_to(ROOT).as_posix(), line, code, reason)
          for path in PAGES for line, code, reason in python_blocks(path)]


def runs_alone(code: str) -> bool:
    """A block that needs an interpreter of its own: a ``__main__`` guard (spawned processes re-import the
    script), or a trainer (its math-verify worker pool)."""
    return "__main__" in code or "DGPOTrainer(" in code


RUN = [(f"{page}:{line}", code) for page, line, code, reason in BLOCKS if reason is None]


def _param(block_id, code):
    # A trainer run spawns math-verify workers and takes the longest: xdist keeps it on a worker of its own.
    marks = [pytest.mark.xdist_group("snippet_trainer"), pytest.mark.early] if "DGPOTrainer(" in code else []
    return pytest.param(code, id=block_id, marks=marks)


def test_the_pages_have_blocks_to_run():
    """The extraction finds the README's library calls (a broken pattern would pass every page vacuously)."""
    readme = [code for page, _, code, reason in BLOCKS if page == "README.md" and reason is None]
    for call in ("fused_dgpo_loss(", "fused_linear_dgpo_loss(", "fused_linear_logprobs(", "DGPOTrainer("):
        assert any(call in code for code in readme), f"no runnable README block calls {call}"
    assert any(runs_alone(code) for _, code in RUN) and not all(runs_alone(code) for _, code in RUN)


def snippet_environment() -> dict:
    env = dict(os.environ)
    # the checkout under test first (where this run imported dgpo_ops from), as for `python -m pytest` at its
    # root
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(dgpo_ops.__file__).parents[1]),
                                         *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TRITON_INTERPRET", "1")
    env["HF_HUB_OFFLINE"] = "1"  # a block that names a hub model fails here as it would for an offline reader
    return env


@pytest.mark.parametrize("code", [_param(block_id, code) for block_id, code in RUN if runs_alone(code)])
def test_block_runs_as_written(code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=snippet_environment(),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, \
        f"the block failed:\n{code}\n--- stderr (tail) ---\n{result.stderr[-4000:]}"
    assert result.stdout.strip(), f"the block printed nothing:\n{code}"


@pytest.fixture(scope="module")
def library_blocks(tmp_path_factory) -> dict:
    """Each library block's traceback (None: it ran), all run by one fresh interpreter."""
    folder = tmp_path_factory.mktemp("snippets")
    blocks = {block_id: code for block_id, code in RUN if not runs_alone(code)}
    (folder / "blocks.json").write_text(json.dumps(blocks))
    runner = pathlib.Path(__file__).with_name("snippet_runner.py")
    command = [sys.executable, str(runner), str(folder / "blocks.json"), str(folder / "results.json")]
    result = subprocess.run(command, cwd=folder, env=snippet_environment(), capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((folder / "results.json").read_text())


@pytest.mark.xdist_group("snippet_library")  # one worker runs the module fixture's interpreter, once
@pytest.mark.parametrize("block_id, code", [pytest.param(block_id, code, id=block_id)
                                            for block_id, code in RUN if not runs_alone(code)])
def test_library_block_runs_as_written(block_id, code, library_blocks):
    error, output = library_blocks[block_id]["error"], library_blocks[block_id]["output"]
    assert error is None, f"the block failed:\n{code}\n--- traceback ---\n{error}"
    assert output.strip(), f"the block printed nothing:\n{code}"


def last_statement(code: str) -> ast.stmt:
    """A block's last statement; inside its ``if __name__ == "__main__":`` body where it ends on one."""
    statement = ast.parse(code).body[-1]
    while isinstance(statement, ast.If) and "__main__" in ast.unparse(statement.test):
        statement = statement.body[-1]
    return statement


@pytest.mark.parametrize("code", [pytest.param(code, id=block_id) for block_id, code in RUN])
def test_block_ends_by_printing_what_it_computes(code):
    """Run as a script, a block whose last line is a bare expression (``out.loss, out.metrics["eur"]``) shows
    nothing: each ends on a print of its result."""
    statement = last_statement(code)
    assert (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and getattr(statement.value.func, "id", None) == "print"), \
        f"the block ends on `{ast.unparse(statement)}`, not on a print of what it computes:\n{code}"


@pytest.mark.parametrize("code,reason", [pytest.param(code, reason, id=f"{page}:{line}")
                                         for page, line, code, reason in BLOCKS if reason is not None])
def test_a_block_not_run_says_why_and_parses(code, reason):
    assert len(reason.split()) >= 2, f"not run: {reason!r} gives no reason"
    ast.parse(code)
