"""fused_linear_dgpo_loss against TRL 1.16's ChunkedLogProbFunction followed by TRL's own loss.

    python bench/fused_linear_vs_trl.py [--sizes 4096x1024x32768 4096x1024x151936] [--method dapo]

Each (implementation, size) runs forward + backward in its own subprocess, so peak memory is that
process's max RSS above what it held once the inputs existed. Time is the best of --repeats runs.
Writes bench/results/fused_linear_vs_trl.json with the machine description.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

METHODS = {  # TRL loss_type -> (our method, its parameters)
    "dapo": ("grpo", {"eps_low": 0.2, "eps_high": 0.28}),
    "grpo": ("grpo", {"eps_low": 0.2, "eps_high": 0.2}),
}


def make_inputs(N, H, V, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, H, generator=g) / H**0.5).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_(True)
    target = torch.randint(0, V, (N,), generator=g)
    old_logps = -torch.rand(N, generator=g) * 12.0
    advantages = torch.randn(N, generator=g)
    return hidden, weight, target, old_logps, advantages


def trl_step(hidden, weight, target, old_logps, advantages, loss_type):
    """TRL 1.16: ChunkedLogProbFunction for the log-probs, then GRPOTrainer._compute_loss's clip loss."""
    import torch
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import utils as trl_utils

    eps_low, eps_high = 0.2, METHODS[loss_type][1]["eps_high"]
    chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 4096)
    logps = ChunkedLogProbFunction.apply(hidden, weight, None, target, 1.0, chunk, None, 1.0, ("entropy",))[0]
    coef_1 = torch.exp(logps - old_logps)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    loss = per_token_loss.sum() / per_token_loss.numel()  # dapo: token mean over the batch
    loss.backward()
    return loss.item()


def ours_step(hidden, weight, target, old_logps, advantages, loss_type):
    import dgpo_ops

    method, params = METHODS[loss_type]
    out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, target, advantages, old_logps=old_logps, method=method,
                                          **params)
    out.loss.backward()
    return out.loss.item()


def child(impl, N, H, V, loss_type, repeats):
    import torch

    torch.manual_seed(0)
    if impl == "trl":  # imports (transformers comes with them) stay out of the time and the memory
        import trl.kernels  # noqa: F401
        import trl.trainer.utils  # noqa: F401
    else:
        import dgpo_ops  # noqa: F401
    inputs = make_inputs(N, H, V)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step = trl_step if impl == "trl" else ours_step
    times, loss = [], None
    for _ in range(repeats):
        for t in inputs[:2]:
            t.grad = None
        start = time.perf_counter()
        loss = step(*inputs, loss_type)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grad_norm = float(inputs[1].grad.norm())
    print(json.dumps({"seconds": min(times), "extra_peak_mib": (peak - baseline) / 1024, "loss": loss,
                      "weight_grad_norm": grad_norm}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["4096x1024x32768", "4096x1024x151936"])
    parser.add_argument("--method", default="dapo", choices=sorted(METHODS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fused_linear_vs_trl.json"))
    parser.add_argument("--report-only", action="store_true", help="rewrite the markdown table from the JSON")
    parser.add_argument("--child", nargs=4, metavar=("IMPL", "N", "H", "V"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        impl, N, H, V = args.child
        return child(impl, int(N), int(H), int(V), args.method, args.repeats)

    if args.report_only:
        with open(args.out) as f:
            write_markdown(json.load(f), args.out.replace(".json", ".md"))
        return None

    import torch
    import triton
    import trl

    rows = []
    for size in args.sizes:
        N, H, V = (int(x) for x in size.split("x"))
        row = {"N": N, "H": H, "V": V, "method": args.method}
        for impl in ("trl", "ours"):
            print(f"[{size}] {impl} ...", flush=True)
            result = subprocess.run([sys.executable, __file__, "--method", args.method, "--repeats", str(args.repeats),
                                     "--child", impl, str(N), str(H), str(V)], capture_output=True, text=True)
            if result.returncode != 0:
                raise SystemExit(result.stderr)
            row[impl] = json.loads(result.stdout.strip().splitlines()[-1])
        row["time_ratio_trl_over_ours"] = row["trl"]["seconds"] / row["ours"]["seconds"]
        row["memory_ratio_ours_over_trl"] = row["ours"]["extra_peak_mib"] / row["trl"]["extra_peak_mib"]
        row["loss_abs_diff"] = abs(row["trl"]["loss"] - row["ours"]["loss"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    machine = {"device": "cpu", "processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "torch": torch.__version__, "triton": triton.__version__, "trl": trl.__version__,
               "dtype": "float32", "python": platform.python_version()}
    result = {"machine": machine, "repeats": args.repeats, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    write_markdown(result, args.out.replace(".json", ".md"))
    print(f"wrote {args.out}")


def write_markdown(result, path):
    """The results table, generated from the JSON (never typed by hand)."""
    m = result["machine"]
    lines = [
        f"Measured on {m['device']} ({m['cores']} cores, {m['processor']}), torch {m['torch']}, triton {m['triton']}, "
        f"TRL {m['trl']}, {m['dtype']}, best of {result['repeats']}; forward + backward of the {result['rows'][0]['method']} loss.",
        "",
        "| N | H | V | TRL chunked + TRL loss (s) | dgpo-ops fused linear (s) | speed-up | TRL extra peak (MiB) "
        "| ours extra peak (MiB) | memory ratio | loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['N']} | {r['H']} | {r['V']} | {r['trl']['seconds']:.2f} | {r['ours']['seconds']:.2f} | "
            f"{r['time_ratio_trl_over_ours']:.2f}x | {r['trl']['extra_peak_mib']:.0f} | {r['ours']['extra_peak_mib']:.0f} | "
            f"{r['memory_ratio_ours_over_trl']:.2f} | {r['loss_abs_diff']:.1e} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
