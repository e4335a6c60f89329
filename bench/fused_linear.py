"""The fused linear + policy loss (hidden states and lm_head weight in, loss and gradients out) against
TRL 1.16's ``ChunkedLogProbFunction`` + TRL's loss, Liger-Kernel's ``LigerFusedLinearGRPOLoss``, Apple's Cut
Cross-Entropy (``linear_cross_entropy(..., reduction="none")`` + TRL's loss; CUDA, Ampere or newer) and the eager
path (whole logits, ``log_softmax``, TRL's loss), side by side.

    python bench/fused_linear.py [--sizes NxHxV ...] [--settings ...] [--competitors ...] [--repeats 5]

On a GPU (the default sizes are Qwen2.5-1.5B's head and a 4,096-wide one: N = 8192, V = 151,936, H = 1,536
and 4,096) each (size, setting, competitor) runs in this process: time is the median of ``--repeats`` forward +
backward calls (CUDA-synchronised wall time), peak memory is ``torch.cuda.max_memory_allocated``
during one call over what was allocated before it. Settings: ``autocast`` (bf16 autocast over fp32
hidden states and weight: a bf16 training run with fp32 master weights, ``DGPOTrainer``'s case) and
``bf16`` (bf16 hidden states and weight, no autocast). On the CPU (``fp32``, the smaller default
sizes) each competitor runs in its own process and peak memory is that process's max RSS over its
RSS once the inputs existed. The loss is DAPO's clip (eps 0.2 / 0.28) with a token mean over
unmasked tokens; every competitor's loss is compared with ours.

Writes ``bench/results/fused_linear-<device>.json`` and the table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
EPS_LOW, EPS_HIGH = 0.2, 0.28
COMPETITORS = {
    "ours": "dgpo_ops.fused_linear_dgpo_loss",
    "ours_on_chip": "dgpo_ops.fused_linear_dgpo_loss(logits_on_chip=True): logits only in registers",
    # The tile path with two tile buffers, each tile's row kernels on a side stream beside the previous tile's
    # GEMMs (ops/linear.py, PIPELINE_TILES): what that overlap gains over ``ours``, side by side.
    "ours_pipelined": "dgpo_ops.fused_linear_dgpo_loss, row kernels beside the GEMMs (PIPELINE_TILES = True)",
    # Under autocast over fp32 weights, each vocabulary block's cast on a side stream beside the previous block's
    # GEMM (ops/linear.py, OVERLAP_WEIGHT_CASTS); with bf16 weights nothing is cast and it runs as ``ours``.
    "ours_overlapped_casts": "dgpo_ops.fused_linear_dgpo_loss, weight casts beside the GEMMs (OVERLAP_WEIGHT_CASTS = True)",
    "trl": "TRL 1.16 ChunkedLogProbFunction + TRL loss",
    "liger": "Liger-Kernel LigerFusedLinearGRPOLoss (dapo)",
    "eager": "whole logits + log_softmax + TRL loss",
    # Apple's reference design (PyPI cut-cross-entropy 25.1.1): -log p per token, TRL's loss on top. Its kernels
    # need CUDA on Ampere or newer; elsewhere the row records why it did not run.
    "cce": "Cut Cross-Entropy linear_cross_entropy(reduction='none') + TRL loss",
    # What no fused linear can beat: the three products of the whole batch (logits, d hidden, d weight) in the
    # compute dtype, one call each, no softmax, no loss (its "loss" is not compared).
    "gemm_floor": "the three GEMMs alone: hidden @ W^T, then (that) @ W and (that)^T @ hidden",
}
NOT_A_LOSS = ("gemm_floor",)
GPU_SIZES = ["8192x1536x151936", "8192x4096x151936"]
CPU_SIZES = ["4096x1024x32768", "4096x1024x151936"]


def make_inputs(N, H, V, setting, device, seed=0):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    params_dtype = torch.bfloat16 if setting == "bf16" else torch.float32
    B = max(1, N // 1024)
    hidden = (torch.randn(B, N // B, H, generator=g, device=device) / H**0.5).to(params_dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g, device=device) * 0.5).to(params_dtype).requires_grad_(True)
    target = torch.randint(0, V, (B, N // B), generator=g, device=device)
    mask = torch.rand(B, N // B, generator=g, device=device) > 0.12
    old_logps = -torch.rand(B, N // B, generator=g, device=device) * 12.0
    advantages = torch.randn(B, generator=g, device=device)
    return hidden, weight, target, mask, old_logps, advantages


def trl_loss(logps, old_logps, advantages, mask):
    import torch

    ratio = torch.exp(logps - old_logps)
    a = advantages[:, None]
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def step_fn(competitor, inputs, setting):
    """A closure running one forward + backward of ``competitor`` and returning the loss tensor."""
    import torch

    hidden, weight, target, mask, old_logps, advantages = inputs
    autocast = setting == "autocast"
    device = hidden.device.type
    B, T, H = hidden.shape

    def context():
        return torch.autocast(device, dtype=torch.bfloat16, enabled=autocast)

    if competitor in ("ours", "ours_on_chip", "ours_pipelined", "ours_overlapped_casts"):
        import dgpo_ops
        from dgpo_ops.ops import linear as linear_module

        def step():
            linear_module.PIPELINE_TILES = competitor == "ours_pipelined"  # per call: competitors share a process
            linear_module.OVERLAP_WEIGHT_CASTS = competitor == "ours_overlapped_casts"
            with context():
                out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, target, advantages, mask, old_logps,
                                                      method="grpo", eps_low=EPS_LOW, eps_high=EPS_HIGH,
                                                      logits_on_chip=competitor == "ours_on_chip")
            out.loss.backward()
            return out.loss
    elif competitor == "trl":
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer import utils as trl_utils

        chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 4096)

        def step():
            with context():
                logps = ChunkedLogProbFunction.apply(hidden.reshape(-1, H), weight, None, target.reshape(-1), 1.0,
                                                     chunk, None, 1.0, ("entropy",))[0].view(B, T)
                loss = trl_loss(logps, old_logps, advantages, mask)
            loss.backward()
            return loss
    elif competitor == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        module = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                          loss_type="dapo")

        def step():
            with context():
                loss, _ = module(hidden, weight, target, mask.int(), advantages, old_per_token_logps=old_logps,
                                 num_items_in_batch=mask.sum())
            loss.backward()
            return loss
    elif competitor == "cce":
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
            raise RuntimeError("Cut Cross-Entropy's kernels need a CUDA GPU of compute capability 8.0 or newer")
        from cut_cross_entropy import linear_cross_entropy

        def step():
            with context():
                # its kernels take both operands in one low-precision dtype: under autocast, cast as autocast would
                operand = torch.bfloat16 if autocast else hidden.dtype
                nll = linear_cross_entropy(hidden.to(operand), weight.to(operand), target, reduction="none")
                loss = trl_loss(-nll.float().view(B, T), old_logps, advantages, mask)
            loss.backward()
            return loss
    elif competitor == "gemm_floor":
        def step():
            with torch.no_grad(), context():
                flat = hidden.reshape(-1, H)
                logits = flat @ weight.t()
                grad_hidden = logits @ weight
                grad_weight = logits.t() @ flat
            return grad_hidden[0, 0] + grad_weight[0, 0]
    elif competitor == "eager":
        def step():
            with context():
                logits = hidden @ weight.t()
                logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, target[..., None])[..., 0]
                loss = trl_loss(logps, old_logps, advantages, mask)
            loss.backward()
            return loss
    else:
        raise ValueError(competitor)
    return step


def time_step(run, repeats: int, device: str) -> tuple[dict, object]:
    """``(timings, what the first call returned)``: the first call outside the timing (it compiles: Triton,
    torch.compile), on CUDA one more for the peak memory over what was allocated before it, then ``repeats``
    synchronised calls. ``run`` clears the gradients it accumulates itself."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    started = time.perf_counter()
    first = run()
    sync()
    timings = {"first_call_s": time.perf_counter() - started, "extra_peak_bytes": None}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        timings["extra_peak_bytes"] = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return {**timings, "seconds_median": statistics.median(times), "seconds_min": min(times)}, first


