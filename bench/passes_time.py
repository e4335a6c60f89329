"""Wall time and peak memory of one policy update for the cases of ``bench/passes.py``: what the passes
cost on ``bench/train_step.py``'s model.

    python bench/passes_time.py [--model cpu-small] [--methods ...] [--options ...] [--paths ...] [--repeats 1]

Each case runs in its own process (``bench/train_step.py``'s trainers, synthetic rollouts and update: the forward
with the loss, the backward, clipping, the AdamW step): one untimed update, then ``--repeats`` timed ones (median);
peak memory is the absolute peak over the timed updates (``VmHWM`` after ``clear_refs`` on the CPU,
``max_memory_allocated`` on CUDA). Adaptive entropy is put where it applies its bonus, as in the pass count.
On the CPU the default model is ``cpu-small`` (Qwen2.5's vocabulary, 2 small layers: 39 M of its 40 M parameters
are the embedding and lm_head, so the update is mostly the loss path and its time follows the passes), prompt 128,
completions up to 256. On a 2-core machine shared with other work the times move with the load; the ratios
between cases of one run are the useful part, and the cases run interleaved by path so that a change of load
does not fall on one path alone.

Writes ``bench/results/passes_time-<device>.json`` after every case and the table beside it (``.md``) at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.passes import ACTIVE_ADAPTIVE_ENTROPY, METHODS, OPTIONS, PATH_LABELS, PATHS, _choose, finish
from bench.train_step import SHAPES

RESULTS_DIR = REPO / "bench" / "results"


def child(path: str, method: str, option: str, model_name: str, repeats: int) -> dict:
    """One case in this process: one untimed update, ``repeats`` timed ones; printed as one JSON line."""
    import torch

    from bench.train_step import build_trainer, synthetic_rollouts, timed_updates, update

    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompt_length, lengths = SHAPES[model_name]
    completion_length = lengths[0]
    policy_loss, method_fields = METHODS[method]
    with tempfile.TemporaryDirectory() as workdir:
        trainer = build_trainer(path, model_name, completion_length, workdir, device, policy_loss=policy_loss,
                                fields={**method_fields, **OPTIONS[option]})
        if trainer.use_adaptive_entropy:
            trainer._last_world_entropy = ACTIVE_ADAPTIVE_ENTROPY
        inputs = synthetic_rollouts(prompt_length, completion_length, trainer.model.config.vocab_size, device)
        first = update(trainer, inputs, record=True)
        result = {"path": path, "method": method, "option": option, "prompt_length": prompt_length,
                  "completion_length": completion_length, **timed_updates(trainer, inputs, repeats, device),
                  "loss": first["loss"]}
    print(json.dumps(result), flush=True)
    return result


def run_case(path, method, option, model_name, repeats) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", path, method, option, "--model", model_name,
           "--repeats", str(repeats)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"path": path, "method": method, "option": option,
                "error": f"exited {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


def markdown(doc: dict) -> str:
    m = doc["machine"]
    rows = {(r["method"], r["option"], r["path"]): r for r in doc["rows"]}
    lines = [
        (f"{m.get('device_name') or 'CPU'} ({m['device']}, {m['cpu_count']} cores), torch {m['torch']}, trl "
         f"{m.get('trl')}; dgpo_ops {m.get('dgpo_ops_commit')}"
         f"{' + local changes' if m.get('dgpo_ops_worktree_dirty') else ''}; `{doc['command']}`. Model "
         f"{doc['model']}, prompt {doc['prompt_length']}, completion {doc['completion_length']}, 8 responses; one "
         f"update (forward and loss, backward, clip, AdamW step), median of {doc['repeats']} after one untimed; "
         "seconds / absolute peak memory (GB). Load average at the start and end: "
         f"{doc['load_average'][0]} / {doc['load_average'][1]}."),
        "",
        "| method | option | " + " | ".join(PATH_LABELS[p] for p in doc["paths"]) + " |",
        "|---|---|" + "---|" * len(doc["paths"]),
    ]

    def cell(case):
        row = rows.get(case)
        if row is None:
            return "-"
        if "error" in row:
            return "failed"
        return f"{row['seconds_median']:.2f} s / {row['peak_bytes'] / 1e9:.2f}"

    for method in doc["methods"]:
        for option in doc["options"]:
            lines.append(f"| {method} | {option} | "
                         + " | ".join(cell((method, option, p)) for p in doc["paths"]) + " |")
    errors = [f"* {r['method']} {r['option']} {r['path']}: {r['error']}" for r in doc["rows"] if "error" in r]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, choices=tuple(SHAPES))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", default=None)
    parser.add_argument("--child", nargs=3, metavar=("PATH", "METHOD", "OPTION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_name = args.model or ("qwen2.5-1.5b" if device == "cuda" else "cpu-small")
    if args.child:
        child(*args.child, model_name, args.repeats)
        return 0
    from dgpo_ops.trainer.app.environment import describe

    methods, options, paths = (_choose(args.methods, METHODS), _choose(args.options, OPTIONS),
                               _choose(args.paths, PATHS))
    prompt_length, lengths = SHAPES[model_name]
    doc = {"command": "python bench/passes_time.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": describe(torch.device(device), packages=("trl", "transformers")), "model": model_name,
           "prompt_length": prompt_length, "completion_length": lengths[0], "repeats": args.repeats,
           "methods": methods, "options": options, "paths": paths, "load_average": [_load(), None], "rows": [],
           "complete": False}
    tag = doc["machine"]["device_name"].lower().replace(" ", "-") if device == "cuda" else "cpu"
    out = Path(args.output) if args.output else RESULTS_DIR / f"passes_time-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cases = [(m, o, p) for m in methods for o in options for p in paths]
    for index, (method, option, path) in enumerate(cases, 1):
        started = time.perf_counter()
        row = run_case(path, method, option, model_name, args.repeats)
        row["wall_s"] = round(time.perf_counter() - started, 1)
        doc["rows"].append(row)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        shown = row.get("error") or f"{row['seconds_median']:.2f} s, peak {row['peak_bytes'] / 1e9:.2f} GB"
        print(f"[passes_time {index}/{len(cases)}] {method:<8} {option:<17} {path:<12} {shown}", flush=True)
    doc["load_average"][1] = _load()
    return finish(doc, out, markdown(doc))


if __name__ == "__main__":
    sys.exit(main())
