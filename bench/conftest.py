"""pytest configuration of the benchmark suite (``pytest bench/ --benchmark-only`` from the repo root).

Collects one record per case (timings from pytest-benchmark, peak memory, parity against the eager
path, or the reason it was skipped), writes them with the machine description to
``bench/results/<device>.json`` at the end of the session and regenerates the tables of docs/benchmarks.md, the
plots and ``bench/results/traffic.md`` (``bench.report``). A run that does not cover the whole grid
(``-k``, ``--benchmark-disable``, failures) is written to ``<device>-partial.json``, which the report
ignores: ratios always come from one complete run.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import pytest

from bench.common import (
    COMPETITORS,
    CPU_MEMORY_METHOD,
    CUDA_MEMORY_METHOD,
    LABELS,
    RESULTS_DIR,
    ROUNDS,
    device,
    grid,
    machine,
    make_inputs,
    results_tag,
)

NOT_COMPARED = [
    {"what": "trl.kernels.ChunkedLogProbFunction", "reason": "takes hidden states and the lm_head weight (fused "
     "linear + log-probs), not logits; out of scope for a loss-from-logits benchmark"},
    {"what": "liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss", "reason": "fused linear + loss from hidden "
     "states, not logits; out of scope for a loss-from-logits benchmark"},
]


def pytest_addoption(parser):
    group = parser.getgroup("dgpo-ops benchmarks")
    group.addoption("--bench-grid", default="auto", choices=("auto", "full", "cpu", "smoke"),
                    help="auto: the full grid on CUDA, the reduced CPU grid on CPU (default); smoke: "
                         "the smallest size only, written as a partial run")
    group.addoption("--bench-no-report", action="store_true",
                    help="write the results JSON but do not regenerate docs/benchmarks.md, plots and traffic.md")


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class BenchRun:
    """Session state: the records, the current inputs, the eager references for parity."""

    def __init__(self, config):
        self.config = config
        self.device = device()
        self.grid_name = config.getoption("--bench-grid")
        self.cases, self.dropped = grid(self.grid_name, self.device)
        self.records: list[dict] = []
        self.references: dict = {}  # (method, N, V) -> (loss, gradient rows) of the eager path
        self.compile_blocked: dict[str, str] = {}  # method -> why later torch.compile cases are skipped
        self.started = time.time()
        self.load_at_start = _loadavg()
        self.selected: list[str] = []
        self._inputs_key = None
        self._inputs = None

    def inputs(self, n: int, v: int):
        if self._inputs_key != (n, v):
            self._inputs = None  # free the previous size first
            self._inputs = make_inputs(n, v, self.device)
            self._inputs_key = (n, v)
        return self._inputs

    def record(self, case, **fields) -> dict:
        rec = {"competitor": case.competitor, "method": case.method, "N": case.n, "V": case.v, **fields}
        self.records.append(rec)
        return rec

    @property
    def complete(self) -> bool:
        if self.grid_name == "smoke":
            return False
        expected = {c.id for c in self.cases}
        done = {f"{r['method']}-N{r['N']}-V{r['V']}-{r['competitor']}" for r in self.records
                if r["status"] == "skipped" or (r["status"] == "ok" and r.get("time_s"))}
        return expected <= done

    def document(self) -> dict:
        skipped: dict[str, dict] = {}  # competitor -> each reason -> the cases it applies to
        for r in self.records:
            if r["status"] == "skipped":
                entry = skipped.setdefault(r["competitor"], {"label": LABELS[r["competitor"]], "reasons": {}})
                for reason in r["reasons"]:
                    entry["reasons"].setdefault(reason, []).append(f"{r['method']} N={r['N']} V={r['V']}")
        return {
            "schema": 1,
            "run": {
                "command": "pytest " + " ".join(self.config.invocation_params.args),
                "started_utc": datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "wall_s": round(time.time() - self.started, 1),
                "load_average_1_5_15min": {"start": self.load_at_start, "end": _loadavg()},
                "complete": self.complete,
                "rounds": ROUNDS,
                "warmup": "one untimed call before the timed rounds (it compiles, for torch.compile, and is "
                          "the call checked for parity)",
                "timer": "pytest-benchmark pedantic, one forward+backward per round, gradient freed before "
                         "each round outside the timed region" + (", torch.cuda.synchronize() inside"
                                                                  if self.device.type == "cuda" else ""),
                "memory_method": CUDA_MEMORY_METHOD if self.device.type == "cuda" else CPU_MEMORY_METHOD,
                "loss": "token-mean policy loss from bf16 logits (B, T=1024, V), off-policy old log-probs, one "
                        "advantage per response, ~12% padding masked, no KL, temperature 1",
            },
            "machine": machine(),
            "competitors": {c: LABELS[c] for c in COMPETITORS},
            "grid": {"cases": [c.id for c in self.cases], "dropped": self.dropped},
            "records": self.records,
            "skipped": skipped,
            "not_compared": NOT_COMPARED,
        }


def pytest_configure(config):
    config._dgpo_bench = BenchRun(config)


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = metafunc.config._dgpo_bench.cases
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def pytest_collection_finish(session):
    session.config._dgpo_bench.selected = [item.nodeid for item in session.items]


@pytest.fixture(scope="session")
def bench_run(request) -> BenchRun:
    return request.config._dgpo_bench


def pytest_sessionfinish(session, exitstatus):
    run: BenchRun = session.config._dgpo_bench
    if not run.records:
        return
    doc = run.document()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = results_tag(doc["machine"]) + ("" if doc["run"]["complete"] else "-partial")
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nbench: wrote {path.relative_to(RESULTS_DIR.parent.parent)} "
          f"({'complete' if doc['run']['complete'] else 'partial: the report ignores it'})", file=sys.stderr)
    if session.config.getoption("--bench-no-report"):
        return
    from bench import report

    report.main([])


def pytest_terminal_summary(terminalreporter):
    run: BenchRun = terminalreporter.config._dgpo_bench
    if not run.records:
        return
    from bench.report import ratio_rows

    tr = terminalreporter
    tr.section("dgpo-ops benchmark: ratios to the eager path (this run)")
    for line in ratio_rows(run.records):
        tr.write_line(line)
    skipped = run.document()["skipped"]
    if skipped:
        tr.write_line("")
        tr.write_line("skipped competitors:")
        for competitor, entry in skipped.items():
            for reason, where in entry["reasons"].items():
                tr.write_line(f"  {competitor} ({len(where)} cases): {reason}")
    if run.dropped:
        tr.write_line("")
        tr.write_line(f"sizes not run on this device: {len(run.dropped)} (method, N, V); see the results JSON")