def measure_cuda(competitor, size, setting, repeats):
    N, H, V = size
    inputs = make_inputs(N, H, V, setting, "cuda")
    step = step_fn(competitor, inputs, setting)

    def run():
        inputs[0].grad = inputs[1].grad = None
        return step()

    timings, loss = time_step(run, repeats, "cuda")
    if competitor in NOT_A_LOSS:
        return timings
    return {**timings, "loss": float(loss), "weight_grad_norm": float(inputs[1].grad.float().norm())}


def child(competitor, N, H, V, setting, repeats):
    """CPU: one competitor in a fresh process (RSS is the process's)."""
    import torch

    torch.manual_seed(0)
    step_fn(competitor, make_inputs(8, 8, 8, setting, "cpu"), setting)  # imports stay out of time and memory
    inputs = make_inputs(N, H, V, setting, "cpu")
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step = step_fn(competitor, inputs, setting)
    times, loss = [], None
    for _ in range(repeats):
        inputs[0].grad = inputs[1].grad = None
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {"seconds_median": statistics.median(times), "seconds_min": min(times),
              "extra_peak_bytes": (peak - baseline) * 1024}
    if competitor not in NOT_A_LOSS:
        result.update(loss=float(loss), weight_grad_norm=float(inputs[1].grad.float().norm()))
    print(json.dumps(result))


