"""Vocabulary split across processes (tensor parallelism), real processes (gloo, CPU, 2 and 3 ranks), on both
kernel sets (the Triton kernels in the interpreter, and their torch twins; 3 ranks on the twins alone, as
``vocab_parallel_workers.WORLD_BACKENDS`` says why):
``fused_dgpo_loss(shard, ..., vocab_parallel_group=group)`` gives the loss, log-probs, entropies and
metrics of ``reference_loss`` over the whole vocabulary, and each process the gradient of its columns,
for a method of every route (helpers.ROUTE_VARIANTS: the split reaches a method's math only through its route),
aggregation, KL, entropy bonus, temperature, GSPO, flat logits and bf16; the entropy as accurately as one process
gives it (large and peaked logits); bad values under deferred validation as on one process: a NaN loss and gradient
on every process, then the error naming them."""

from __future__ import annotations

import functools

import pytest
import torch
import vocab_parallel_workers as workers
from worlds import XDIST_GROUP, start_world

import dgpo_ops

# One start of each world for the module (started): the tests run on one xdist worker, so each world starts
# once and the two one after the other (side by side, five gloo processes on two cores waited on each other
# longer than they ran).
pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed"),
              pytest.mark.xdist_group(XDIST_GROUP), pytest.mark.early]
JOBS = workers.jobs()
_RUNS: dict[int, list[dict]] = {}


# (world, kernel set) of the tests that read a world's results by kernel set: those the world ran
SPLITS = [pytest.param(world, backend, id=f"{world}ranks-{backend}")
          for world, backends in workers.WORLD_BACKENDS.items() for backend in backends]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The results of a world by its size, its processes started on the first request."""
    return functools.partial(world_results, tmp_path_factory)


def world_results(tmp_path_factory, world: int) -> tuple[int, list[dict]]:
    if world not in _RUNS:  # one start per world: starting the processes is most of the time
        path = tmp_path_factory.mktemp(f"vocab{world}")
        start_world(workers.vocab_parallel_worker, (world, str(path / "init"), str(path)), nprocs=world)
        _RUNS[world] = [torch.load(path / f"rank{rank}.pt") for rank in range(world)]
        for rank, result in enumerate(_RUNS[world]):
            assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return world, _RUNS[world]


@pytest.mark.parametrize("world, backend", SPLITS)
@pytest.mark.parametrize("name", list(JOBS))
def test_split_vocabulary_equals_one_process(started, world, name, backend):
    world, results = started(world)
    batch, keywords = workers.inputs_of(JOBS[name])
    logits = batch.pop("logits").detach().clone().requires_grad_(True)
    want = dgpo_ops.reference_loss(logits, **batch, **keywords)
    want.loss.backward()
    low_precision = logits.dtype == torch.bfloat16
    tolerance = dict(rtol=1e-2, atol=1e-2) if low_precision else dict(rtol=1e-5, atol=1e-6)
    for rank, result in enumerate(results):
        got = result[f"{backend}/{name}"]
        torch.testing.assert_close(got["loss"], want.loss.detach().float(), **tolerance)
        torch.testing.assert_close(got["logps"], want.logps, **tolerance)
        torch.testing.assert_close(got["entropy"], want.entropy, **tolerance)
        torch.testing.assert_close(got["metrics"], want.metrics.as_tensor(), **tolerance)
        columns = logits.grad[..., workers.columns_of(rank, world)]
        torch.testing.assert_close(got["grad"].float(), columns.float(), **tolerance)
        assert got["grad"].dtype == logits.dtype


@pytest.mark.parametrize("world, backend", SPLITS)
@pytest.mark.parametrize("name", list(workers.LINEAR_JOBS))
def test_split_lm_head_equals_one_process(started, world, name, backend):
    # The lm_head weight and bias split by vocabulary rows (a plain local shard, or a Shard(0) DTensor),
    # the same hidden states everywhere: the loss and per-token values of one process with the whole
    # weight, each process the gradient of its rows, and every process the whole hidden-state gradient.
    world, results = started(world)
    leaves, want = whole_lm_head(name, backend)
    # float64 on the twins: nothing but summation order; float32 on the Triton kernels
    tolerance = dict(rtol=1e-9, atol=1e-9) if backend == "torch" else dict(rtol=2e-5, atol=2e-5)
    for rank, result in enumerate(results):
        got = result[f"{backend}/{name}"]
        rows = workers.columns_of(rank, world)
        torch.testing.assert_close(got["loss"], want.loss.detach(), **tolerance)
        torch.testing.assert_close(got["logps"], want.logps, **tolerance)
        torch.testing.assert_close(got["entropy"], want.entropy, **tolerance)
        torch.testing.assert_close(got["metrics"], want.metrics.as_tensor(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["hidden"], leaves["hidden"].grad, **tolerance)
        torch.testing.assert_close(got["weight"], leaves["weight"].grad[rows], **tolerance)
        torch.testing.assert_close(got["bias"], leaves["bias"].grad[rows], **tolerance)


@functools.cache
def whole_lm_head(name: str, backend: str) -> tuple[dict, dgpo_ops.PolicyLossOutput]:
    """The leaves (their gradients filled) and output of one process with the whole weight: the same for every
    world size, so computed once (on the Triton kernels, in the interpreter)."""
    tensors, batch, keywords = workers.linear_inputs(name, backend)
    leaves = {key: value.requires_grad_(True) for key, value in tensors.items()}
    want = dgpo_ops.fused_linear_dgpo_loss(leaves["hidden"], leaves["weight"], **batch, bias=leaves["bias"],
                                           **keywords)
    want.loss.backward()
    return leaves, want


@functools.cache
def one_process_entropy(case: str, backend: str) -> torch.Tensor:
    """One process's entropies of an accuracy case, the same for every world size: computed once."""
    logits = workers.accuracy_logits(case)
    return dgpo_ops.fused_dgpo_loss(logits, workers.accuracy_targets(), torch.ones(4), backend=backend).entropy


