"""Install this checkout's packages into a folder, as pyproject.toml maps them, with no build step.

    python bench/experiments/install_tree.py TARGET

Copies every package of ``[tool.setuptools] packages`` (its ``.py`` files) from the folder
``[tool.setuptools.package-dir]`` gives it (``dgpo_ops.kernels`` from ``kernels/``, ``dgpo_ops.trainer`` from
``trainer/``, the others from their dotted path) to ``TARGET``: the layout ``pip install`` gives, where
``import dgpo_ops`` finds it once ``TARGET`` is on ``PYTHONPATH``. Why not ``pip install --target``: building the
wheel needs a build backend pip can reach, and neither the GPU machine (no network) nor every CPU machine of
this project (this venv's setuptools 65 cannot build a wheel without the index) is sure to have one; the
packages are pure Python, so the copy is the whole install but for the distribution's metadata (the
``dgpo-ops`` command and the verl entry point, which no GPU stage uses). ``gpu_session.sh`` runs this.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def package_sources(repo: Path = REPO) -> dict[str, Path]:
    """Dotted package name -> the folder its modules come from, per pyproject.toml: as setuptools maps them, a
    package under a mapped one lies under its folder (``dgpo_ops.trainer.app`` in ``trainer/app``)."""
    config = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = config.get("package-dir", {})

    def folder(name: str) -> Path:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            prefix = ".".join(parts[:cut])
            if prefix in mapped:
                return repo / mapped[prefix] / "/".join(parts[cut:])
        return repo / "/".join(parts)

    return {name: folder(name) for name in config["packages"]}


def install(target: Path, repo: Path = REPO) -> list[str]:
    """Copy every package's modules under ``target``; returns the packages installed."""
    sources = package_sources(repo)
    for name in sources:  # a stale copy of an earlier install would shadow nothing, but mix versions
        shutil.rmtree(target / name.split(".")[0], ignore_errors=True)
    for name, source in sources.items():
        destination = target / name.replace(".", "/")
        destination.mkdir(parents=True, exist_ok=True)
        modules = sorted(source.glob("*.py"))
        if not (source / "__init__.py").exists():
            raise SystemExit(f"{name}: {source} has no __init__.py")
        for module in modules:
            shutil.copy2(module, destination / module.name)
    return list(sources)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.strip().splitlines()[2].strip())
    installed = install(Path(sys.argv[1]).resolve())
    print(f"installed {', '.join(installed)} into {sys.argv[1]}")
