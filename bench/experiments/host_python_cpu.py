"""The op's own host Python per call, measured on the CPU: a proxy for the host time of one
``fused_dgpo_loss`` forward + backward on CUDA without a GPU.

    python bench/experiments/host_python_cpu.py [--calls 300] [--liger] [--profile] [--out FILE.json]

The Triton kernels are the ones CUDA runs (``backend="triton"``, the interpreter's kernel objects) but each
launch is replaced by a no-op that only records it, and validation is ``"deferred"`` (CUDA's default), so
what is timed (this thread's CPU time, which other processes on the machine do not inflate; the wall time
too) is everything the host does around the launches: options, the plan, the checks from metadata,
allocations, the autograd Function and engine, the deferred-check bookkeeping. Not timed: Triton's own
per-launch binding (60-110 us per launch on the H100 VM, csrc_notes.md, "Host time") and the CUDA caching
allocator. The inputs are tiny, so torch's CPU kernels for the few O(N) ops cost next to nothing. Beside each
time per call: a call's CPU time from its start to its first launch, what a GPU trace reads as the host time
before the first kernel (less Triton's binding of that launch). It measures older trees too (1e826ac: its plan
stage then plans every call, as that tree does).

``--liger`` times Liger-Kernel's ``triton_grpo_loss`` forward + backward the same way in the same process, on the
same inputs (its ``(B, T + 1, V)`` logits, as ``gpu_check.py`` calls it): its Triton kernels are interpreter
kernel objects too, so the same no-op launches apply, and its torch ops on O(N) vectors run as ours do. Without
liger-kernel installed the run says so and times ours alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import dgpo_ops  # noqa: E402
from dgpo_ops.trainer.app.environment import describe  # noqa: E402

LAUNCHES: list[str] = []
FIRST_LAUNCH: list[float] = []  # this thread's CPU time at the first launch since it was last cleared


def no_op_launches() -> None:
    def getitem(self, grid):
        def launch(*args, **kwargs):
            if not FIRST_LAUNCH:
                FIRST_LAUNCH.append(time.thread_time())
            LAUNCHES.append(self.fn.__name__)

        return launch

    InterpretedFunction.__getitem__ = getitem


def before_first_launch_us(fn, calls: int) -> float:
    """The median over ``calls`` calls of this thread's CPU time from the call's start to its first launch: the
    host time before the first kernel, which a profiler trace on the GPU reads (with Triton's own binding of that
    launch on top)."""
    times = []
    for _ in range(calls):
        FIRST_LAUNCH.clear()
        start = time.thread_time()
        fn()
        times.append((FIRST_LAUNCH[0] - start) * 1e6)
    return statistics.median(times)


def python_calls(fn) -> int:
    """Python function calls (and C functions called from Python) in one call of ``fn``: a count that no
    other load on the machine changes."""
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return sum(stat[1] for stat in pstats.Stats(profile).stats.values())


def timed(name: str, cases: dict, calls: int, repeats: int) -> dict:
    """For each case (label -> a call), ``name`` (``..._us``): the median over ``repeats`` loops of ``calls`` calls of
    this thread's CPU time per call, with each loop's, the wall time, the launches of one call, its Python-level
    calls and its CPU time before its first launch. The cases' loops take turns, so that other load on the machine
    falls on each alike."""
    out = {}
    for label, fn in cases.items():
        for _ in range(20):
            fn()
        LAUNCHES.clear()
        fn()
        out[label] = {name.replace("_us", "_launches"): list(LAUNCHES), "loops": [], "walls": []}
    for _ in range(repeats):
        for label, fn in cases.items():
            start, wall = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            out[label]["loops"].append((time.thread_time() - start) / calls * 1e6)
            out[label]["walls"].append((time.perf_counter() - wall) / calls * 1e6)
    for label, fn in cases.items():
        row = out[label]
        loops, walls = row.pop("loops"), row.pop("walls")
        row[name] = statistics.median(loops)
        row[name.replace("_us", "_loops_us")] = loops
        row[name.replace("_us", "_wall_us")] = statistics.median(walls)
        row[name.replace("_us", "_python_calls")] = python_calls(fn)
        row[name.replace("_us", "_before_first_launch_us")] = before_first_launch_us(fn, calls)
    return out


# Liger's call, as bench/experiments/gpu_check.py makes it: grpo with the token mean (bnpo), no KL.
LIGER_CALL = ("triton_grpo_loss(padded, old, None, target, adv, completion_mask=mask.int(), temperature=1.0, "
              "beta=0.0, eps_low=0.2, eps_high=0.2, inplace=False, loss_type='bnpo', reduce=True)")


def liger_step(logits, target, adv, mask, old):
    """A forward + backward of Liger-Kernel's ``triton_grpo_loss`` on these inputs (its logits carry one more
    position, which it drops), or why there is none."""
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError as error:
        return f"liger-kernel is not installed ({error})"
    B, T, V = logits.shape
    padded = torch.zeros(B, T + 1, V, dtype=logits.dtype)
    padded[:, :-1] = logits.detach()
    padded.requires_grad_(True)
    cmask = mask.int()

    def step():
        padded.grad = None
        loss, _ = triton_grpo_loss(padded, old, None, target, adv, completion_mask=cmask, temperature=1.0, beta=0.0,
                                   eps_low=0.2, eps_high=0.2, inplace=False, loss_type="bnpo", reduce=True)
        loss.backward()

    return step


def stage_times(logits, target, adv, mask, old, calls: int) -> dict:
    """This thread's CPU time of each host stage of the forward alone (us per call), cumulative: each
    stage runs everything before it too, so the differences are what a stage adds."""
    from dgpo_ops.kernels.row_io import RowWorkspace

    from dgpo_ops.core.inputs import LossInputs
    from dgpo_ops.core.options import LossOptions
    from dgpo_ops.ops.logits import FusedPolicyLossFunction

    try:  # as the op plans: the template cached for the call's signature (a tree before 1f23387 plans every call)
        from dgpo_ops.ops.logits import cached_logits_plan as op_plan
    except ImportError:
        from dgpo_ops.ops.logits import logits_plan as op_plan

    def options():
        return LossOptions.build("dgpo", backend="triton", validation="deferred")

    def batch():
        return options(), LossInputs(target, adv, mask, old, None, None, None)

    def plan():
        opts, b = batch()
        return op_plan(logits, b, opts, needs_grad=True)

    def workspace():
        p = plan()
        return RowWorkspace.allocate(logits.shape[:-1], p.inputs.grid[0], logits.device, torch.float32)

    def function_no_grad():
        with torch.no_grad():
            return FusedPolicyLossFunction.apply(logits, plan())

    def forward_with_graph():
        return FusedPolicyLossFunction.apply(logits, plan())

    out = {}
    for name, fn in (("options", options), ("+ batch", batch), ("+ plan (as the op plans)", plan),
                     ("+ workspace allocation", workspace), ("+ forward launches (no_grad)", function_no_grad),
                     ("+ autograd graph", forward_with_graph)):
        for _ in range(50):
            fn()
        dgpo_ops.raise_deferred_errors()  # each stage starts with an empty queue of deferred checks
        start = time.thread_time()
        for _ in range(calls):
            fn()
        out[name] = (time.thread_time() - start) / calls * 1e6
    dgpo_ops.raise_deferred_errors()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5, help="timed loops of --calls calls; the median is kept")
    parser.add_argument("--liger", action="store_true",
                        help="also time Liger-Kernel's triton_grpo_loss forward + backward the same way")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of 100 calls")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    no_op_launches()
    torch.set_num_threads(1)
    B, T, V = 2, 64, 256
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.12
    old = -torch.rand(B, T, generator=g) * 5
    adv = torch.randn(B, generator=g)

    def fwd_bwd():
        logits.grad = None
        dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old, backend="triton", validation="deferred").loss.backward()

    def fwd_no_grad():
        with torch.no_grad():
            dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old, backend="triton", validation="deferred")

    # thread CPU time is not inflated by other load, but caches shared with it are: the load is kept with the times
    results = {"machine": describe(torch.device("cpu")), "shape": [B, T, V], "load_average_before": os.getloadavg()}
    step = liger_step(logits, target, adv, mask, old) if args.liger else None
    cases = {"ours": fwd_bwd} if step is None or isinstance(step, str) else {"ours": fwd_bwd, "liger": step}
    together = timed("fwd_bwd_us", cases, args.calls, args.repeats)
    results.update(together["ours"])
    dgpo_ops.raise_deferred_errors()
    results.update(timed("fwd_no_grad_us", {"ours": fwd_no_grad}, args.calls, args.repeats)["ours"])
    dgpo_ops.raise_deferred_errors()
    results["stages_us"] = stage_times(logits, target, adv, mask, old, args.calls * 5)
    if isinstance(step, str):
        results["liger"] = {"unavailable": step}
    elif step is not None:
        results["liger"] = dict(together["liger"], call=LIGER_CALL)
        results["ours_over_liger"] = results["fwd_bwd_us"] / results["liger"]["fwd_bwd_us"]
        # each loop of ours over the loop of Liger's right after it: what drifting load leaves alike
        results["ours_over_liger_per_loop"] = statistics.median(
            a / b for a, b in zip(results["fwd_bwd_loops_us"], results["liger"]["fwd_bwd_loops_us"]))
    results["load_average_after"] = os.getloadavg()
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=1))
    if args.profile:
        profile = cProfile.Profile(time.thread_time)  # this thread's CPU time: other load does not show
        profile.enable()
        for _ in range(100):
            fwd_bwd()
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(45)
        print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
