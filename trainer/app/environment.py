"""Where a result was measured: the code's commit and the software and machine it ran on. One
description for the benchmarks (``bench/``) and for ``dgpo-ops train``'s ``run.json``: the app's, since it reads
the checkout's git metadata, which the library never does (``tests/package/test_no_checkout_paths.py``)."""

from __future__ import annotations

import functools
import os
import pathlib
import platform
import re
import subprocess

import torch

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]  # the repository, for an editable install


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, check=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=None)
def code_commit(short: bool = True) -> tuple[str | None, bool]:
    """(commit, worktree dirty in dgpo_ops/, kernels/ or trainer/), read once per process: a commit made while a long
    run goes on must not be recorded as the one it ran. A tree copied to another machine without its
    history (a GPU lent for one run) names its commit in ``DGPO_OPS_COMMIT``; the copy's own git metadata
    would name another."""
    if os.environ.get("DGPO_OPS_COMMIT"):
        return os.environ["DGPO_OPS_COMMIT"], False
    commit = _git("rev-parse", *(["--short"] if short else []), "HEAD")
    return commit, bool(commit and _git("status", "--porcelain", "--", "dgpo_ops", "kernels", "trainer"))


def version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def describe(device: torch.device, packages: tuple[str, ...] = ()) -> dict:
    """The machine and software: Python, platform, torch, triton, the named ``packages``, the commit, the
    CPU (model, count, torch threads, memory) and, on CUDA, the GPU."""
    import triton

    commit, dirty = code_commit()
    info = {
        "device": device.type,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        **{name.replace("-", "_"): version(name) for name in packages},
        "dgpo_ops_commit": commit,
        "dgpo_ops_worktree_dirty": dirty,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            model = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        info["cpu_model"] = model.group(1).strip() if model else platform.processor()
        with open("/proc/meminfo") as f:
            info["memory_total_gib"] = round(int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1)) / 2**20, 1)
    except OSError:
        info["cpu_model"] = platform.processor()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, capability=f"sm_{props.major}{props.minor}",
                    device_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info["device_name"] = info.get("cpu_model", "cpu")
    return info
