"""Regenerate everything the benchmark shows from ``bench/results/*.json``:

    python -m bench.report [--no-traffic]

* the tables between ``<!-- bench:start -->`` and ``<!-- bench:end -->`` in docs/benchmarks.md (the README links it),
* ``bench/plots/time_vs_V.png`` and ``bench/plots/memory_vs_V.png`` (one row of panels per results file),
* ``bench/plots/psi_atlas.png`` (``dgpo_ops.trainer.app.atlas.plot_atlas``),
* ``bench/results/traffic.md`` (``python -m bench.traffic`` in a subprocess without TRITON_INTERPRET).

Only complete runs are used (``<device>-partial.json`` files are ignored), and every ratio compares
two competitors of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import COMPETITORS, PLOTS_DIR, REPO, RESULTS_DIR

PAGE = REPO / "docs" / "benchmarks.md"  # the generated tables live here; their links are relative to it
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
COLORS = {"eager": "tab:red", "ours": "tab:blue", "compile": "tab:orange", "liger": "tab:green",
          "trl": "tab:purple"}
MARKERS = {"dgpo": ("o", "-"), "grpo": ("x", "--")}


# --------------------------------------------------------------------------------------------
# Loading and ratios
# --------------------------------------------------------------------------------------------


def load_runs(results_dir: Path = RESULTS_DIR) -> list[tuple[Path, dict]]:
    runs = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict) and "records" in doc and doc.get("run", {}).get("complete"):
            runs.append((path, doc))
    # One block per machine, the newest run of each machine first (older runs stay as the record of
    # where the code started).
    runs.sort(key=lambda run: run[1]["run"].get("started_utc", ""), reverse=True)
    runs.sort(key=lambda run: run[1]["machine"].get("device_name") or run[1]["machine"].get("device", ""))
    return runs


def _ok(records, competitor, method, n, v):
    for r in records:
        if (r["competitor"], r["method"], r["N"], r["V"]) == (competitor, method, n, v) and r["status"] == "ok":
            return r
    return None


TIME_STAT = "min"  # best of the rounds: the estimate least disturbed by other work on the machine


def _time(rec, stat: str = TIME_STAT):
    return rec["time_s"][stat] if rec and rec.get("time_s") else None


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _sizes(records):
    seen = []
    for r in records:
        key = (r["method"], r["N"], r["V"])
        if key not in seen:
            seen.append(key)
    return sorted(seen, key=lambda k: (k[0] != "dgpo", k[1], k[2]))


def ratios(records) -> list[dict]:
    """Per (method, N, V): each competitor's time and peak memory over the eager path's."""
    rows = []
    for method, n, v in _sizes(records):
        eager = _ok(records, "eager", method, n, v)
        row = {"method": method, "N": n, "V": v, "eager": eager, "by": {}}
        for competitor in COMPETITORS:
            rec = _ok(records, competitor, method, n, v)
            if rec is None:
                continue
            row["by"][competitor] = {
                "time": _ratio(_time(rec), _time(eager)),
                "time_median": _ratio(_time(rec, "median"), _time(eager, "median")),
                "memory": _ratio(rec.get("peak_bytes"), eager.get("peak_bytes") if eager else None),
                "memory_x_logits": _ratio(rec.get("peak_bytes"), rec.get("logits_bytes")),
                "seconds": _time(rec),
            }
        rows.append(row)
    return rows


def _x(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def ratio_rows(records) -> list[str]:
    """Plain-text ratio table for the terminal summary."""
    lines = [f"{'method':<6} {'N':>5} {'V':>7}  " + "  ".join(f"{c + ' t/e':>12} {c + ' m/e':>12}"
                                                              for c in COMPETITORS if c != "eager")]
    for row in ratios(records):
        cells = []
        for c in COMPETITORS:
            if c == "eager":
                continue
            by = row["by"].get(c, {})
            cells.append(f"{_x(by.get('time')):>12} {_x(by.get('memory')):>12}")
        lines.append(f"{row['method']:<6} {row['N']:>5} {row['V']:>7}  " + "  ".join(cells))
    lines.append("(t/e: best-of-rounds time over eager's; m/e: peak memory over eager's; '-': not run)")
    return lines


# --------------------------------------------------------------------------------------------
# The section of docs/benchmarks.md
# --------------------------------------------------------------------------------------------


def _link(path: Path, page: Path = PAGE) -> str:
    """A markdown link target for ``path`` (absolute, in the repository) from ``page``."""
    return Path(os.path.relpath(path, page.parent)).as_posix()


def _machine_line(doc) -> str:
    m, run = doc["machine"], doc["run"]
    dev = m["device_name"] if m["device"] == "cuda" else f"CPU {m.get('cpu_model', '')}, {m['cpu_count']} cores"
    versions = f"torch {m['torch']}, triton {m['triton']}, trl {m['trl']}, liger-kernel {m['liger_kernel']}"
    load = run.get("load_average_1_5_15min") or {}
    load_text = ""
    if load.get("start") and load.get("end"):
        load_text = f", load average {load['start'][0]:g} at start / {load['end'][0]:g} at end"
    return (f"**{dev}** ({versions}; dgpo_ops {m.get('dgpo_ops_commit')}"
            f"{' + local changes' if m.get('dgpo_ops_worktree_dirty') else ''}; {run['started_utc']}, "
            f"`{run['command']}`, {run['wall_s']:.0f} s{load_text})")


def _load_note(doc) -> list[str]:
    load = doc["run"].get("load_average_1_5_15min") or {}
    cores = doc["machine"].get("cpu_count") or 1
    peak = max((load.get("start") or [0])[0], (load.get("end") or [0])[0])
    if doc["machine"]["device"] != "cpu" or peak <= 1.25 * cores:
        return []
    return [(f"* The machine was shared during this run (1-minute load average up to {peak:g} on {cores} cores). "
            "Other work slows every competitor, the chunked torch path (many short parallel ops) more than "
            "the eager one, so the CPU time ratios are noisy (the JSON has every round); the memory ratios "
            "do not depend on it.")]


def run_table(doc) -> list[str]:
    records = doc["records"]
    rows = ratios(records)
    present = [c for c in COMPETITORS if c != "eager" and any(c in r["by"] for r in rows)]
    head = ["method", "N", "V"]
    for c in present:
        head += [f"{c}: time", f"{c}: peak mem"]
    head += ["eager peak (x logits)"] + [f"{c} peak (x logits)" for c in present]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], str(r["N"]), str(r["V"])]
        for c in present:
            by = r["by"].get(c, {})
            cells += [_x(by.get("time")), _x(by.get("memory"))]
        eager = r["by"].get("eager", {})
        cells += [_x(eager.get("memory_x_logits"), 1)]
        cells += [_x(r["by"].get(c, {}).get("memory_x_logits"), 1) for c in present]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def absolute_table(doc) -> list[str]:
    """Best-of-rounds time in milliseconds of every competitor (GPU runs: the targets are absolute)."""
    records = doc["records"]
    present = [c for c in COMPETITORS if any(r["competitor"] == c and r["status"] == "ok" for r in records)]
    lines = ["| method | N | V | " + " | ".join(f"{c} (ms)" for c in present) + " |",
             "|" + "---|" * (3 + len(present))]
    for method, n, v in _sizes(records):
        cells = [method, str(n), str(v)]
        for c in present:
            t = _time(_ok(records, c, method, n, v))
            cells.append("-" if t is None else f"{t * 1e3:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def script_tables_section(title: str, script: str, results_dir: Path = RESULTS_DIR) -> list[str]:
    """The tables ``python bench/<script>.py`` wrote (``<script>-<device>.md``), one per device."""
    out = []
    for path in sorted(results_dir.glob(f"{script}-*.md")):
        out += [f"**{title}** ([`{path.relative_to(REPO)}`]({_link(path)}), "
                f"from `python bench/{script}.py`):", "", *path.read_text().strip().splitlines(), ""]
    return out


def _skips(doc) -> list[str]:
    """One line per (competitor, reason)."""
    lines = []
    for competitor, entry in doc.get("skipped", {}).items():
        for reason, where in entry["reasons"].items():
            methods = sorted({w.split()[0] for w in where})
            lines.append(f"* `{competitor}` ({entry['label']}) skipped in {len(where)} case(s) "
                         f"({'/'.join(methods)}): {reason}.")
    dropped = {}
    for d in doc["grid"].get("dropped", []):
        dropped.setdefault(d["reason"], []).append(f"{d['method']} {d['N']}x{d['V']}")
    for reason, where in dropped.items():
        lines.append(f"* Not run on this device ({', '.join(where)}): {reason}.")
    return lines


def _default_malloc_note(doc) -> list[str]:
    xs = [r["memory"]["default_malloc_peak_bytes"] / r["logits_bytes"] for r in doc["records"]
          if r["competitor"] == "ours" and r["status"] == "ok"
          and isinstance(r.get("memory", {}).get("default_malloc_peak_bytes"), (int, float))]
    if not xs:
        return []
    sizes = sorted({(r["N"], r["V"]) for r in doc["records"] if r["competitor"] == "ours"
                    and isinstance(r.get("memory", {}).get("default_malloc_peak_bytes"), (int, float))})
    where = ", ".join(f"{n}x{v}" for n, v in sizes)
    return [(f"* CPU peak memory is measured with glibc's mmap threshold pinned at 64 KiB, so the RSS follows "
             f"the live tensors. With glibc's default (dynamic) threshold `ours` peaks at {min(xs):.1f} to "
             f"{max(xs):.1f} x logits instead (measured at N x V = {where}): its freed 16 MiB chunk buffers "
             "stay in the heap (the eager path's buffers are larger than any threshold and are unaffected).")]


def bench_section(runs, traffic: dict | None) -> str:
    out = [START, "", "## Generated tables", "",
           ("_Generated by `python -m bench.report` from `bench/results/*.json` (do not edit by hand). "
           "Run the suite with `pytest bench/ --benchmark-only` from the repository root; it writes the "
           "results and regenerates this section, the plots and `bench/results/traffic.md`. Method and "
           "caveats: `bench/README.md`._"), ""]
    if not runs:
        out += ["No complete benchmark run recorded yet.", ""]
    for path, doc in runs:
        parity = [r for r in doc["records"] if r["status"] == "ok" and r.get("parity", {}).get("ok") is not None]
        parity_ok = all(r["parity"]["ok"] for r in parity)
        out += [
            _machine_line(doc) + f", [`{path.relative_to(REPO)}`]({_link(path)}).",
            "",
            "Forward + backward of the token-mean policy loss from bf16 logits `(N/1024, 1024, V)`. Each "
            "cell is a ratio to the TRL-style eager path (`log_softmax`/`gather` on fp32 logits + the method "
            "in torch + autograd) measured in the same run: time is the best of "
            f"{doc['run']['rounds']} rounds (medians are in the JSON), peak memory is the extra memory of one "
            "forward+backward "
            "(gradient included) "
            + ("(peak RSS of a fresh process over its RSS before the call)" if doc["machine"]["device"] == "cpu"
               else "(`torch.cuda.max_memory_allocated`)")
            + ". Below 1 is faster / leaner than eager. `x logits`: the same peak in multiples of the bf16 "
            "logits' size (N * V * 2 bytes; the gradient alone is 1.0)."
            + (" On CPU `ours` is the chunked torch path (`backend='auto'` picks it for CPU tensors)."
               if doc["machine"]["device"] == "cpu" else ""),
            "",
            *run_table(doc),
            "",
            *((["Absolute times (best of the rounds, ms, CUDA-synchronised wall time of one forward + backward as "
                "a user calls it):", "", *absolute_table(doc), ""]) if doc["machine"]["device"] == "cuda" else []),
            (f"Every competitor's loss and a sample of gradient rows match the eager path's "
            f"({'all ' + str(len(parity)) + ' checks pass' if parity_ok else 'SOME CHECKS FAIL: see the JSON'})."),
            "",
            *_skips(doc),
            *_default_malloc_note(doc),
            *_load_note(doc),
            "",
        ]
    out += script_tables_section("Fused linear + loss", "fused_linear")
    out += script_tables_section("Vocabulary split across processes", "vocab_parallel")
    out += script_tables_section("verl's fused log-prob backends", "verl_fused")
    out += script_tables_section("One policy update of a model, DGPOTrainer against GRPOTrainer", "train_step")
    out += [line for path in sorted(PLOTS_DIR.glob("train_step-*.png"))
            for line in (f"![policy update, {path.stem[len('train_step-'):]}]({_link(path)})", "")]
    if traffic:
        out += [
            ("**Traffic model** (no GPU needed; [`bench/results/traffic.md`]"
             f"({_link(RESULTS_DIR / 'traffic.md')})): the bf16 "
            f"kernels move {traffic['passes']:g} passes of `V * 2` bytes per token plus "
            f"{traffic['side_bytes_per_token']} B of per-token scalars, on the 3-pass floor; the load/store "
            f"count of the sm_90 SASS {'agrees' if traffic.get('sass_agrees') else 'DISAGREES'} with the "
            "derivation. The implied times at H100 / H200 bandwidth are bounds, not measurements."),
            "",
        ]
    out += [
        f"![psi(r) atlas]({_link(PLOTS_DIR / 'psi_atlas.png')})",
        "",
        f"![time vs V]({_link(PLOTS_DIR / 'time_vs_V.png')})",
        "",
        f"![peak memory vs V]({_link(PLOTS_DIR / 'memory_vs_V.png')})",
        "",
        END,
    ]
    return "\n".join(out)


def current_section(page: Path = PAGE) -> str:
    """The page's generated section as it is now, markers included."""
    text = page.read_text()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"{page}: expected one '{START}' line followed by one '{END}' line")
    return text[text.index(START):text.index(END) + len(END)]


