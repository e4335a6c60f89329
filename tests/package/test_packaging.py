"""Install layout: the checkout's three parts, kernels/, dgpo_ops/ and trainer/, install as one package
``dgpo_ops`` with ``dgpo_ops.kernels`` and ``dgpo_ops.trainer`` (pyproject.toml's package-dir); an editable
install points at the three folders and a regular install copies them into one."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

IMPORT_CHECK = """
import sys, dgpo_ops, dgpo_ops.kernels, dgpo_ops.trainer
heavy = sorted(m for m in ("trl", "transformers", "vllm") if m in sys.modules)
print(dgpo_ops.__file__); print(dgpo_ops.kernels.__file__); print(dgpo_ops.trainer.__file__); print(heavy)
"""


def run_import_check(python: str, cwd) -> list[str]:
    result = subprocess.run([python, "-c", IMPORT_CHECK], cwd=cwd, capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


def test_editable_install_points_at_the_package_folder(tmp_path):
    pkg, kernels, trainer, heavy = run_import_check(sys.executable, tmp_path)
    assert pathlib.Path(pkg).parent == REPO / "dgpo_ops"
    assert pathlib.Path(kernels).parent == REPO / "kernels"
    assert pathlib.Path(trainer).parent == REPO / "trainer"
    assert heavy == "[]", "importing dgpo_ops must not import TRL, transformers or vLLM"


def test_the_checkout_root_imports_the_installed_parts():
    """From the checkout's root, ``dgpo_ops`` is the folder there and its kernels and trainer still resolve
    (pytest and ``python -m`` put the root first on sys.path)."""
    pkg, kernels, trainer, _ = run_import_check(sys.executable, REPO)
    assert pathlib.Path(pkg).parent == REPO / "dgpo_ops"
    assert pathlib.Path(kernels).parent == REPO / "kernels" and pathlib.Path(trainer).parent == REPO / "trainer"


@pytest.mark.early
def test_regular_install_in_a_new_venv(tmp_path):
    venv = tmp_path / "venv"
    # no pip of its own (ensurepip is seconds of this test): this interpreter's pip installs into it, with
    # this environment's setuptools (the README's `pip install -e` builds in an isolated environment)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
         "--no-build-isolation", str(REPO)], check=True, capture_output=True,
    )
    pkg, kernels, trainer, heavy = run_import_check(python, tmp_path)
    site = pathlib.Path(pkg).parents[1]
    assert str(venv) in pkg and pathlib.Path(kernels).parent == site / "dgpo_ops" / "kernels"
    assert pathlib.Path(trainer).parent == site / "dgpo_ops" / "trainer"
    assert not (site / "kernels").exists() and not (site / "trainer").exists()
    assert heavy == "[]"
    console = subprocess.run([str(venv / "bin" / "dgpo-ops"), "table"], capture_output=True, text=True, check=True)
    assert "dgpo" in console.stdout


def test_readme_test_command_is_what_ci_runs():
    """The README's set-up commands: the main job, then the tests and the frameworks' venv suites, which `.ci/run`
    runs one after the other, word for word."""
    import re

    readme = (REPO / "README.md").read_text()
    setup = readme.split("## Set up on a fresh machine\n")[1].split("\n## ")[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", setup, re.DOTALL)
    assert len(blocks) == 3 and blocks[0].startswith("python -m pip install") and "dgpo-ops train" in blocks[0]
    assert blocks[1].endswith("python -m pytest") and blocks[2] == "bash .ci/venvs.sh"
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("python -m pip")]
    assert ci == [f"{blocks[1]} && {blocks[2]}"]
    venvs = (REPO / ".ci" / "venvs.sh").read_text()
    for script in ("vllm_cpu.sh", "verl_cpu.sh", "frameworks_cpu.sh", "skyrl_cpu.sh"):  # every suite still runs
        assert f"bash .ci/{script}" in venvs