def machine(device: str) -> dict:
    import torch

    from dgpo_ops.trainer.app.environment import describe

    return describe(torch.device(device), packages=("trl", "liger-kernel", "cut-cross-entropy"))


def write_markdown(doc, path: Path):
    m = doc["machine"]
    where = m.get("device_name") or f"CPU ({m['cpu_count']} cores)"
    lines = [
        f"{where}, torch {m['torch']}, triton {m['triton']}, trl {m.get('trl')}, liger-kernel {m.get('liger_kernel')}"
        f"{', cut-cross-entropy ' + m['cut_cross_entropy'] if m.get('cut_cross_entropy') else ''}; "
        f"dgpo_ops {m.get('dgpo_ops_commit')}{' + local changes' if m.get('dgpo_ops_worktree_dirty') else ''}; "
        f"`{doc['command']}`. Forward + backward of DAPO's loss from hidden states and the lm_head weight; "
        f"time: median of {doc['repeats']} calls; extra peak memory of one call.",
        "",
        "| N | H | V | setting | " + " | ".join(f"{c} (ms)" for c in doc["competitors"]) + " | "
        + " | ".join(f"{c} peak (GB)" for c in doc["competitors"]) + " | largest loss difference to ours |",
        "|" + "---|" * (5 + 2 * len(doc["competitors"])),
    ]
    for row in doc["rows"]:
        cells = [str(row["N"]), str(row["H"]), str(row["V"]), row["setting"]]
        results = row["results"]
        cells += [f"{results[c]['seconds_median'] * 1e3:.1f}" if "seconds_median" in results.get(c, {}) else "-"
                  for c in doc["competitors"]]
        cells += [f"{results[c]['extra_peak_bytes'] / 1e9:.2f}" if "extra_peak_bytes" in results.get(c, {}) else "-"
                  for c in doc["competitors"]]
        ours = results.get("ours", {}).get("loss")
        diffs = [abs(r["loss"] - ours) for c, r in results.items() if c != "ours" and "loss" in r and ours is not None]
        cells.append(f"{max(diffs):.1e}" if diffs else "-")
        lines.append("| " + " | ".join(cells) + " |")
    errors = [f"* {c} at {r['N']}x{r['H']}x{r['V']} {r['setting']}: {res['error']}" for r in doc["rows"]
              for c, res in r["results"].items() if "error" in res]
    path.write_text("\n".join(lines + ([""] + errors if errors else [])) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", help="NxHxV (default: GPU_SIZES on a GPU, two CPU sizes on the CPU)")
    parser.add_argument("--settings", nargs="+", choices=["autocast", "bf16", "fp32"])
    parser.add_argument("--competitors", nargs="+", choices=list(COMPETITORS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--child", nargs=5, metavar=("COMPETITOR", "N", "H", "V", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        competitor, N, H, V, setting = args.child
        return child(competitor, int(N), int(H), int(V), setting, args.repeats)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = [tuple(int(x) for x in s.split("x")) for s in (args.sizes or (GPU_SIZES if device == "cuda" else CPU_SIZES))]
    settings = args.settings or (["autocast", "bf16"] if device == "cuda" else ["fp32"])
    competitors = args.competitors or (list(COMPETITORS) if device == "cuda" else ["ours", "trl"])
    rows = []
    for size in sizes:
        for setting in settings:
            row = {"N": size[0], "H": size[1], "V": size[2], "setting": setting, "results": {}}
            for competitor in competitors:
                print(f"[{'x'.join(map(str, size))} {setting}] {competitor} ...", flush=True)
                try:
                    if device == "cuda":
                        result = measure_cuda(competitor, size, setting, args.repeats)
                        torch.cuda.empty_cache()
                    else:
                        proc = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), "--child",
                                               competitor, *map(str, size), setting], capture_output=True, text=True)
                        if proc.returncode != 0:
                            raise RuntimeError(proc.stderr.strip().splitlines()[-1])
                        result = json.loads(proc.stdout.strip().splitlines()[-1])
                except Exception as error:  # noqa: BLE001 - record and go on with the others
                    result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                row["results"][competitor] = result
                print(f"    {json.dumps(result)}", flush=True)
            rows.append(row)
    tag = "cpu" if device == "cpu" else "cuda-" + "".join(
        ch if ch.isalnum() else "-" for ch in torch.cuda.get_device_name().lower()).strip("-")
    doc = {"command": "python bench/fused_linear.py" + (" " + " ".join(argv) if argv else ""),
           "machine": machine(device), "repeats": args.repeats, "competitors": competitors,
           "competitor_labels": {c: COMPETITORS[c] for c in competitors}, "rows": rows}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"fused_linear-{tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_markdown(doc, out / f"fused_linear-{tag}.md")
    print((out / f"fused_linear-{tag}.md").read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
