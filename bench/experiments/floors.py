"""The device's floors, measured in the same command as the ops they judge: copy bandwidth, the bf16 GEMM rate, and
the fused-linear backward's scale-and-cast against the ``torch.mul`` into a bf16 output that it replaces.

    python bench/experiments/floors.py [--out floors.json] [--device cpu --elements 1000000]   (cpu: a dry run)

* ``copy``: a bf16 device-to-device copy of ``--elements`` elements, bytes read + written per second;
* ``gemm``: bf16 products at the fused linear's three shapes (N x H x V: logits, d hidden, d weight) and 8192^3,
  TFLOP/s;
* ``scale_cast``: an fp32 accumulator of ``--elements`` elements scaled by a device scalar into bf16, by
  ``kernels/scale_cast.py`` and by ``torch.mul(..., out=bf16)``, bytes (4 read + 2 written per element) per second.
Each time is the median of ``triton.testing.do_bench`` on CUDA (one call on the CPU dry run).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def median_ms(fn, device: str) -> float:
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="floors.json")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--elements", type=int, default=151936 * 4096, help="the weight of H = 4,096 by default")
    parser.add_argument("--shapes", nargs="+", default=["8192x1536x151936", "8192x4096x151936"])
    args = parser.parse_args()
    device = args.device
    from dgpo_ops.trainer.app.environment import describe

    result = {"env": describe(torch.device(device)), "arguments": vars(args)}
    n = args.elements
    source = torch.randn(n, device=device).to(torch.bfloat16)
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), device)
    result["copy"] = {"ms": ms, "tb_per_s": 4 * n / ms / 1e9}
    del source, target

    accumulator = torch.randn(n, device=device)
    scale = torch.tensor([0.5], device=device)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    if device == "cuda":
        from dgpo_ops.kernels.scale_cast import scale_cast
    else:  # the dry run: the twin (the kernel needs a GPU or the interpreter)
        from dgpo_ops.kernels.torch_twins import scale_cast_torch as scale_cast
    rows = {}
    for name, fn in (("scale_cast kernel", lambda: scale_cast(accumulator, scale, out)),
                     ("torch.mul into bf16", lambda: torch.mul(accumulator, scale, out=out))):
        ms = median_ms(fn, device)
        rows[name] = {"ms": ms, "tb_per_s": 6 * n / ms / 1e9}
    result["scale_cast"] = rows
    del accumulator, out

    gemms = []
    for shape in args.shapes + (["8192x8192x8192"] if device == "cuda" else []):
        N, H, V = (int(x) for x in shape.split("x"))
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        hidden, weight = torch.randn(N, H, device=device, dtype=dtype), torch.randn(V, H, device=device, dtype=dtype)
        logits = hidden @ weight.t()
        for product, fn in (("logits", lambda: hidden @ weight.t()), ("d hidden", lambda: logits @ weight),
                            ("d weight", lambda: logits.t() @ hidden)):
            ms = median_ms(fn, device)
            gemms.append({"shape": shape, "product": product, "ms": ms, "tflop_per_s": 2 * N * H * V / ms / 1e9})
        del hidden, weight, logits
    result["gemm"] = gemms
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in result.items() if k not in ("env", "arguments")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
