"""``bench/experiments/gpu_session.sh``'s dry run: every default stage on the CPU at tiny sizes, from the install it
makes (not the checkout), each writing its results to $OUT; so that the script breaks here and not during a GPU
lease of a few minutes. No time is asserted."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("trl")

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "experiments" / "gpu_session.sh"
DEFAULT_STAGES = ["setup", "tests", "floors", "logits", "linear", "trainstep", "passes"]


def run_session(tmp_path, *stages, **env):
    out, work = tmp_path / "out", tmp_path / "work"
    environment = {**os.environ, "GPU_SESSION_DRY_RUN": "1", "OUT": str(out), "GPU_SESSION_WORK": str(work),
                   "PYTHON": sys.executable, **env}
    environment.pop("PYTHONPATH", None)  # the script sets its own: the install
    proc = subprocess.run(["bash", str(SCRIPT), *stages], cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=900, check=False)
    stages_run = [line.split("\t") for line in (out / "stages.tsv").read_text().splitlines()] \
        if (out / "stages.tsv").exists() else []
    return proc, out, work, stages_run


# The default stages and the rows stage (with a baseline forward) in one dry run, read by the two tests below:
# each stage's process is the same whether it runs in this run or in one of its own, and a run of its own
# costs a setup (the install and the copy of the tree) and the script's start. That a run without stage names
# runs exactly the default stages is test_a_stage_without_budget_left_is_skipped_and_recorded's.
ALL_STAGES = [*DEFAULT_STAGES, "rows"]


@pytest.fixture(scope="module")
def every_stage(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("gpu-session")
    baseline = tmp_path / "logprob_entropy_baseline.py"
    baseline.write_text((REPO / "kernels" / "logprob_entropy.py").read_text())
    relative = os.path.relpath(baseline, REPO)
    return run_session(tmp_path, *ALL_STAGES, ROWS_BASELINE_FORWARD=relative)


@pytest.mark.early
@pytest.mark.xdist_group("gpu_session_every_stage")  # one worker runs the module fixture's session, once
def test_dry_run_of_every_stage(every_stage):
    proc, out, work, stages = every_stage
    log = (out / "session.log").read_text()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + log[-4000:]
    assert [s[0] for s in stages] == ALL_STAGES
    assert all(rc == "0" and note == "ok" for _, rc, _, note in stages), stages
    # the device tool brings back at most 8 files from $OUT: the default stages' files, and the rows stage's
    files = sorted(p.name for p in out.iterdir())
    assert files == ["floors.json", "fused_linear.json", "gpu_check.json", "passes.json", "row_shapes.json",
                     "session.log", "stages.tsv", "train_step.json"]
    assert len(files) <= 8
    assert log.count("load: ") == len(ALL_STAGES) - 1  # the machine's state before every stage after setup

    floors = json.loads((out / "floors.json").read_text())
    assert floors["copy"]["tb_per_s"] > 0 and set(floors["scale_cast"]) == {"scale_cast kernel", "torch.mul into bf16"}
    assert {row["product"] for row in floors["gemm"]} == {"logits", "d hidden", "d weight"}
    # the stages imported the install, which holds the three folders as pyproject.toml maps them
    site = work / "site"
    assert f"dgpo_ops from {site}/dgpo_ops/__init__.py" in log
    for package in ("dgpo_ops", "dgpo_ops/kernels", "dgpo_ops/trainer", "dgpo_ops/trainer/app", "dgpo_ops/ops"):
        assert (site / package / "__init__.py").exists()
    assert not (work / "run" / "dgpo_ops").exists() and (work / "run" / "tests").is_dir()

    logits = json.loads((out / "gpu_check.json").read_text())
    ours = {row["impl"]: row for row in logits["logits_timing"] if row["impl"].startswith("ours")}
    assert set(ours) == {"ours-dgpo", "ours-grpo", "ours-forward-no_grad"}
    assert all(row["sync_ms"] > 0 and row["wall_ms"] > 0 and row["sync_calls_ms"] for row in ours.values())
    traces = logits["call_traces"]
    assert traces["ours-dgpo"]["events"] and traces["ours-dgpo"]["wall_ms"] > 0
    assert "liger-grpo" in traces  # traced, or the reason it could not run
    assert {row["impl"] for row in logits["logits_timing"]} >= {"liger-grpo", "trl-grpo"}  # each ran or says why
    assert logits["env"]["dgpo_ops_commit"]

    linear = json.loads((out / "fused_linear.json").read_text())
    results = linear["rows"][0]["results"]
    assert set(results) == {"ours", "gemm_floor"} and "loss" in results["ours"] and "loss" not in results["gemm_floor"]
    assert all(r["seconds_median"] > 0 for r in results.values())

    update = json.loads((out / "train_step.json").read_text())
    assert update["complete"] and [r["path"] for r in update["results"]] == ["dgpo_linear"]
    assert update["results"][0]["rows"][0]["seconds_median"] > 0

    grid = json.loads((out / "passes.json").read_text())
    assert grid["complete"] and [(r["method"], r["option"], r["path"]) for r in grid["rows"]] == [
        ("gspo", "all", "dgpo_linear")]
    assert grid["rows"][0]["passes"] == 4.0 and grid["rows"][0]["designed_passes"] == 4.0


@pytest.mark.early
@pytest.mark.xdist_group("gpu_session_every_stage")
def test_dry_run_of_the_row_shapes_stage_against_a_baseline_forward(every_stage):
    proc, out, _, stages = every_stage
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [(s[0], s[1]) for s in stages][-1] == ("rows", "0")
    doc = json.loads((out / "row_shapes.json").read_text())
    timed = [row for row in doc["rows"] if "ms" in row]
    assert len(timed) == len(doc["rows"])
    assert {row["kernel"] for row in timed} == {"forward", "backward", "backward with entropy"}
    versions = {row["version"] for row in timed if row["kernel"] == "forward"}
    assert versions == {"this tree", "baseline logprob_entropy_baseline.py"}
    assert doc["copy"]["tb_per_s"] > 0


def test_a_stage_without_budget_left_is_skipped_and_recorded(tmp_path):
    # no stage named: the default stages, in their order, each recorded (the setup runs whatever the budget)
    proc, _, _, stages = run_session(tmp_path, GPU_SESSION_BUDGET_S="5")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [s[0] for s in stages] == DEFAULT_STAGES
    assert stages[0][:2] == ["setup", "0"]
    assert all(stage == [name, "-", "0", "skipped: budget"] for stage, name in zip(stages[1:], DEFAULT_STAGES[1:]))


def test_the_commit_must_be_given_as_a_literal_on_the_device(tmp_path):
    proc, out, _, stages = run_session(tmp_path, "setup", GPU_SESSION_DRY_RUN="0", DGPO_OPS_COMMIT="")
    assert proc.returncode == 2 and "DGPO_OPS_COMMIT=<hash>" in proc.stderr
    assert stages == []  # refused before the setup spent any of the lease


def test_setup_comes_first_and_unknown_stages_are_refused(tmp_path):
    proc, *_ = run_session(tmp_path, "tests")
    assert proc.returncode == 2 and "setup must be the first stage" in proc.stderr
    proc, out, _, stages = run_session(tmp_path, "setup", "nonsense")
    assert proc.returncode == 2 and "unknown stage nonsense" in proc.stderr
    assert stages == [] and not (out / "session.log").exists()  # refused before the setup ran
