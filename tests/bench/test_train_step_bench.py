"""``bench/train_step.py`` (one policy update of a real-size model, DGPOTrainer against GRPOTrainer) at its tiny
size on the CPU: every path computes TRL's loss and gradient norm on the same weights and batch, and the JSON,
table and plot are written. Times are recorded, never asserted.

The bench measures each path in a process of its own (``run_path``); here the paths run in the test's process,
which has imported TRL already (a new process per path spent most of the test importing it). The bench's own
processes run in the GPU script's dry run (``tests/bench/test_gpu_session.py``, its trainstep stage)."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest

pytest.importorskip("trl")

REPO = pathlib.Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ imports from the repository root
    sys.path.insert(0, str(REPO))

from bench import train_step as bench


def parameter_count(config: dict) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**config)).parameters())


def in_this_process(path, model_name, prompt_length, lengths, repeats, search, timeout=None):
    """``run_path`` without the process: the path's ``child`` here, its result as the process prints it."""
    return json.loads(json.dumps(bench.child(path, model_name, prompt_length, lengths, repeats, search)))


@pytest.mark.early
def test_tiny_update_step_runs_every_path_and_matches_trl(tmp_path, monkeypatch, capsys):
    out = tmp_path / "train_step-tiny.json"
    monkeypatch.setattr(bench, "run_path", in_this_process)
    code = bench.main(["--model", "tiny", "--completions", "16,24", "--repeats", "1", "--output", str(out)])
    assert code == 0, capsys.readouterr().err[-3000:]
    doc = json.loads(out.read_text())
    assert doc["model"] == "tiny" and doc["completion_lengths"] == [16, 24]
    assert doc["parameters"] == parameter_count(bench.MODELS["tiny"]) > 0
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
            assert row["entropy"] > 0 and all(v > 0 for v in row["grad_norms"].values())
            # the same weights, batch and loss as TRL's GRPOTrainer (fp32: summation order only)
            assert set(row["vs_trl"]) == {"loss", "grad_norm", "entropy", *(f"grad_norm.{k}" for k in
                                                                               bench.GRADIENT_PROBES)}
            assert row["matches_trl"] is True and max(row["vs_trl"].values()) <= 1e-4, (path, row)
        assert results[path]["attn_implementation"]
        assert "CUDA" in results[path]["longest_completion_skipped"]
    assert doc["complete"] is True
    table = out.with_suffix(".md").read_text()
    assert table.count("| dgpo_linear |") == 2 and table.count("| trl |") == 2
    assert (tmp_path / "train_step-tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_first_update_depends_on_the_weights(tmp_path):
    """The compared loss is not a function of the batch alone (with on-policy ratios of 1 it would be): other
    weights, same batch, another loss and other gradient norms."""
    import torch

    trainer = bench.build_trainer("trl", "tiny", 16, str(tmp_path), "cpu")
    inputs = bench.synthetic_rollouts(16, 16, trainer.model.config.vocab_size, "cpu")
    with torch.no_grad():
        before = {name: p.clone() for name, p in trainer.model.named_parameters()}
    first = bench.update(trainer, inputs, record=True)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            p.copy_(before[name] + 0.05 * torch.randn_like(p))
    second = bench.update(trainer, inputs, record=True)
    assert first["loss"] != pytest.approx(second["loss"], rel=1e-3)
    assert first["grad_norms"]["embedding"] != pytest.approx(second["grad_norms"]["embedding"], rel=1e-3)


def fake_row(loss=1.0, grad_norm=2.0, entropy=3.0, embedding=0.5):
    norms = dict.fromkeys(bench.GRADIENT_PROBES, 0.25) | {"embedding": embedding}
    return {"completion_length": 16, "loss": loss, "grad_norm": grad_norm, "entropy": entropy, "grad_norms": norms}


def test_a_path_that_differs_from_trl_is_flagged():
    results = [{"path": "trl", "rows": [fake_row()]},
               {"path": "dgpo_linear", "rows": [fake_row(loss=1.0 + 1e-6)]},
               {"path": "dgpo_logits", "rows": [fake_row(grad_norm=2.1)]},
               {"path": "trl_liger", "rows": [fake_row(embedding=0.51)]}]
    bench.check_against_trl(results, rtol=1e-4)
    assert results[1]["rows"][0]["matches_trl"] is True
    assert results[2]["rows"][0]["matches_trl"] is False
    assert results[2]["rows"][0]["vs_trl"]["grad_norm"] == pytest.approx(0.05)
    assert results[3]["rows"][0]["matches_trl"] is False  # one parameter's gradient is enough
    alone = [{"path": "dgpo_linear", "rows": [fake_row()]}]
    bench.check_against_trl(alone, rtol=1e-4)
    assert alone[0]["rows"][0]["matches_trl"] is None  # no TRL row: not checked, and not passed either


@pytest.mark.parametrize("capacity", [0, 1023, 1024, 1500, 2048, 5000, 8192, 9000, 16383, 65536, 131_072, 10**6])
def test_longest_fitting_finds_the_largest_multiple_of_the_step(capacity):
    fits = lambda length: length <= capacity  # noqa: E731
    longest, probes = bench.longest_fitting(fits, step=1024, limit=131_072)
    expected = min(capacity, 131_072) // 1024 * 1024 or None
    assert longest == expected
    assert all(p % 1024 == 0 and 0 < p <= 131_072 for p in probes)
    assert len(probes) <= 2 * math.log2(131_072 / 1024) + 2  # doubling, then bisection: not a linear scan
    assert len(set(probes)) == len(probes)


def test_longest_fitting_edges():
    fits = lambda length: length <= 20_000  # noqa: E731
    assert bench.longest_fitting(fits, step=1024, limit=10_000)[0] == 9 * 1024  # the limit rounds down to a step
    assert bench.longest_fitting(fits, step=1024, limit=1000) == (None, [])  # no step fits under the limit
    longest, probes = bench.longest_fitting(fits, step=1024, limit=131_072, known_fit=16_384)
    assert longest == 19 * 1024 and 16_384 not in probes and min(probes) > 16_384  # starts above what fit
    assert bench.longest_fitting(fits, step=1024, known_fit=1000)[0] == 19 * 1024  # under one step: from the start


def test_out_of_memory_is_recognised_and_other_errors_are_not():
    import torch

    assert bench.out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert bench.out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not bench.out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not bench.out_of_memory(ValueError("out of memory"))


def test_model_is_qwen25_15b():
    # Qwen2.5-1.5B's published parameter count (tied embeddings), from the config written out in the bench
    assert parameter_count(bench.MODELS["qwen2.5-1.5b"]) == 1_543_714_304