def entropy_errors(got: torch.Tensor, case: str, backend: str):
    """(|split - exact|, |one process - exact|, exact) per token, exact in float64."""
    exact = workers.exact_entropy(workers.accuracy_logits(case))
    one_process = one_process_entropy(case, backend)
    return (got.double() - exact).abs(), (one_process.double() - exact).abs(), exact


@pytest.mark.parametrize("world, backend", SPLITS)
@pytest.mark.parametrize("case", list(workers.ACCURACY_CASES))
def test_split_entropy_is_as_accurate_as_one_process(started, world, case, backend):
    # Large logits: the error of the old split path grew with their size (3.5e-5 at +100, 1.6e-4 at +500, against
    # 5e-6 and 1.6e-5 on one process); peaked rows: it returned 0 for entropies of 1e-14 to 1e-6.
    world, results = started(world)
    for result in results:
        got = result[f"{backend}/accuracy/{case}"]
        split_error, one_error, exact = entropy_errors(got, case, backend)
        assert (got >= 0).all()
        assert split_error.max() <= 2 * one_error.max() + 1e-6, (split_error.max(), one_error.max())
        assert (split_error <= 2 * one_error + 1e-3 * exact + 1e-30).all(), (got, exact)
        if "peak" in workers.ACCURACY_CASES[case]:
            assert (exact < 1e-5).all() and (got > 0).all()


