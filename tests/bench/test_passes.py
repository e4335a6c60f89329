"""The lm_head's GEMM passes of one policy update (``bench/passes.py``), pinned per case: a count, not a time.

``CURRENT_PASSES`` is what the code pays today on the CPU (the torch twins), ``DESIGNED_PASSES`` what it is built
to pay (``bench.passes.designed_passes``). Where the two differ the design is not reached yet: the test holds
today's count, so that a change that adds a pass fails, and the change that removes one has to move that case's
``CURRENT_PASSES`` to its design (``test_no_case_pays_less_than_designed`` then says so). Today every case pays its
design: one loss call per update, TRL's entropy bonus in it (entropy weights), TRL's masks made from its own first
sweep (``complete_batch``); 3 passes for a token-local method without a mask, 4 otherwise. The torch twins have an
epilogue as the Triton kernels do, so our CUDA counts are the CPU's; GRPOTrainer's are not: on a Triton device TRL's
chunked head scores the labelled positions alone, 4 passes, against 4 x (prompt + completion - 1) / completion on the
CPU. ``CURRENT_PASSES_CUDA`` is what run 14 measured on an H100 (commit 0fb0943, csrc_notes.md);
``test_pass_count_on_cuda`` checks it in ``gpu_session.sh``'s CUDA tests.
"""

from __future__ import annotations

import itertools
import pathlib
import sys

import pytest

pytest.importorskip("trl")

REPO = pathlib.Path(__file__).resolve().parents[2]


if str(REPO) not in sys.path:  # bench/ imports from the repository root
    sys.path.insert(0, str(REPO))

from helpers import requires_cuda

from bench import passes

PROMPT, COMPLETION = passes.COUNT_SHAPE["tiny"]
CASES = list(itertools.product(passes.METHODS, passes.OPTIONS, passes.PATHS))
MASKS = {"entropy_mask", "off_policy_mask", "all"}
# GRPOTrainer's chunked head (on the CPU over every position but the last, prompt included; on CUDA over the labelled
# positions) and the model's lm_head on the logits path do not depend on the loss: one count each, today and by design.
TRL_PASSES = 4 * (PROMPT + COMPLETION - 1) / COMPLETION
TRL_PASSES_CUDA = 4.0
LOGITS_PASSES = 3 * (COMPLETION + 1) / COMPLETION


def _linear_today(method: str, option: str) -> float:
    """Fused linear today, on either kernel set: one loss call, the entropy bonus in it (entropy weights); 3 for grpo
    without a mask (the epilogue: each tile's gradient from the pass that made it), else 4 (a first sweep, shared by
    the masks and the method's statistic, then the full sweep)."""
    return 3 if method == "grpo" and option not in MASKS else 4


def _table(trl_passes: float) -> dict:
    table = {}
    for method, option, path in CASES:
        if path == "trl":
            table[method, option, path] = trl_passes
        elif path == "dgpo_logits":
            table[method, option, path] = LOGITS_PASSES
        else:
            table[method, option, path] = float(_linear_today(method, option))
    return table


CURRENT_PASSES = _table(TRL_PASSES)  # the CPU, the torch twins
CURRENT_PASSES_CUDA = _table(TRL_PASSES_CUDA)  # the Triton kernels and TRL's compacted head, as run 14 measured
DESIGNED_PASSES = {(m, o, p): passes.designed_passes(p, m, o, PROMPT, COMPLETION) for m, o, p in CASES}
DESIGNED_PASSES_CUDA = {(m, o, p): passes.designed_passes(p, m, o, PROMPT, COMPLETION, "cuda") for m, o, p in CASES}


def test_the_table_today_as_recorded():
    """The values written out, as the bench's results table shows them (gspo and clip_cov 4 throughout)."""
    linear = {option: CURRENT_PASSES["gspo", option, "dgpo_linear"] for option in passes.OPTIONS}
    assert linear == {option: 4 for option in passes.OPTIONS}
    assert all(CURRENT_PASSES[m, o, "dgpo_linear"] == 4 for m, o, _ in CASES if m != "grpo")
    grpo = {option: CURRENT_PASSES["grpo", option, "dgpo_linear"] for option in passes.OPTIONS}
    assert grpo == {"plain": 3, "entropy_mask": 4, "off_policy_mask": 4, "entropy_bonus": 3, "adaptive_entropy": 3,
                    "all": 4}
    assert CURRENT_PASSES == DESIGNED_PASSES and CURRENT_PASSES_CUDA == DESIGNED_PASSES_CUDA  # every case at its design
    assert all(CURRENT_PASSES_CUDA[case] == CURRENT_PASSES[case] for case in CASES if case[2] != "trl")
    designed = {option: DESIGNED_PASSES["grpo", option, "dgpo_linear"] for option in passes.OPTIONS}
    assert designed == {"plain": 3, "entropy_mask": 4, "off_policy_mask": 4, "entropy_bonus": 3,
                        "adaptive_entropy": 3, "all": 4}
    assert all(DESIGNED_PASSES[m, o, "dgpo_linear"] == 4 for m, o, _ in CASES if m != "grpo")
    assert TRL_PASSES == 5.875 and LOGITS_PASSES == 3.09375
    assert {DESIGNED_PASSES_CUDA[case] for case in CASES if case[2] == "trl"} == {4.0}


