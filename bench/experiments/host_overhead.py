"""Host time of one fused-op call on a GPU machine: a cProfile of the Python side and the submit time of
each piece (the GPU keeps up, so the loop measures the host alone).

    python bench/experiments/host_overhead.py [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch

import dgpo_ops

DEV = "cuda"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    B, T, V = 2, 1024, 4096  # small: the GPU is never the bottleneck
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(B, T, V, device=DEV, generator=g).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, V, (B, T), device=DEV, generator=g)
    mask = torch.rand(B, T, device=DEV, generator=g) > 0.12
    old = -torch.rand(B, T, device=DEV, generator=g) * 5
    adv = torch.randn(B, device=DEV, generator=g)
    results = {}

    def submit_us(fn, iters=200):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / iters * 1e6

    def fwd_bwd():
        logits.grad = None
        dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old).loss.backward()

    def fwd():
        dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old)

    def fwd_no_grad():
        with torch.no_grad():
            dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old)

    results["fwd_bwd_us"] = submit_us(fwd_bwd)
    results["fwd_us"] = submit_us(fwd)
    results["fwd_no_grad_us"] = submit_us(fwd_no_grad)
    results["empty_alloc_us"] = submit_us(lambda: torch.empty(B * T, device=DEV), 1000)
    # The same submit time for the peers' forward + backward (grpo, token mean) at the same size.
    from bench import common

    inputs = common.make_inputs(B * T, V, torch.device(DEV))
    for competitor in ("ours", "liger", "trl"):
        if common.unavailable(competitor, "grpo", torch.device(DEV)):
            continue
        prepared = common.prepare(competitor, "grpo", inputs)

        def peer_step(prepared=prepared):
            prepared.leaf.grad = None
            prepared.forward().backward()

        results[f"{competitor}_grpo_fwd_bwd_us"] = submit_us(peer_step)
    print(json.dumps(results), flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        fwd_bwd()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    print(text.getvalue()[:12000])
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "host_overhead_profile.txt"), "w") as f:
        f.write(text.getvalue())


if __name__ == "__main__":
    main()