@pytest.mark.parametrize("world, backend", SPLITS)
def test_split_linear_logprob_entropy_is_as_accurate_as_one_process(started, world, backend):
    # Hidden states x 30: peaked rows from an lm_head, where the old split path once gave a negative entropy.
    world, results = started(world)
    hidden, weight = workers.accuracy_hidden()
    targets = torch.arange(hidden.shape[0]).remainder(workers.VOCAB)
    one_logp, one_entropy = dgpo_ops.linear_logprob_entropy(hidden, weight, targets, backend=backend)
    logits = hidden.double() @ weight.double().t()
    exact = workers.exact_entropy(logits)
    one_error = (one_entropy.double() - exact).abs()
    for result in results:
        got = result[f"{backend}/accuracy/linear"]
        assert (got["entropy"] >= 0).all()
        split_error = (got["entropy"].double() - exact).abs()
        assert (split_error <= 2 * one_error + 1e-3 * exact + 1e-6).all(), (got["entropy"], exact)
        torch.testing.assert_close(got["logp"], one_logp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world, backend", SPLITS)
@pytest.mark.parametrize("case", workers.DEFERRED_CASES)
def test_split_bad_values_under_deferred_validation_give_nan_then_the_error(started, world, case, backend):
    # The old split path read a mask of 0.5 as 1, gave a NaN loss with an all-zero gradient for a bad target,
    # -inf for inf advantages, and for unequal shares a NaN loss on process 0 but a finite wrong one on the others;
    # raise_deferred_errors() raised nothing.
    message = {"mask": "mask must hold only 0 and 1", "target": "target_ids must be in",
               "advantages": "advantages has non-finite", "uneven": "equal share of the vocabulary"}[case]
    _, results = started(world)
    for rank, result in enumerate(results):
        got = result[f"{backend}/deferred/{case}"]
        assert got["loss"].isnan(), f"rank {rank}: {got['loss']}"
        assert got["grad_has_nan"], f"rank {rank}"
        assert got["error"] is not None and message in got["error"], f"rank {rank}: {got['error']}"


@pytest.mark.parametrize("world", list(workers.WORLD_BACKENDS), ids=lambda world: f"{world}ranks")
def test_bad_input_names_the_argument(started, world):
    _, results = started(world)
    for result in results:
        assert "vocab_parallel_group" in result["error/uneven"] and "equal share" in result["error/uneven"]
        assert result["error/target"] is not None and "target" in result["error/target"]
        assert result["error/group"] is not None and "vocab_parallel_group" in result["error/group"]


def test_without_a_process_group_it_says_so():
    batch, keywords = workers.inputs_of(JOBS["bf16"])
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="vocab_parallel_group needs torch.distributed"):
        dgpo_ops.fused_dgpo_loss(batch.pop("logits"), **batch, **keywords, vocab_parallel_group=object())


def test_different_token_counts_under_deferred_validation_give_nan_then_the_error(tmp_path):
    """The processes of the group hold different token counts, validation deferred: before, the merge all-reduced
    tensors of different sizes and gloo aborted both processes (SIGABRT; NCCL would hang or mix rows). Now every
    process agrees on the sizes on the host first, so each gets NaN and the error at its next call, and the group's
    collectives stay in step. Real processes, with a deadline: a hang fails, as does an abort."""
    import time

    world, deadline = 2, time.monotonic() + 300
    context = start_world(workers.token_count_worker, (world, str(tmp_path / "init"), str(tmp_path)),
                          nprocs=world, join=False)
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                pytest.fail("the processes did not finish within the deadline (a collective hung)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    message = "same tokens"
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        for setting in (*workers.BACKENDS, "own host group"):
            got = result[setting]
            for op in ("logits", "linear"):
                assert got[op]["loss"].isnan() and got[op]["grad_has_nan"], (rank, setting, op, got[op])
                assert got[op]["error"] is not None and message in got[op]["error"], (rank, setting, op)
            assert got["logprobs"]["all_nan"] and message in got["logprobs"]["error"], (rank, setting)
            assert got["agreeing"].isfinite() and got["agreeing"] == results[0][setting]["agreeing"], (rank, setting)
            assert got["immediate"] is not None and "token counts range from 14 to 21" in got["immediate"], got
        assert result["host groups"] == 1  # made once, for the group that takes no CPU tensors
