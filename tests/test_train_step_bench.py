"""``bench/train_step.py`` (one policy update of a real-size model, DGPOTrainer against GRPOTrainer) at its tiny
size on the CPU: every path runs in its own process, computes TRL's loss and gradient norm on the same weights
and batch, and the JSON, table and plot are written. Times are recorded, never asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("trl")

REPO = pathlib.Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_train_step", REPO / "bench" / "train_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = load_bench()


def test_tiny_update_step_runs_every_path_and_matches_trl(tmp_path):
    out = tmp_path / "train_step-tiny.json"
    proc = subprocess.run([sys.executable, "bench/train_step.py", "--model", "tiny", "--completions", "16,24",
                           "--repeats", "1", "--output", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["model"] == "tiny" and doc["completion_lengths"] == [16, 24]
    assert doc["parameters"] == bench.parameter_count("tiny") > 0
    results = {r["path"]: r for r in doc["results"]}
    assert list(results) == list(bench.PATHS)
    ran = [p for p in bench.PATHS if bench.unavailable(p, "cpu") is None]
    assert {"dgpo_linear", "dgpo_logits", "trl"} <= set(ran)
    for path in bench.PATHS:
        if path not in ran:
            assert results[path]["skipped"] == bench.unavailable(path, "cpu")
            continue
        rows = results[path]["rows"]
        assert [r["completion_length"] for r in rows] == [16, 24]
        for row in rows:
            inputs = bench.synthetic_rollouts(16, row["completion_length"], doc["vocab_size"], "cpu")
            assert row["tokens"] == int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
            assert row["seconds_median"] > 0 and row["tokens_per_s"] == pytest.approx(
                row["tokens"] / row["seconds_median"])
            assert row["peak_bytes"] > 0 and math.isfinite(row["loss"]) and row["grad_norm"] > 0
            # the same weights, batch and loss as TRL's GRPOTrainer (fp32: summation order only)
            assert row["matches_trl"] is True and row["loss_vs_trl"] <= 1e-4, (path, row)
        assert "CUDA" in results[path]["longest_completion_skipped"]
    # later lengths train on weights the earlier updates changed: the loss moves with them
    assert results["trl"]["rows"][0]["loss"] != results["trl"]["rows"][1]["loss"]
    table = out.with_suffix(".md").read_text()
    assert table.count("| dgpo_linear |") == 2 and table.count("| trl |") == 2
    assert (tmp_path / "train_step-tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_path_that_differs_from_trl_is_flagged():
    results = [{"path": "trl", "rows": [{"completion_length": 16, "loss": 1.0, "grad_norm": 2.0}]},
               {"path": "dgpo_linear", "rows": [{"completion_length": 16, "loss": 1.0 + 1e-6, "grad_norm": 2.0}]},
               {"path": "dgpo_logits", "rows": [{"completion_length": 16, "loss": 1.0, "grad_norm": 2.1}]}]
    bench.check_against_trl(results, rtol=1e-4)
    assert results[1]["rows"][0]["matches_trl"] is True
    assert results[2]["rows"][0]["matches_trl"] is False
    assert results[2]["rows"][0]["grad_norm_vs_trl"] == pytest.approx(0.05)


@pytest.mark.parametrize("capacity", [0, 1023, 1024, 1500, 2048, 5000, 8192, 9000, 16383, 65536, 131_072, 10**6])
def test_longest_fitting_finds_the_largest_multiple_of_the_step(capacity):
    fits = lambda length: length <= capacity  # noqa: E731
    longest, probes = bench.longest_fitting(fits, step=1024, limit=131_072)
    expected = min(capacity, 131_072) // 1024 * 1024 or None
    assert longest == expected
    assert all(p % 1024 == 0 and 0 < p <= 131_072 for p in probes)
    assert len(probes) <= 2 * math.log2(131_072 / 1024) + 2  # doubling, then bisection: not a linear scan
    assert len(set(probes)) == len(probes)


def test_model_is_qwen25_15b():
    # Qwen2.5-1.5B's published parameter count (tied embeddings), from the config written out in the bench
    assert bench.parameter_count("qwen2.5-1.5b") == 1_543_714_304
