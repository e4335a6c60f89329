"""Summary table and figure of ``dgpo-ops train`` runs (one or several methods, one or several seeds)."""

from __future__ import annotations

import math
import pathlib

# (log key, panel title); the training curves are smoothed over SMOOTH logged steps.
TRAIN_PANELS = (
    ("rewards/accuracy_reward/mean", "train accuracy reward (sampled)"),
    ("entropy", "entropy (nats/token)"),
    ("clip_ratio/region_mean", "clipped-region fraction (ln + hp)"),
    ("eur", "EUR (effective update ratio)"),
    ("completions/mean_length", "completion length (tokens, sampled)"),
)
SMOOTH = 5


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


def _series(run: dict, key: str) -> dict[int, float]:
    return {int(e["step"]): float(e[key]) for e in run.get("log_history", [])
            if e.get(key) is not None and math.isfinite(float(e[key]))}


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


def plot_runs(result: dict, path) -> pathlib.Path:
    """Held-out accuracy, training curves (mean over seeds, min-max band) and per-seed before -> after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    colors = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    n_seeds = len({r["seed"] for r in runs})
    fig, axes = plt.subplots(2, 4, figsize=(19, 8.5))
    spread = "min-max over seeds" if n_seeds > 1 else "one seed"

    for ax, key, title in ((axes[0, 0], "accuracy", f"held-out accuracy (greedy, n={_eval_n(runs)})"),
                           (axes[1, 2], "length", "held-out completion length (tokens, greedy)")):
        for method in methods:
            curves = [{e["step"]: e[key] for e in r["eval_curve"] if key in e} for r in runs if r["method"] == method]
            steps, mean, low, high = _band([c for c in curves if c])
            if steps:
                ax.plot(steps, mean, marker="o", ms=3, color=colors[method], label=method)
                if n_seeds > 1:
                    ax.fill_between(steps, low, high, color=colors[method], alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.legend()
    axes[0, 0].set_ylim(-0.02, 1.02)

    for ax, (key, title) in zip([axes[0, 1], axes[0, 2], axes[0, 3], axes[1, 0], axes[1, 1]], TRAIN_PANELS):
        for method in methods:
            per_seed = [_smooth(_series(r, key), SMOOTH) for r in runs if r["method"] == method]
            per_seed = [p for p in per_seed if p]
            if not per_seed:
                continue
            steps, mean, low, high = _band(per_seed)
            ax.plot(steps, mean, color=colors[method], label=method)
            if n_seeds > 1:
                ax.fill_between(steps, low, high, color=colors[method], alpha=0.2)
        ax.set_title(f"{title}, {SMOOTH}-step mean")
        ax.set_xlabel("RL step")

    ax = axes[1, 3]
    summary = result["summary"]
    for i, method in enumerate(methods):
        for s in summary[method]["seeds"]:
            if s["before"] is None or s["after"] is None:
                continue
            x = [i - 0.15, i + 0.15]
            ax.plot(x, [s["before"], s["after"]], color=colors[method], marker="o", alpha=0.8)
            ax.annotate(f"s{s['seed']}", (x[1], s["after"]), textcoords="offset points", xytext=(4, -3), fontsize=7)
        if summary[method]["before_mean"] is not None:
            ax.plot([i - 0.15, i + 0.15], [summary[method]["before_mean"], summary[method]["after_mean"]],
                    color="black", lw=2.5, marker="s", label="mean" if i == 0 else None)
    ax.set_xticks(range(len(methods)), [f"{m}\nbefore -> after" for m in methods])
    ax.set_xlim(-0.6, len(methods) - 0.4)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("held-out accuracy per seed: before -> after RL")
    if methods:
        ax.legend(loc="lower right")

    fig.suptitle(f"dgpo-ops train: {result['model']} | {result['task']} | {', '.join(methods)} | "
                 f"{n_seeds} seed(s), {spread}", fontsize=10)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _eval_n(runs) -> str:
    for r in runs:
        if r.get("before"):
            return str(r["before"]["n"])
    return "?"
