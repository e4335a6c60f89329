"""Curves of a long `dgpo-ops train --compare` run as tables: held-out greedy accuracy, pass@1 and pass@K at
chosen evaluation steps, and the training entropy and clipped fraction over windows of steps, each the mean
over seeds with the min-max in brackets.

    python docs/train/horizon_tables.py docs/train/long_horizon_4methods_3seeds.json [--window 20]

The entropy and the fractions are the mean of the logged steps in each window (TRL logs one value per
optimizer step); `outside` is the share of tokens whose ratio left [1 - eps_low, 1 + eps_high] (ln+hp+lp+hn),
`clipped` the share grpo's clip zeroes (ln+hp, TRL's clip_ratio/region_mean).
"""

from __future__ import annotations

import argparse
import json

from dgpo_ops.trainer.app.report import OUTSIDE, REGION_KEYS, pass_keys


def _cell(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1 or max(values) == min(values):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def _window_mean(run: dict, key, start: int, stop: int) -> float | None:
    values = []
    for entry in run["log_history"]:
        if start <= entry.get("step", -1) <= stop:
            if key == "clipped":
                parts = [entry.get(REGION_KEYS["ln"]), entry.get(REGION_KEYS["hp"])]
            elif key == OUTSIDE:
                parts = [entry.get(k) for k in REGION_KEYS.values()]
            else:
                parts = [entry.get(key)]
            if all(p is not None for p in parts):
                values.append(sum(float(p) for p in parts))
    return sum(values) / len(values) if values else None


def eval_table(result: dict, key: str, steps: list[int]) -> str:
    methods = result["methods"]
    lines = [f"| {key} at step | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for step in steps:
        cells = []
        for method in methods:
            values = [e[key] for r in result["runs"] if r["method"] == method for e in r["eval_curve"]
                      if e["step"] == step and e.get(key) is not None]
            cells.append(_cell(values))
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def window_table(result: dict, key, label: str, window: int, last_step: int, digits: int = 3) -> str:
    methods = result["methods"]
    lines = [f"| {label}, steps | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for start in range(1, last_step + 1, window):
        stop = min(start + window - 1, last_step)
        cells = []
        for method in methods:
            values = [v for r in result["runs"] if r["method"] == method
                      if (v := _window_mean(r, key, start, stop)) is not None]
            cells.append(_cell(values, digits))
        lines.append(f"| {start}-{stop} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_json")
    parser.add_argument("--window", type=int, default=50, help="steps per row of the training tables")
    parser.add_argument("--eval-steps", default=None, help="comma-separated evaluation steps (default: every 2nd)")
    args = parser.parse_args(argv)
    result = json.loads(open(args.run_json).read())
    steps = sorted({e["step"] for r in result["runs"] for e in r["eval_curve"]})
    eval_steps = [int(s) for s in args.eval_steps.split(",")] if args.eval_steps else steps[::2] + (
        [steps[-1]] if len(steps) % 2 == 0 else [])
    last_step = max(r["steps"] for r in result["runs"])
    print(f"{len(result['runs'])} runs, seeds {sorted({r['seed'] for r in result['runs']})}\n")
    for key in ["accuracy", *pass_keys(result["runs"])]:
        print(eval_table(result, key, eval_steps), end="\n\n")
    print(window_table(result, "entropy", "entropy", args.window, last_step), end="\n\n")
    print(window_table(result, "clipped", "clipped (ln+hp)", args.window, last_step, digits=4), end="\n\n")
    print(window_table(result, OUTSIDE, "outside (ln+hp+lp+hn)", args.window, last_step, digits=4))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
