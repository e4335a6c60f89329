"""Outputs of ``dgpo-ops train`` runs (one or several methods, one or several seeds): ``run.json``, the
summary table and the figure."""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import sys
import time

from dgpo_ops.trainer.app.environment import code_commit
from dgpo_ops.trainer.app.styles import style

REGION_KEYS = {"ln": "clip_ratio/low_mean", "hp": "clip_ratio/high_mean", "lp": "clip_ratio/lp_mean",
               "hn": "clip_ratio/hn_mean"}
OUTSIDE = "outside_trust_region"  # ln + hp + lp + hn: every token whose ratio left [1 - eps_low, 1 + eps_high]

# (log key, panel title); the training curves are smoothed over SMOOTH logged steps.
TRAIN_PANELS = (
    ("rewards/accuracy_reward/mean", "train accuracy reward (sampled)"),
    ("entropy", "entropy (nats/token)"),
    ("eur", "EUR (effective update ratio)"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("ratio_mean", "mean importance ratio"),
    (OUTSIDE, "tokens outside the trust region (ln+hp+lp+hn)"),
    (REGION_KEYS["ln"], "region ln (A<0, r below: clipped by grpo)"),
    (REGION_KEYS["hp"], "region hp (A>0, r above: clipped by grpo)"),
    (REGION_KEYS["lp"], "region lp (A>0, r below)"),
    (REGION_KEYS["hn"], "region hn (A<0, r above)"),
    ("completions/mean_length", "completion length (tokens, sampled)"),
)
SMOOTH = 5
# Drawn on a log axis where their curves span a decade or more: a diverging method (EUR in the thousands) must
# not flatten the others. Within a decade a log axis only relabels a linear one, with ticks like 9.995x10^-1.
LOG_SCALE = {"eur", "grad_norm"}
# Final numbers: the mean of the last FINAL_WINDOW logged steps of each run.
FINAL_WINDOW = 5


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def summarize(runs: list[dict]) -> dict:
    """Per method: before/after held-out accuracy per seed and their means."""
    out: dict[str, dict] = {}
    for run in runs:
        entry = out.setdefault(run["method"], {"seeds": []})
        before = (run.get("before") or {}).get("accuracy")
        after = (run.get("after") or {}).get("accuracy")
        entry["seeds"].append({"seed": run["seed"], "before": before, "after": after,
                               "delta": None if before is None or after is None else after - before,
                               "rl_time_s": run.get("rl_time_s"), "sft_time_s": run.get("sft_time_s"),
                               "run_time_s": run.get("run_time_s")})
    for entry in out.values():
        for key in ("before", "after", "delta", "rl_time_s"):
            entry[f"{key}_mean"] = _mean([s[key] for s in entry["seeds"]])
        deltas = [s["delta"] for s in entry["seeds"] if s["delta"] is not None]
        entry["seeds_improved"] = sum(d > 0 for d in deltas)
    return out


def _value(entry: dict, key: str):
    if key == OUTSIDE:
        parts = [entry.get(k) for k in REGION_KEYS.values()]
        return None if any(p is None for p in parts) else sum(float(p) for p in parts)
    return entry.get(key)


def _series(run: dict, key: str) -> dict[int, float]:
    out = {}
    for e in run.get("log_history", []):
        value = _value(e, key)
        if value is not None and math.isfinite(float(value)):
            out[int(e["step"])] = float(value)
    return out


def pass_keys(runs: list[dict]) -> list[str]:
    """The pass@k keys the runs' evaluations hold (``--eval-pass-k``), pass@1 first."""
    return sorted({key for r in runs for e in r.get("eval_curve", ()) for key in e if key.startswith("pass@")},
                  key=lambda key: int(key[5:]))


def final_numbers(result: dict) -> list[dict]:
    """Per method: held-out accuracy after RL and the training metrics over the last steps, as
    mean, min and max over seeds."""
    rows = []
    keys = {"entropy": "entropy", "outside": OUTSIDE, "ln": REGION_KEYS["ln"], "hp": REGION_KEYS["hp"],
            "eur": "eur", "grad_norm": "grad_norm"}
    for method, summary in result["summary"].items():
        runs = [r for r in result["runs"] if r["method"] == method]
        row = {"method": method, "seeds": len(runs)}
        accuracies = [s["after"] for s in summary["seeds"] if s["after"] is not None]
        row["after"] = (_mean(accuracies), min(accuracies, default=None), max(accuracies, default=None))
        row["before"] = summary["before_mean"]
        for key in pass_keys(result["runs"]):  # sampled held-out pass@k after RL, where a run measured it
            values = [r["after"][key] for r in runs if (r.get("after") or {}).get(key) is not None]
            row[key] = (_mean(values), min(values, default=None), max(values, default=None))
        for name, key in keys.items():
            finals = []
            for r in runs:
                series = _series(r, key)
                last = [series[s] for s in sorted(series)[-FINAL_WINDOW:]]
                if last:
                    finals.append(sum(last) / len(last))
            row[name] = (_mean(finals), min(finals, default=None), max(finals, default=None))
        rows.append(row)
    return rows


def final_table(result: dict) -> str:
    """The final numbers as a markdown table (mean over seeds, min-max in brackets)."""
    def cell(triple, digits=3):
        mean, low, high = triple
        if mean is None:
            return "-"
        return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]" if high != low else f"{mean:.{digits}f}"

    keys = pass_keys(result["runs"])
    lines = ["| method | held-out before -> after | " + "".join(f"{key} after | " for key in keys)
             + "entropy | outside trust region | ln | hp | EUR | grad norm |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(keys)]
    for row in final_numbers(result):
        before = "-" if row["before"] is None else f"{row['before']:.3f}"
        lines.append(f"| {row['method']} | {before} -> {cell(row['after'])} | "
                     + "".join(f"{cell(row[key])} | " for key in keys)
                     + f"{cell(row['entropy'])} | {cell(row['outside'])} | {cell(row['ln'])} | {cell(row['hp'])} | "
                     f"{cell(row['eur'])} | {cell(row['grad_norm'], 2)} |")
    return "\n".join(lines)


def _smooth(points: dict[int, float], window: int) -> dict[int, float]:
    steps = sorted(points)
    return {s: sum(points[t] for t in steps[max(0, i - window + 1): i + 1]) / len(steps[max(0, i - window + 1): i + 1])
            for i, s in enumerate(steps)}


def _band(per_seed: list[dict[int, float]]):
    steps = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
    mean = [sum(p[s] for p in per_seed) / len(per_seed) for s in steps]
    low = [min(p[s] for p in per_seed) for s in steps]
    high = [max(p[s] for p in per_seed) for s in steps]
    return steps, mean, low, high


def spans_a_decade(values) -> bool:
    """Whether a log axis helps: every value positive and the largest at least 10 times the smallest."""
    values = [float(v) for v in values]
    return bool(values) and min(values) > 0 and max(values) >= 10 * min(values)


def use_log_axis(ax) -> None:
    """A log y axis labelled in plain numbers (0.1, 1, 10, 100), its minor ticks unlabelled."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_runs(result: dict, path) -> pathlib.Path:
    """Held-out accuracy, the training curves (mean over seeds, min-max band), per-seed before ->
    after, and the final numbers; one colour and dash per method (``dgpo_ops.trainer.app.styles``)."""
    import matplotlib
    import numpy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    n_seeds = len({r["seed"] for r in runs})
    fig, axes = plt.subplots(4, 4, figsize=(22, 19))
    spread = "min-max over seeds" if n_seeds > 1 else "one seed"
    panels = iter(axes.flat)

    def draw(ax, per_seed, method, marker=None, label=None, **line):
        per_seed = [p for p in per_seed if p]
        if not per_seed:
            return
        steps, mean, low, high = _band(per_seed)
        ax.plot(steps, mean, marker=marker, ms=3, lw=1.6, label=label or method, **{**style(method), **line})
        if n_seeds > 1:
            ax.fill_between(steps, low, high, color=style(method)["color"], alpha=0.12)

    for key, title in (("accuracy", f"held-out accuracy (greedy, n={_eval_n(runs)})"),
                       ("length", "held-out completion length (tokens, greedy)")):
        ax = next(panels)
        for method in methods:
            draw(ax, [{e["step"]: e[key] for e in r["eval_curve"] if key in e} for r in runs if r["method"] == method],
                 method, marker="o")
        ax.set_title(title)
        ax.set_xlabel("RL step")
    axes.flat[0].set_ylim(-0.02, 1.02)

    measured = pass_keys(runs)
    if measured:  # pass@k, where the run measured it (--eval-pass-k): solid pass@K, dotted pass@1
        ax = next(panels)
        for key in measured:
            for method in methods:
                draw(ax, [{e["step"]: e[key] for e in r["eval_curve"] if key in e} for r in runs
                          if r["method"] == method],
                     method, marker="o", label=f"{method} {key}", **({"linestyle": ":"} if key == "pass@1" else {}))
        ax.set_title("held-out pass@k (sampled, temperature 1)")
        ax.set_xlabel("RL step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)

    for key, title in TRAIN_PANELS:
        ax = next(panels)
        for method in methods:
            draw(ax, [_smooth(_series(r, key), SMOOTH) for r in runs if r["method"] == method], method)
        # a log scale needs positive values (a short run's grad_norm may be all zero: matplotlib would warn)
        log = key in LOG_SCALE and spans_a_decade(numpy.concatenate([line.get_ydata() for line in ax.lines] or [[]]))
        ax.set_title(f"{title}, {SMOOTH}-step mean" + (" (log scale)" if log else ""), fontsize=10)
        ax.set_xlabel("RL step")
        if log:
            use_log_axis(ax)

    ax = next(panels)
    summary = result["summary"]
    for i, method in enumerate(methods):
        for s in summary[method]["seeds"]:
            if s["before"] is None or s["after"] is None:
                continue
            ax.plot([i - 0.15, i + 0.15], [s["before"], s["after"]], marker="o", alpha=0.8, **style(method))
        if summary[method]["before_mean"] is not None:
            ax.plot([i - 0.15, i + 0.15], [summary[method]["before_mean"], summary[method]["after_mean"]],
                    color="black", lw=2.5, marker="s", label="mean" if i == 0 else None)
    ax.set_xticks(range(len(methods)), methods, rotation=30)
    ax.set_xlim(-0.6, len(methods) - 0.4)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("held-out accuracy per seed: before -> after RL")

    ax = next(panels)
    ax.axis("off")
    rows = final_numbers(result)
    cells = [[r["method"], _fmt3(r["after"][0]), *(_fmt3(r[key][0]) for key in measured), _fmt3(r["entropy"][0]),
              _fmt3(r["outside"][0]), _fmt3(r["eur"][0]),
              "-" if r["grad_norm"][0] is None else f"{r['grad_norm'][0]:.2f}"] for r in rows]
    if cells:
        table = ax.table(cellText=cells, colLabels=["method", "after", *measured, "entropy", "outside", "EUR", "|g|"],
                         loc="center", cellLoc="center")
        table.scale(1, 1.4)
        for i, r in enumerate(rows):
            table[i + 1, 0].get_text().set_color(style(r["method"])["color"])
    ax.set_title(f"final numbers (mean over seeds; training metrics: last {FINAL_WINDOW} steps)", fontsize=10)
    for ax in panels:
        ax.axis("off")

    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(methods), fontsize=12, frameon=False,
               bbox_to_anchor=(0.5, 0.975))
    fig.suptitle(f"dgpo-ops train: {result['model']} | {result['task']} | {n_seeds} seed(s), {spread}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.955))
    path = pathlib.Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _fmt3(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _eval_n(runs) -> str:
    for r in runs:
        if r.get("before"):
            return str(r["before"]["n"])
    return "?"


# Arguments that may differ between runs merged into one result: which seeds ran, and where and how they logged
# and kept their policies.
MERGE_FREE_ARGUMENTS = {"seed", "seeds", "output_dir", "no_progress", "save_model"}


def merge_results(results: list[dict]) -> dict:
    """One result from runs of the same command on disjoint seeds (e.g. seeds run on several machines, or in
    several sittings): the runs and warm starts of all, in seed order, the summary recomputed. Raises
    ``ValueError`` when the commands differ in anything but the seeds, or when a seed is in two of them."""
    first = results[0]
    for other in results[1:]:
        for key in ("methods", "task", "model"):
            if other[key] != first[key]:
                raise ValueError(f"cannot merge runs with different {key}: {first[key]!r} and {other[key]!r}")
        differing = sorted(k for k in set(first["arguments"]) | set(other["arguments"])
                           if k not in MERGE_FREE_ARGUMENTS and first["arguments"].get(k) != other["arguments"].get(k))
        if differing:
            raise ValueError(f"cannot merge runs whose arguments differ in {', '.join(differing)}")
    seeds = sorted(seed for r in results for seed in r["seeds"])
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"cannot merge: seeds {sorted(s for s in set(seeds) if seeds.count(s) > 1)} are in more "
                         "than one run")
    if seeds != list(range(seeds[0], seeds[0] + len(seeds))):  # what --seed S --seeds K would have run
        raise ValueError(f"cannot merge: seeds {seeds} are not one range --seed S --seeds K would run")
    order = {method: i for i, method in enumerate(first["methods"])}
    runs = sorted((run for r in results for run in r["runs"]), key=lambda run: (run["seed"], order[run["method"]]))
    same_environment = all(r.get("environment") == first.get("environment") for r in results)
    merged = {**first, "seeds": seeds, "runs": runs, "summary": summarize(runs),
              "warm_start": sorted((w for r in results for w in r["warm_start"]), key=lambda w: w["seed"]),
              "complete": all(r["complete"] for r in results),
              "wall_time_s": sum(r["wall_time_s"] for r in results),
              # each part's own command, commit and packages are in merged_from; the top level keeps only
              # what all parts share
              "command": None, "output_dir": None, "figure": None,
              "environment": first.get("environment") if same_environment else None,
              "merged_from": [{key: r.get(key) for key in ("command", "seeds", "environment", "output_dir",
                                                           "wall_time_s", "complete")} for r in results]}
    merged["arguments"] = {**first["arguments"], "seed": seeds[0], "seeds": len(seeds), "output_dir": None}
    return merged


def main(argv: list[str] | None = None) -> int:
    """``python -m dgpo_ops.trainer.app.report run.json [more.json ...] [--out curves.png] [--merged all.json]``:
    the figure and the final numbers of a committed run, from its JSON alone; several JSONs of the same
    command on other seeds are merged first."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m dgpo_ops.trainer.app.report", description=main.__doc__)
    parser.add_argument("run_json", nargs="+")
    parser.add_argument("--out", default=None, help="figure path (default: next to the (merged) JSON, .png)")
    parser.add_argument("--merged", default=None, help="write the merge of several JSONs here")
    args = parser.parse_args(argv)
    if len(args.run_json) > 1 and not (args.merged or args.out):
        parser.error("several run JSONs: name the merged JSON (--merged) or the figure (--out)")
    results = [json.loads(pathlib.Path(path).read_text()) for path in args.run_json]
    try:
        result = merge_results(results) if len(results) > 1 else results[0]
    except ValueError as e:
        parser.error(str(e))
    if args.merged:
        pathlib.Path(args.merged).write_text(json.dumps(result, indent=1, default=json_default, allow_nan=False))
    source = pathlib.Path(args.merged or args.run_json[0])
    out = pathlib.Path(args.out) if args.out else source.with_suffix(".png")
    print(final_table(result))
    print(f"figure: {plot_runs(result, out)}")
    return 0


