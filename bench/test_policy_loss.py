"""Forward + backward of the policy loss from bf16 logits: dgpo_ops against the paths users run.

One test per (method, N, V, competitor); ``bench/conftest.py`` builds the grid and writes the
results. A competitor that cannot run here is skipped with its reason, which is also recorded.
"""

from __future__ import annotations

import time

import pytest
import torch

from bench.common import (
    COMPILE_BUDGET_S,
    DEFAULT_MALLOC_PROBE_MAX,
    ROUNDS,
    Skip,
    cuda_peak_bytes,
    grad_sample,
    memory_in_subprocess,
    parity,
    prepare,
    step,
    unavailable,
)


def _skip(run, case, *reasons: str) -> BaseException:
    """Record the case as skipped; the caller raises what this returns (pytest's skip exception)."""
    run.record(case, status="skipped", reason="; ".join(reasons), reasons=list(reasons))
    return pytest.skip.Exception(f"{case.competitor}: {'; '.join(reasons)}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def test_forward_backward(benchmark, bench_run, case):
    run = bench_run
    benchmark.group = f"{case.method} N={case.n} V={case.v}"
    reasons = unavailable(case.competitor, case.method, run.device)
    if case.competitor == "compile" and case.method in run.compile_blocked:
        reasons.append(run.compile_blocked[case.method])
    if reasons:
        raise _skip(run, case, *reasons)

    inputs = run.inputs(case.n, case.v)
    try:
        prepared = prepare(case.competitor, case.method, inputs)
        started = time.perf_counter()
        loss = step(prepared)  # the warm-up call: compiles (torch.compile), and is checked for parity
        first_call_s = time.perf_counter() - started
    except Skip as why:
        raise _skip(run, case, str(why)) from None
    except torch.OutOfMemoryError as error:
        inputs.logits.grad = None
        torch.cuda.empty_cache()
        raise _skip(run, case, f"out of memory on this device at this size ({_first_line(error)})") from None
    except Exception as error:
        if case.competitor != "compile":
            raise
        reason = f"torch.compile failed: {_first_line(error)}"
        run.compile_blocked[case.method] = reason
        raise _skip(run, case, reason) from None
    if case.competitor == "compile" and first_call_s > COMPILE_BUDGET_S:
        run.compile_blocked[case.method] = (f"torch.compile's first call took {first_call_s:.0f} s at N={case.n} "
                                            f"V={case.v}, over the {COMPILE_BUDGET_S:.0f} s budget")

    key = (case.method, case.n, case.v)
    sample = grad_sample(prepared)
    if case.competitor == "eager":
        run.references[key] = (loss.cpu(), sample)
        check = {"reference": "dgpo_ops.reference_loss (small fp32 batch, before the run)", "ok": True}
    elif key in run.references:
        check = parity(loss.cpu(), sample, *run.references[key])
    else:
        check = {"reference": None, "ok": None, "note": "the eager case did not run in this session"}
    del sample

    leaf = prepared.leaf
    benchmark.pedantic(step, args=(prepared,), setup=lambda: setattr(leaf, "grad", None),
                       rounds=ROUNDS, warmup_rounds=0, iterations=1)
    stats = getattr(benchmark.stats, "stats", None) if benchmark.stats is not None else None
    time_s = None
    if stats is not None:
        time_s = {k: getattr(stats, k) for k in ("median", "min", "mean", "stddev", "max")}
        time_s["rounds"] = stats.rounds
        time_s["all"] = list(getattr(stats, "data", []))

    if run.device.type == "cuda":
        memory = cuda_peak_bytes(prepared)
    else:
        prepared.leaf.grad = None
        memory = memory_in_subprocess(case)
        if case.competitor == "ours" and case.n * case.v <= DEFAULT_MALLOC_PROBE_MAX:
            # Its chunk buffers (16 MiB) are below glibc's dynamic mmap threshold: also measure the RSS
            # under glibc's default (at the smaller sizes, where it matters most and costs least).
            default = memory_in_subprocess(case, fixed_mmap_threshold=False)
            memory["default_malloc_peak_bytes"] = default.get("peak_bytes", default.get("error"))
    leaf.grad = None

    rec = run.record(case, status="ok", time_s=time_s, first_call_s=first_call_s, loss=float(loss),
                     peak_bytes=memory.get("peak_bytes"), memory=memory, logits_bytes=inputs.logits_bytes,
                     parity=check, notes=prepared.notes)
    benchmark.extra_info.update(peak_bytes=rec["peak_bytes"], first_call_s=first_call_s, parity_ok=check.get("ok"))
    if "error" in memory:
        pytest.fail(f"peak memory not measured: {memory['error']}")
    assert check.get("ok") is not False, f"{case.competitor} differs from the eager path: {check}"
