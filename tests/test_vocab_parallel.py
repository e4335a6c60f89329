"""Vocabulary split across processes (tensor parallelism), real processes (gloo, CPU, 2 and 3 ranks):
``fused_dgpo_loss(shard, ..., vocab_parallel_group=group)`` gives the loss, log-probs, entropies and
metrics of ``reference_loss`` over the whole vocabulary, and each process the gradient of its columns,
for every method variant, aggregation, KL, entropy bonus, temperature, GSPO, flat logits and bf16."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import vocab_parallel_workers as workers

import dgpo_ops

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")
JOBS = workers.jobs()
_RUNS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"{world}ranks")
def runs(request, tmp_path_factory):
    world = request.param
    if world not in _RUNS:  # one spawn per world: starting the processes is most of the time
        path = tmp_path_factory.mktemp(f"vocab{world}")
        mp.spawn(workers.vocab_parallel_worker, args=(world, str(path / "init"), str(path)), nprocs=world, join=True)
        _RUNS[world] = [torch.load(path / f"rank{rank}.pt") for rank in range(world)]
        for rank, result in enumerate(_RUNS[world]):
            assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return world, _RUNS[world]


@pytest.mark.parametrize("name", list(JOBS))
def test_split_vocabulary_equals_one_process(runs, name):
    world, results = runs
    batch, keywords = workers.inputs_of(JOBS[name])
    logits = batch.pop("logits").detach().clone().requires_grad_(True)
    want = dgpo_ops.reference_loss(logits, **batch, **keywords)
    want.loss.backward()
    low_precision = logits.dtype == torch.bfloat16
    tolerance = dict(rtol=1e-2, atol=1e-2) if low_precision else dict(rtol=1e-5, atol=1e-6)
    for rank, result in enumerate(results):
        got = result[name]
        torch.testing.assert_close(got["loss"], want.loss.detach().float(), **tolerance)
        torch.testing.assert_close(got["logps"], want.logps, **tolerance)
        torch.testing.assert_close(got["entropy"], want.entropy, **tolerance)
        torch.testing.assert_close(got["metrics"], want.metrics.as_tensor(), **tolerance)
        columns = logits.grad[..., workers.columns_of(rank, world)]
        torch.testing.assert_close(got["grad"].float(), columns.float(), **tolerance)
        assert got["grad"].dtype == logits.dtype


@pytest.mark.parametrize("name", list(workers.LINEAR_JOBS))
def test_split_lm_head_equals_one_process(runs, name):
    # The lm_head weight and bias split by vocabulary rows (a plain local shard, or a Shard(0) DTensor),
    # the same hidden states everywhere: the loss and per-token values of one process with the whole
    # weight, each process the gradient of its rows, and every process the whole hidden-state gradient.
    world, results = runs
    tensors, batch, keywords = workers.linear_inputs(name)
    leaves = {key: value.requires_grad_(True) for key, value in tensors.items()}
    want = dgpo_ops.fused_linear_dgpo_loss(leaves["hidden"], leaves["weight"], **batch, bias=leaves["bias"],
                                           **keywords)
    want.loss.backward()
    tolerance = dict(rtol=1e-9, atol=1e-9)  # float64: nothing but summation order
    for rank, result in enumerate(results):
        got = result[name]
        rows = workers.columns_of(rank, world)
        torch.testing.assert_close(got["loss"], want.loss.detach(), **tolerance)
        torch.testing.assert_close(got["logps"], want.logps, **tolerance)
        torch.testing.assert_close(got["entropy"], want.entropy, **tolerance)
        torch.testing.assert_close(got["metrics"], want.metrics.as_tensor(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["hidden"], leaves["hidden"].grad, **tolerance)
        torch.testing.assert_close(got["weight"], leaves["weight"].grad[rows], **tolerance)
        torch.testing.assert_close(got["bias"], leaves["bias"].grad[rows], **tolerance)


def test_bad_input_names_the_argument(runs):
    _, results = runs
    for result in results:
        assert "vocab_parallel_group" in result["error/uneven"] and "equal share" in result["error/uneven"]
        assert result["error/target"] is not None and "target" in result["error/target"]
        assert result["error/group"] is not None and "vocab_parallel_group" in result["error/group"]


def test_without_a_process_group_it_says_so():
    batch, keywords = workers.inputs_of(JOBS["bf16"])
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="vocab_parallel_group needs torch.distributed"):
        dgpo_ops.fused_dgpo_loss(batch.pop("logits"), **batch, **keywords, vocab_parallel_group=object())
