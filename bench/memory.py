"""Peak memory of one forward + backward: in process on CUDA, in a fresh subprocess per case on the CPU
(``bench.memprobe``), where the resident set is the only measure and the allocator's retention must be
kept out of it."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.competitors import step

REPO = Path(__file__).resolve().parent.parent


CPU_MEMORY_METHOD = (
    "subprocess per case (python -m bench.memprobe): build the inputs, run one warm-up call (on the same "
    "inputs for torch.compile, so that it compiles; on a 64-token batch of the same V otherwise, so that "
    "the first call's code and library pages are not counted), reset the kernel's peak-RSS counter "
    "(write 5 to /proc/self/clear_refs), then peak resident set (VmHWM) during one forward+backward minus the resident set just before it; includes "
    "the gradient buffer (N*V bf16) the backward leaves behind. glibc's mmap threshold is pinned at 64 KiB "
    "(MALLOC_MMAP_THRESHOLD_=65536) in the probe so that freed tensors leave the RSS and it follows the live "
    "tensors; for `ours` at N*V <= 1024*262144 a second probe runs with glibc's default dynamic threshold "
    "(memory.default_malloc_peak_bytes), which keeps freed chunk buffers in the heap"
)
CUDA_MEMORY_METHOD = (
    "in process: torch.cuda.max_memory_allocated() during one forward+backward minus "
    "torch.cuda.memory_allocated() before it (after reset_peak_memory_stats); includes the gradient buffer"
)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1))


def release_free_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_peak_bytes(prepared, warm_up) -> dict:
    """Peak extra RSS of one ``step(prepared)`` after one ``step(warm_up)`` (which loads the code and
    libraries a first call touches, and compiles, for torch.compile)."""
    step(warm_up)
    warm_up.leaf.grad = None
    release_free_memory()
    resettable = reset_peak_rss()
    base = _status_kib("VmRSS")
    if not resettable:
        import resource

        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(prepared)
    if resettable:
        peak = _status_kib("VmHWM")
        how = "VmHWM after clear_refs"
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        how = "ru_maxrss (peak could not be reset: a lower bound)" if peak <= before else "ru_maxrss"
    return {"peak_bytes": (peak - base) * 1024, "baseline_rss_bytes": base * 1024, "how": how}


def cuda_peak_bytes(prepared) -> dict:
    prepared.leaf.grad = None
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(prepared)
    return {"peak_bytes": torch.cuda.max_memory_allocated() - base, "baseline_allocated_bytes": base,
            "how": "torch.cuda.max_memory_allocated"}


MMAP_THRESHOLD = 65536
DEFAULT_MALLOC_PROBE_MAX = 1024 * 262144  # N * V up to which `ours` is also probed under glibc's default


def memory_in_subprocess(case, fixed_mmap_threshold: bool = True, timeout: float = 900.0) -> dict:
    """Run ``bench.memprobe`` for ``case`` in a fresh process. With ``fixed_mmap_threshold`` glibc's
    mmap threshold is pinned at 64 KiB (MALLOC_MMAP_THRESHOLD_) for the whole process, so every tensor
    buffer is its own mapping, returned to the OS when freed, and the RSS follows the live tensors;
    glibc's default dynamic threshold rises to the largest freed buffer (up to 32 MiB) and then keeps
    freed buffers of that size in the heap, so the RSS also counts the allocator's retention."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if fixed_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    cmd = [sys.executable, "-m", "bench.memprobe", case.competitor, case.method, str(case.n), str(case.v)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    wall = round(time.perf_counter() - started, 1)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"memory probe exited {proc.returncode}: {' | '.join(tail)}", "probe_wall_s": wall}
    return {**json.loads(lines[-1]), "probe_wall_s": wall}


