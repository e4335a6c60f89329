"""verl's fused log-prob backends against dgpo-ops' (``dgpo_ops.integrations.verl.linear_cross_entropy``):
per-token log-probs and entropies from hidden states and the lm_head weight, forward + backward of a loss
of both outputs (``sum(g * logp + h * entropy)``, random ``g`` and ``h``), as verl's actor update runs them.

    python bench/verl_fused.py [--sizes NxHxV ...] [--settings bf16 autocast] [--repeats 5]

Runs where verl is installed (``.ci/verl_cpu.sh`` builds such a venv on the CPU). Competitors: ``ours``,
``verl_triton`` (verl 0.9.1's ``verl.utils.kernel.linear_cross_entropy``: CUDA only, skipped with the
reason elsewhere) and ``verl_torch`` (``FusedLinearForPPO``, chunks of 512 tokens). On a GPU (default sizes:
N = 8192, H = 1,536 and 4,096, V = 151,936) time is the median of ``--repeats`` CUDA-synchronised calls and
peak memory ``torch.cuda.max_memory_allocated`` during one call over what was allocated before it. On the
CPU (one small size, fp32) only the time. Writes ``bench/results/verl_fused-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from fused_linear import time_step  # bench/: the script's own folder is on sys.path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GPU_SIZES = ["8192x1536x151936", "8192x4096x151936"]
CPU_SIZES = ["1024x256x32768"]
COMPETITORS = {
    "ours": "dgpo_ops.integrations.verl.linear_cross_entropy",
    "verl_triton": "verl 0.9.1 verl.utils.kernel.linear_cross_entropy (Triton, CUDA only)",
    "verl_torch": "verl 0.9.1 FusedLinearForPPO (torch, 512-token chunks)",
}


def backend(competitor: str):
    if competitor == "ours":
        from dgpo_ops.integrations.verl import linear_cross_entropy

        return lambda h, w, labels, temperature: linear_cross_entropy(h, w, labels, temperature)
    if competitor == "verl_triton":
        if not torch.cuda.is_available():
            raise RuntimeError("verl's Triton kernel needs CUDA")
        from verl.utils.kernel.linear_cross_entropy import LinearCrossEntropy

        return lambda h, w, labels, temperature: LinearCrossEntropy.apply(h, w, labels, temperature, "none", None)
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    module = FusedLinearForPPO()
    return lambda h, w, labels, temperature: module(h, w, labels, temperature)


def make_inputs(N, H, V, setting, device):
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if setting == "bf16" else torch.float32
    hidden = (torch.randn(N, H, generator=g, device=device) / H**0.5).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g, device=device) * 0.5).to(dtype).requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=g, device=device)
    coefficients = torch.randn(2, N, generator=g, device=device)
    return hidden, weight, labels, coefficients


def step_fn(competitor, inputs, setting):
    hidden, weight, labels, coefficients = inputs
    fn = backend(competitor)

    def step():
        hidden.grad = weight.grad = None
        with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=setting == "autocast"):
            logp, entropy = fn(hidden, weight, labels, 1.0)
        loss = (logp.float().reshape(-1) * coefficients[0] + entropy.float().reshape(-1) * coefficients[1]).sum()
        loss.backward()
        return loss.detach()

    return step


def measure(competitor, size, setting, repeats, device):
    inputs = make_inputs(*size, setting, device)
    timings, loss = time_step(step_fn(competitor, inputs, setting), repeats, device)  # step clears the grads
    return {**timings, "loss": float(loss), "weight_grad_norm": float(inputs[1].grad.float().norm())}


def write_markdown(doc, path: Path):
    m = doc["machine"]
    where = m.get("device_name") or f"CPU ({m['cpu_count']} cores)"
    competitors = doc["competitors"]
    lines = [f"{where}, torch {m['torch']}, triton {m['triton']}, verl {m.get('verl')}; dgpo_ops "
             f"{m.get('dgpo_ops_commit')}{' + local changes' if m.get('dgpo_ops_worktree_dirty') else ''}; "
             f"`{doc['command']}`. Forward + backward of per-token log-probs and entropies from hidden states and "
             f"the lm_head weight; time: median of {doc['repeats']} calls; extra peak memory of one call.", "",
             "| N | H | V | setting | " + " | ".join(f"{c} (ms)" for c in competitors) + " | "
             + " | ".join(f"{c} peak (GB)" for c in competitors) + " | largest loss difference to ours |",
             "|" + "---|" * (5 + 2 * len(competitors))]
    for row in doc["rows"]:
        results = row["results"]
        cells = [str(row["N"]), str(row["H"]), str(row["V"]), row["setting"]]
        cells += [f"{results[c]['seconds_median'] * 1e3:.1f}" if "seconds_median" in results[c] else "-"
                  for c in competitors]
        cells += [f"{results[c]['extra_peak_bytes'] / 1e9:.2f}" if results[c].get("extra_peak_bytes") is not None
                  else "-" for c in competitors]
        ours = results["ours"].get("loss")
        diffs = [abs(r["loss"] - ours) for c, r in results.items() if c != "ours" and "loss" in r and ours is not None]
        cells.append(f"{max(diffs):.1e}" if diffs else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"* {c} at {r['N']}x{r['H']}x{r['V']} {r['setting']}: {res['error']}" for r in doc["rows"]
              for c, res in r["results"].items() if "error" in res]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", help="NxHxV (default: N = 8192, V = 151,936 on a GPU; one CPU size)")
    parser.add_argument("--settings", nargs="+", choices=["bf16", "autocast", "fp32"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    from dgpo_ops.trainer.app.environment import describe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = [tuple(int(x) for x in s.split("x")) for s in (args.sizes or (GPU_SIZES if device == "cuda" else CPU_SIZES))]
    settings = args.settings or (["bf16", "autocast"] if device == "cuda" else ["fp32"])
    rows = []
    for size in sizes:
        for setting in settings:
            row = {"N": size[0], "H": size[1], "V": size[2], "setting": setting, "results": {}}
            for competitor in COMPETITORS:
                print(f"[{'x'.join(map(str, size))} {setting}] {competitor} ...", flush=True)
                try:
                    result = measure(competitor, size, setting, args.repeats, device)
                except Exception as error:  # noqa: BLE001 - recorded, the others go on
                    result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                if device == "cuda":
                    torch.cuda.empty_cache()
                row["results"][competitor] = result
                print(f"    {json.dumps(result)}", flush=True)
            rows.append(row)
    tag = "cpu" if device == "cpu" else "cuda-" + "".join(
        ch if ch.isalnum() else "-" for ch in torch.cuda.get_device_name().lower()).strip("-")
    doc = {"machine": describe(torch.device(device), packages=("verl",)), "command": "python bench/verl_fused.py "
           + " ".join(argv if argv is not None else sys.argv[1:]), "repeats": args.repeats,
           "competitors": COMPETITORS, "rows": rows}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"verl_fused-{tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_markdown(doc, out / f"verl_fused-{tag}.md")
    print(f"wrote {out / f'verl_fused-{tag}.json'}")


if __name__ == "__main__":
    main()
