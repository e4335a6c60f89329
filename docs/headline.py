"""The GPU figures of docs/benchmarks.md's headline, written from the committed results files
(``docs/generate.py`` calls these; nothing here is typed by hand). Each table names its file, the card, the run of
the GPU run log and the commit measured.

Of each kind one results file is taken: the logits-op timing of the highest run
(``bench/experiments/results/gpu_check-<card>-<run>-timing.json``) and, of each benchmark's CUDA results files
(``bench/results/<benchmark>-cuda-<card>.json``), the one whose card's name sorts last (the H200's over the
H100's). A file's run is in its name, or else the run whose session log
(``bench/experiments/results/gpu_session-<card>-<run>.log``) names its commit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
EXPERIMENTS = REPO / "bench" / "experiments" / "results"
TIMING = re.compile(r"gpu_check-(?P<card>[a-z0-9]+)-(?P<run>\d+)(?P<part>[a-z]?)-timing\.json$")


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def run_of(commit: str | None, card: str) -> str:
    """The run of the GPU run log whose session log names ``commit`` (the earliest), or "?"."""
    if not commit:
        return "?"
    runs = []
    for log in EXPERIMENTS.glob(f"gpu_session-{card}-*.log"):
        if commit in log.read_text(errors="replace"):
            runs.append(log.stem.rsplit("-", 1)[1])
    return min(runs, key=lambda run: (int(re.match(r"\d+", run).group()), run)) if runs else "?"


def _card(machine: dict) -> str:
    """'h100' of 'NVIDIA H100 80GB HBM3': the short name the results files use."""
    match = re.search(r"\b([A-Z]\d{2,3})\b", machine.get("device_name", ""))
    return match.group(1).lower() if match else "?"


def _provenance(path: Path, machine: dict, run: str) -> str:
    return (f"[`{_relative(path)}`](../{_relative(path)}): {machine.get('device_name', '?')}, run {run}, "
            f"commit {machine.get('dgpo_ops_commit', '?')}")


def newest_timing() -> Path | None:
    """The logits-op timing file of the highest run (the last part of it, ``14b`` after ``14a``)."""
    found = [(int(m["run"]), m["part"], path) for path in EXPERIMENTS.glob("gpu_check-*-timing.json")
             if (m := TIMING.search(path.name))]
    return max(found)[2] if found else None


def logits_markdown() -> str:
    path = newest_timing()
    if path is None:
        return "No GPU timing of the logits op is committed.\n"
    doc = _load(path)
    machine, run = doc["env"], "".join(TIMING.search(path.name).group("run", "part"))
    rows = [row for row in doc["logits_timing"] if "error" not in row]
    impls = ["ours-dgpo", "ours-grpo", "liger-grpo", "trl-grpo"]
    lines = [f"**The logits op** ({_provenance(path, machine, run)}): forward + backward from bf16 logits, "
             f"N = {doc['arguments'].get('tokens', 8192)}, ms; back to back (`do_bench` median) / synchronised after "
             "every call (median); the last column is ours (dgpo) over Liger's grpo.", "",
             "| V | " + " | ".join(impls) + " | dgpo / Liger |", "|---|" + "---|" * (len(impls) + 1)]
    for V in sorted({row["V"] for row in rows}, reverse=True):
        by = {row["impl"]: row for row in rows if row["V"] == V}
        cells = [f"{by[i]['do_bench_ms']:.2f} / {by[i]['sync_ms']:.2f}" if i in by else "-" for i in impls]
        ratio = "-"
        if "ours-dgpo" in by and "liger-grpo" in by:
            ratio = (f"{by['ours-dgpo']['do_bench_ms'] / by['liger-grpo']['do_bench_ms']:.2f} / "
                     f"{by['ours-dgpo']['sync_ms'] / by['liger-grpo']['sync_ms']:.2f}")
        lines.append(f"| {V:,} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def _cuda_results(benchmark: str) -> Path | None:
    found = sorted(RESULTS.glob(f"{benchmark}-cuda-*.json"))
    exact = [path for path in found if re.fullmatch(rf"{benchmark}-cuda-[a-z0-9-]+\.json", path.name)
             and not re.search(r"-[0-9a-f]{7}\.json$", path.name)]
    return exact[-1] if exact else None


def _cuda_document(benchmark: str) -> tuple[dict, str] | None:
    """(the CUDA results of ``benchmark`` that ``_cuda_results`` picks, the provenance naming its file, card, run and
    commit)."""
    path = _cuda_results(benchmark)
    if path is None:
        return None
    doc = _load(path)
    machine = doc["machine"]
    return doc, _provenance(path, machine, run_of(machine.get("dgpo_ops_commit"), _card(machine)))


def fused_linear_markdown() -> str:
    found = _cuda_document("fused_linear")
    if found is None:
        return "No GPU run of the fused linear is committed.\n"
    doc, provenance = found
    lines = [f"**The fused linear** ({provenance}): forward + backward from hidden states and "
             "the lm_head weight, median ms, and the extra peak of one call, GB.", "",
             "| N x H x V | setting | ours | TRL chunked | Liger | three GEMMs | ours / GEMMs | ours / TRL | "
             "peak ours | peak TRL | ours, logits on chip |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in doc["rows"]:
        r = row["results"]

        def ms(name, r=r):
            return r[name]["seconds_median"] * 1e3 if "seconds_median" in r.get(name, {}) else None

        def gb(name, r=r):
            value = r.get(name, {}).get("extra_peak_bytes")
            return "-" if value is None else f"{value / 1e9:.2f}"

        ours, trl, liger, floor, on_chip = (ms(name) for name in ("ours", "trl", "liger", "gemm_floor", "ours_on_chip"))
        cells = ["-" if v is None else f"{v:.1f}" for v in (ours, trl, liger, floor)]
        ratios = [f"{ours / other:.2f}" if ours and other else "-" for other in (floor, trl)]
        chip = "-" if on_chip is None else f"{on_chip:.1f} ms, peak {gb('ours_on_chip')}"
        lines.append(f"| {row['N']} x {row['H']:,} x {row['V']:,} | {row['setting']} | " + " | ".join(cells + ratios)
                     + f" | {gb('ours')} | {gb('trl')} | {chip} |")
    return "\n".join(lines) + "\n"


def train_step_markdown() -> str:
    found = _cuda_document("train_step")
    if found is None:
        return "No GPU run of the update step is committed.\n"
    doc, provenance = found
    lines = [f"**One update of {doc['model']}'s architecture** ({provenance}): seconds of one "
             "timed update and its peak memory, GB.", "", "| completion | " + " | ".join(
                 f"{result['path']} s | {result['path']} peak" for result in doc["results"]) + " |",
             "|---|" + "---|---|" * len(doc["results"])]
    for length in doc["completion_lengths"]:
        cells = []
        for result in doc["results"]:
            row = next((r for r in result["rows"] if r["completion_length"] == length), {})
            peak = row.get("peak_bytes")
            cells += [f"{row['seconds_median']:.3f}" if "seconds_median" in row else "-",
                      "-" if peak is None else f"{peak / 1e9:.2f}"]
        lines.append(f"| {length:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _span(values) -> str:
    return f"{values[0]:.3g}" if len(values) == 1 else f"{values[0]:.3g}-{values[-1]:.3g}"


def passes_markdown() -> str:
    found = _cuda_document("passes")
    if found is None:
        return "No GPU pass grid is committed.\n"
    doc, provenance = found
    counts: dict[str, set] = {}
    for row in doc["rows"]:
        counts.setdefault(row["path"], set()).add(row["passes"])
    parts = ", ".join(f"{name} {_span(sorted(values))}" for name, values in counts.items())
    table = _relative(_cuda_results("passes").with_suffix(".md"))
    return f"**GEMM passes over the lm_head weight per update** ({provenance}; [table](../{table})): {parts}.\n"


def headline_markdown() -> str:
    """docs/benchmarks.md's headline: every GPU table from its committed results file."""
    note = ("_Written by `python docs/generate.py` from the committed results each table names (do not edit by "
            "hand)._\n\n")
    return note + "\n".join(part() for part in (logits_markdown, fused_linear_markdown, train_step_markdown,
                                                 passes_markdown))