def update_page(section: str, page: Path = PAGE) -> None:
    text = page.read_text()
    page.write_text(text.replace(current_section(page), section, 1))


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _plot(runs, path: Path, quantity: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for _, doc in runs:
        ns = sorted({r["N"] for r in doc["records"] if r["status"] == "ok"})
        panels += [(doc, n) for n in ns]
    if not panels:
        return
    cols = max(1, max(sum(1 for d, _ in panels if d is doc) for _, doc in runs))
    fig, axes = plt.subplots(len(runs), cols, figsize=(6.2 * cols, 4.6 * len(runs)), squeeze=False)
    for row, (_, doc) in enumerate(runs):
        m = doc["machine"]
        dev = m["device_name"] if m["device"] == "cuda" else f"CPU, {m['torch_threads']} threads"
        dev += f" @ {m.get('dgpo_ops_commit')}"  # one row per run: several runs of one device differ by commit
        ns = sorted({r["N"] for r in doc["records"] if r["status"] == "ok"})
        for col in range(cols):
            ax = axes[row][col]
            if col >= len(ns):
                ax.axis("off")
                continue
            n = ns[col]
            for competitor in COMPETITORS:
                for method, (marker, style) in MARKERS.items():
                    recs = sorted((r for r in doc["records"] if r["status"] == "ok" and r["N"] == n
                                   and r["competitor"] == competitor and r["method"] == method),
                                  key=lambda r: r["V"])
                    if quantity == "time":  # best of the rounds, with a bar up to the slowest
                        pts = [(r["V"], r["time_s"][TIME_STAT]) for r in recs if r.get("time_s")]
                        spread = [r["time_s"]["max"] - r["time_s"][TIME_STAT] for r in recs if r.get("time_s")]
                    else:
                        pts = [(r["V"], r["peak_bytes"] / 2**30) for r in recs if r.get("peak_bytes") is not None]
                        spread = None
                    if pts:
                        ax.errorbar(*zip(*pts), yerr=None if spread is None else [[0] * len(spread), spread],
                                    marker=marker, ls=style, color=COLORS[competitor], capsize=3,
                                    label=f"{competitor} ({method})")
            if quantity == "memory":
                vs = sorted({r["V"] for r in doc["records"] if r["N"] == n})
                ax.plot(vs, [n * v * 2 / 2**30 for v in vs], ls=":", color="grey",
                        label="gradient alone (N*V*2 B)")
            ax.set(xlabel="vocabulary V", title=f"{dev}: N = {n} tokens",
                   ylabel="forward+backward time (s): best round, bar to slowest" if quantity == "time"
                   else "peak extra memory (GiB)")
            ax.set_xticks(sorted({r["V"] for r in doc["records"] if r["N"] == n}))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    title = ("Time" if quantity == "time" else "Peak extra memory") + " of forward+backward vs V"
    fig.suptitle(title + " (bf16 logits; bench/results)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Traffic and atlas
# --------------------------------------------------------------------------------------------


SUMMARY_TAG = "<!-- traffic-summary "


def traffic_summary_from_file(path: Path = RESULTS_DIR / "traffic.md") -> dict | None:
    """The JSON summary that bench.traffic leaves at the end of traffic.md (no recompilation)."""
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith(SUMMARY_TAG):
            return json.loads(line[len(SUMMARY_TAG):].rsplit("-->", 1)[0])
    return None


def traffic(out: Path = RESULTS_DIR / "traffic.md") -> dict | None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "bench.traffic", "--out", str(out)], cwd=REPO, env=env,
                          check=False, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        print(f"bench.report: traffic model failed ({proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
        return None
    summary = json.loads(lines[-1])
    if proc.returncode != 0:
        print("bench.report: the SASS count disagrees with the traffic derivation: see traffic.md", file=sys.stderr)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    parser.add_argument("--no-traffic", action="store_true", help="skip the SASS traffic model (keeps traffic.md)")
    args = parser.parse_args(argv)
    PLOTS_DIR.mkdir(parents=True, exist_ok=True)
    from dgpo_ops.trainer.app.atlas import plot_atlas

    plot_atlas(str(PLOTS_DIR / "psi_atlas.png"))
    runs = load_runs()
    _plot(runs, PLOTS_DIR / "time_vs_V.png", "time")
    _plot(runs, PLOTS_DIR / "memory_vs_V.png", "memory")
    summary = traffic_summary_from_file() if args.no_traffic else traffic()
    update_page(bench_section(runs, summary))
    written = [f"{PAGE.relative_to(REPO)} (bench section)", "bench/plots/psi_atlas.png"]
    if runs:
        written += ["bench/plots/time_vs_V.png", "bench/plots/memory_vs_V.png"]
    if summary and not args.no_traffic:
        written.append("bench/results/traffic.md")
    print(f"bench.report: {len(runs)} complete run(s); wrote {', '.join(written)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