def write_outputs(ctx, runs: list[dict], sft_records: list[dict], final: bool) -> dict:
    """``run.json`` (rewritten after every run, ``complete`` at the end) and, at the end, ``curves.png``;
    ``ctx`` is the invocation's ``run.RunContext``."""
    import torch
    import transformers
    import trl

    args, output_dir, tokenizer = ctx.args, ctx.output_dir, ctx.tokenizer

    result = {
        "command": "dgpo-ops train " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["train"] else sys.argv[1:]),
        "arguments": vars(args),
        "output_dir": str(output_dir.resolve()), "methods": ctx.methods, "seeds": ctx.seeds, "task": ctx.task,
        "model": ctx.model_desc,
        "tokenizer": {"kind": args.tokenizer if args.model is None else args.model, "size": len(tokenizer)},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "trl": trl.__version__,
                        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                        "git_commit": code_commit(short=False)[0]},
        "setup_time_s": ctx.setup_s, "wall_time_s": time.perf_counter() - ctx.started, "complete": final,
        "summary": summarize(runs), "warm_start": sft_records, "runs": runs,
    }
    if os.environ.get("RANK", "0") != "0":
        return result
    (output_dir / "run.json").write_text(json.dumps(result, indent=1, default=json_default, allow_nan=False))
    if final:
        try:
            result["figure"] = str(plot_runs(result, output_dir / "curves.png"))
        except ImportError:
            result["figure"] = None
    return result


def json_default(value):
    if isinstance(value, pathlib.Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
