"""Where the on-chip fused linear's time goes: the device time of each kernel of one forward + backward of
``fused_linear_dgpo_loss(..., logits_on_chip=True)`` (and of the default tile path beside it), by
``torch.profiler``, at the sizes of ``bench/fused_linear.py``.

    python bench/experiments/on_chip_split.py [--sizes 8192x1536x151936 ...] [--settings bf16 autocast] [--out F]
        [--grad-shapes 128,128,32,8,2 ...]

``--grad-shapes``: other tiles of the gradient kernel (``block_n,block_v,block_k,num_warps,num_stages``; the
default is ``kernels/linear_logits.py``'s ``linear_grad_shape``), each timed on the on-chip path in the first
setting: the gradient's atomic additions scale as ``N V H (1 / block_n + 1 / block_v)``.

On the CPU (no CUDA) it runs the Triton kernels in the interpreter at a tiny size and reports the profiler's CPU
times instead: a dry run that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.fused_linear import EPS_HIGH, EPS_LOW, make_inputs  # noqa: E402


def one_call(inputs, setting: str, on_chip: bool, device: str) -> None:
    import dgpo_ops

    hidden, weight, target, mask, old_logps, advantages = inputs
    hidden.grad = weight.grad = None
    with torch.autocast(device, dtype=torch.bfloat16, enabled=setting == "autocast"):
        out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, target, advantages, mask, old_logps, method="grpo",
                                              eps_low=EPS_LOW, eps_high=EPS_HIGH, logits_on_chip=on_chip,
                                              backend="triton")
    out.loss.backward()


def kernel_times(inputs, setting: str, on_chip: bool, device: str) -> dict[str, float]:
    """Milliseconds of device time per kernel name in one call, after a warm-up call (without CUDA: the CPU time of
    every profiled range, nested ones counted again: a dry run's output, not a split)."""
    from torch.profiler import ProfilerActivity, profile

    one_call(inputs, setting, on_chip, device)  # compiles
    if device == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        one_call(inputs, setting, on_chip, device)
        if device == "cuda":
            torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if device == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        microseconds = event.time_range.elapsed_us() if device == "cuda" else event.cpu_time
        totals[event.name[:80]] += microseconds / 1e3
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=None, help="NxHxV")
    parser.add_argument("--settings", nargs="+", default=["bf16", "autocast"], choices=["bf16", "autocast", "fp32"])
    parser.add_argument("--out", default="on_chip_split.json")
    parser.add_argument("--grad-shapes", nargs="*", default=[], metavar="N,V,K,WARPS,STAGES")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sizes = args.sizes or (["8192x1536x151936", "8192x4096x151936"] if device == "cuda" else ["64x32x500"])
    settings = args.settings if device == "cuda" else ["fp32"]
    rows = []
    from dgpo_ops.kernels import linear_grad, linear_logits

    for shape in args.grad_shapes:
        block_n, block_v, block_k, warps, stages = (int(x) for x in shape.split(","))
        tile = linear_logits.GemmShape(block_n, block_v, block_k, warps, stages)
        linear_grad.linear_grad_shape = lambda hidden, weight, tile=tile: tile
        for size in sizes:
            N, H, V = (int(x) for x in size.split("x"))
            inputs = make_inputs(N, H, V, settings[0], device)
            try:
                times = kernel_times(inputs, settings[0], True, device)
            except Exception as error:  # a tile that does not fit (shared memory, registers): say so, go on
                print(f"grad shape {shape} at {size}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            finally:
                del inputs
            rows.append(dict(N=N, H=H, V=V, setting=settings[0], path="on_chip", grad_shape=shape,
                             total_ms=sum(times.values()), kernels_ms=times))
            top = ", ".join(f"{name} {ms:.1f}" for name, ms in list(times.items())[:3])
            print(f"grad shape {shape} at {size} {settings[0]}: total {rows[-1]['total_ms']:.1f} ms: {top}", flush=True)
    linear_grad.linear_grad_shape = linear_logits.linear_grad_shape
    for size in sizes:
        N, H, V = (int(x) for x in size.split("x"))
        for setting in settings:
            inputs = make_inputs(N, H, V, setting, device)
            for on_chip in (True, False):
                times = kernel_times(inputs, setting, on_chip, device)
                rows.append(dict(N=N, H=H, V=V, setting=setting, path="on_chip" if on_chip else "tiles",
                                 total_ms=sum(times.values()), kernels_ms=times))
                top = ", ".join(f"{name} {ms:.1f}" for name, ms in list(times.items())[:5])
                print(f"{N}x{H}x{V} {setting:8s} {rows[-1]['path']:7s} total {rows[-1]['total_ms']:8.1f} ms: {top}",
                      flush=True)
            del inputs
            if device == "cuda":
                torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter, not a measurement)"
    Path(args.out).write_text(json.dumps(dict(device=name, torch=torch.__version__,
                                              commit=os.environ.get("DGPO_OPS_COMMIT"), rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
