"""Held-out answers of a `dgpo-ops train` run split by form: bare answers vs worked solutions.

    python docs/train/style_breakdown.py docs/train/dgpo_vs_grpo_3seeds.json

A bare answer (`" \\boxed{64}"` + eos) is 6-8 tokens of the default tokenizer, a worked solution 27-39, so
greedy completions of at most SHORT tokens count as bare. Reads the per-problem results in run.json.
"""

from __future__ import annotations

import json
import sys

SHORT = 12


def breakdown(result: dict) -> dict:
    """Counts and accuracy of short (bare) and long (worked) completions."""
    rows = list(zip(result["correct_each"], result["length_each"], strict=True))
    out = {}
    for form, keep in (("bare", lambda n: n <= SHORT), ("worked", lambda n: n > SHORT)):
        picked = [c for c, n in rows if keep(n)]
        out[form] = {"n": len(picked), "correct": sum(picked)}
    return out


def _cell(part: dict) -> str:
    return f"{part['n']} ({part['correct'] / part['n']:.0%} right)" if part["n"] else "0"


def main(path: str) -> None:
    record = json.loads(open(path).read())
    print("| method | seed | phase | accuracy | bare answers | worked answers |")
    print("|---|---|---|---|---|---|")
    for run in record["runs"]:
        for phase in ("before", "after"):
            forms = breakdown(run[phase])
            print(f"| {run['method']} | {run['seed']} | {phase} | {run[phase]['accuracy']:.3f} | "
                  f"{_cell(forms['bare'])} | {_cell(forms['worked'])} |")


if __name__ == "__main__":
    main(sys.argv[1])