def test_no_case_pays_less_than_designed():
    """A count below its design means the design moved or the counter lost a product: either way, look."""
    for table, designed in ((CURRENT_PASSES, DESIGNED_PASSES), (CURRENT_PASSES_CUDA, DESIGNED_PASSES_CUDA)):
        below = {case: (table[case], designed[case]) for case in CASES if table[case] < designed[case]}
        assert not below


@pytest.mark.parametrize("method,option,path", CASES, ids=["-".join(case) for case in CASES])
def test_pass_count_of_each_case(method, option, path):
    row = passes.count_case(path, method, option, "tiny", "cpu")
    assert row["passes"] == CURRENT_PASSES[method, option, path], row["distinct_calls"]
    assert row["loss_finite"]


# the paths whose count the device could move: our kernels (Triton against the twins) and TRL's head (compacted there)
CUDA_CASES = [case for case in CASES if case[2] in ("dgpo_linear", "trl") and (case[2] != "trl" or case[1] == "plain")]


@requires_cuda
@pytest.mark.parametrize("method,option,path", CUDA_CASES, ids=["-".join(case) for case in CUDA_CASES])
def test_pass_count_on_cuda(method, option, path):
    row = passes.count_case(path, method, option, "tiny", "cuda")
    assert row["passes"] == CURRENT_PASSES_CUDA[method, option, path], row["distinct_calls"]
    assert row["loss_finite"]


def test_the_counter_counts_every_matmul_form_and_nothing_else():
    """``mm``, ``mm.out``, ``addmm``, the in-place ``addmm_`` a gradient accumulates with, ``bmm`` and ``matmul``,
    with the vocabulary on either side; a product without it is not counted."""
    import torch

    vocab, hidden, rows = 40, 8, 6
    weight, x = torch.randn(vocab, hidden), torch.randn(rows, hidden)
    with passes.VocabularyGemmCounter(vocab) as counter:
        logits = x @ weight.T  # mm
        torch.mm(x, weight.T, out=torch.empty(rows, vocab))  # mm.out
        torch.addmm(torch.zeros(vocab), x, weight.T)  # addmm
        grad = torch.zeros(vocab, hidden)
        grad.addmm_(logits.T, x)  # addmm_
        torch.bmm(x[None], weight.T[None])  # bmm
        counter.phase = "backward"
        torch.matmul(logits, weight)  # the vocabulary as the inner dimension
        x @ torch.randn(hidden, hidden)  # not the lm_head's
    one = 2 * rows * hidden * vocab
    assert counter.counts == {"forward": {"calls": 5, "flops": 5 * one}, "backward": {"calls": 1, "flops": one}}


def test_the_recorded_results_are_todays():
    """``bench/results/passes-cpu.json`` (``python bench/passes.py``) holds the counts this test pins."""
    import json

    doc = json.loads((REPO / "bench" / "results" / "passes-cpu.json").read_text())
    assert doc["complete"] and doc["machine"]["dgpo_ops_commit"]
    recorded = {(r["method"], r["option"], r["path"]): (r["passes"], r["designed_passes"]) for r in doc["rows"]}
    assert recorded == {case: (CURRENT_PASSES[case], DESIGNED_PASSES[case]) for case in CASES}


def test_the_timing_table_shows_each_case_and_why_one_failed():
    """``bench/passes_time.py``'s table (its measurements take minutes a case: ``python bench/passes_time.py``)."""
    from bench import passes_time

    machine = {"device": "cpu", "device_name": "CPU", "cpu_count": 2, "torch": "x", "trl": "y", "dgpo_ops_commit": "abc"}
    doc = {"machine": machine, "command": "python bench/passes_time.py", "model": "cpu-small", "prompt_length": 128,
           "completion_length": 256, "repeats": 1, "load_average": ["1.0", "2.0"], "methods": ["grpo"],
           "options": ["plain", "all"], "paths": ["dgpo_linear", "trl"],
           "rows": [{"method": "grpo", "option": "plain", "path": "dgpo_linear", "seconds_median": 7.5,
                     "peak_bytes": 2.05e9},
                    {"method": "grpo", "option": "all", "path": "trl", "error": "exited -9: killed"}]}
    table = passes_time.markdown(doc)
    assert "| grpo | plain | 7.50 s / 2.05 | - |" in table
    assert "| grpo | all | - | failed |" in table
    assert "* grpo all trl: exited -9: killed" in table


def test_a_vocabulary_over_one_cast_block_is_refused(monkeypatch):
    # the counter sees the lm_head's products by their vocabulary dimension; a weight cast in blocks hides it
    import bench.passes as passes

    monkeypatch.setattr(passes, "vocab_block_rows", lambda budget, weight: 8)
    with pytest.raises(ValueError, match="several of the fused linear's cast blocks"):
        passes.count_case("dgpo_linear", "grpo", "plain")
