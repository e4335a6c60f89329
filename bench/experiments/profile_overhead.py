"""Where a fused-op call's time goes on a GPU: CUDA time per kernel, host time per call, launch shapes,
and the fused-linear tile budget against time and peak memory.

    python bench/experiments/profile_overhead.py [--out DIR]

Writes ``profile_overhead.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch

import dgpo_ops

DEV = "cuda"


def logits_inputs(N, V, seed=0):
    B, T = N // 1024, 1024
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = (torch.randn(B, T, V, device=DEV, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, V, (B, T), device=DEV, generator=g)
    mask = torch.rand(B, T, device=DEV, generator=g) > 0.12
    old = -torch.rand(B, T, device=DEV, generator=g) * 5
    adv = torch.randn(B, device=DEV, generator=g)
    return logits, target, mask, old, adv


def profile_call(V, method, iters=10):
    logits, target, mask, old, adv = logits_inputs(8192, V)

    def step():
        logits.grad = None
        dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old, method=method).loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # host time to submit one call while the GPU keeps up (queue not full): many calls, one sync
    start = time.perf_counter()
    for _ in range(iters):
        step()
    submitted = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += 1
            kernels[event.name][1] += event.device_time
    table = {name: {"calls_per_step": n / iters, "us_per_step": t / iters} for name, (n, t) in kernels.items()}
    result = {"V": V, "method": method, "host_submit_us_per_step": (submitted - start) / iters * 1e6,
              "wall_us_per_step": (done - start) / iters * 1e6,
              "cuda_us_per_step": sum(v["us_per_step"] for v in table.values()), "kernels": table}
    print(f"V={V} {method}: host submit {result['host_submit_us_per_step']:.0f} us, wall {result['wall_us_per_step']:.0f} us, "
          f"CUDA {result['cuda_us_per_step']:.0f} us", flush=True)
    for name, v in sorted(table.items(), key=lambda kv: -kv[1]["us_per_step"]):
        print(f"    {v['us_per_step']:8.1f} us  x{v['calls_per_step']:.0f}  {name[:90]}", flush=True)
    return result


def launch_shapes(V):
    """The whole op with other row-kernel launch shapes (monkeypatched), at N = 8192."""
    from dgpo_ops.kernels import logits_grad, logprob_entropy
    from triton.testing import do_bench

    logits, target, mask, old, adv = logits_inputs(8192, V)
    rows = []
    saved = (logprob_entropy.FORWARD_SHAPE, logprob_entropy.BACKWARD_SHAPE)
    try:
        for block, warps, stages in ((8192, 8, 3), (4096, 4, 3), (4096, 8, 3), (16384, 16, 3), (2048, 4, 4)):
            shape = logprob_entropy.LaunchShape(block, warps, stages)  # both row kernels (as run 3 measured)
            logprob_entropy.FORWARD_SHAPE = logits_grad.BACKWARD_SHAPE = shape

            def step():
                logits.grad = None
                dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old).loss.backward()

            def forward():
                with torch.no_grad():
                    dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old)

            rows.append({"V": V, "block": block, "warps": warps, "stages": stages,
                         "fwd_bwd_ms": do_bench(step, return_mode="median"),
                         "fwd_ms": do_bench(forward, return_mode="median")})
            print("[shape]", rows[-1], flush=True)
    finally:
        logprob_entropy.FORWARD_SHAPE, logits_grad.BACKWARD_SHAPE = saved
    return rows


def linear_budget(H):
    rows = []
    N, V = 8192, 151936
    g = torch.Generator(device=DEV).manual_seed(H)
    for params_dtype, autocast in ((torch.float32, True), (torch.bfloat16, False)):
        hidden = (torch.randn(8, N // 8, H, device=DEV, generator=g) / H**0.5).to(params_dtype).requires_grad_(True)
        weight = (torch.randn(V, H, device=DEV, generator=g) * 0.5).to(params_dtype).requires_grad_(True)
        target = torch.randint(0, V, (8, N // 8), device=DEV, generator=g)
        mask = torch.rand(8, N // 8, device=DEV, generator=g) > 0.12
        old = -torch.rand(8, N // 8, device=DEV, generator=g) * 12
        adv = torch.randn(8, device=DEV, generator=g)
        for budget_mib in (128, 256, 384, 512, 768):
            def step():
                hidden.grad = None
                weight.grad = None
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, target, adv, mask, old, method="grpo",
                                                          memory_budget=budget_mib * 2**20)
                out.loss.backward()

            step()
            torch.cuda.synchronize()
            hidden.grad = None
            weight.grad = None
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - before) / 1e9
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            times.sort()
            row = {"H": H, "setting": "autocast fp32 params" if autocast else "bf16 params", "budget_mib": budget_mib,
                   "ms_median": times[2], "peak_extra_gb": peak}
            rows.append(row)
            print("[linear]", row, flush=True)
        del hidden, weight
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--no-linear", action="store_true")
    parser.add_argument("--profile-only", action="store_true", help="only the per-call profiles")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "profiles": [], "shapes": [], "linear": []}
    for V in (32000, 151936):
        for method in ("dgpo", "grpo"):
            results["profiles"].append(profile_call(V, method))
    if not args.profile_only:
        for V in (32000, 151936):
            results["shapes"] += launch_shapes(V)
    if not args.no_linear and not args.profile_only:
        for H in (1536, 4096):
            results["linear"] += linear_budget(H)
    with open(os.path.join(args.out, "profile_overhead.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
