"""DeepSpeed ZeRO stage 3 with real processes (gloo, CPU): the fused-linear loss as DGPOTrainer computes
it (the op as the lm_head's forward, ``dgpo_ops.distributed.head``), with untied and tied embeddings, gives every
parameter the whole gradient of one process over the same global batch, and a bare partitioned weight
is refused.

Outside its module's forward a ZeRO-3 parameter is partitioned to 0 elements: the op must run inside
the head's forward, where ZeRO-3 gathers the weight and then reduces its gradient over the processes."""

from __future__ import annotations

import socket

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

import deepspeed_workers as workers
import fsdp_workers
from worlds import XDIST_GROUP, start_world

# The tests read one world that ran every job (zero3_runs): they run on one xdist worker.
pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed"),
              pytest.mark.xdist_group(XDIST_GROUP), pytest.mark.early]

WORLD = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory) -> tuple[list[dict], dict]:
    """Every job in one world (starting the processes and importing DeepSpeed is most of the time), and
    the one-process references (no DeepSpeed), computed here while the processes start."""
    out_dir = tmp_path_factory.mktemp("zero3")
    context = start_world(workers.deepspeed_worker, (WORLD, free_port(), str(out_dir), workers.JOBS),
                          nprocs=WORLD, join=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # three processes on the runner's cores; the model is tiny
        references = {job: workers.unsharded_result(*job) for job in workers.JOBS}
    finally:
        torch.set_num_threads(threads)
        while not context.join():
            pass
    results = [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return results, references


@pytest.mark.parametrize("case, method", workers.JOBS, ids=lambda value: str(value))
def test_zero3_gives_the_gradients_of_one_process(zero3_runs, case, method):
    # seq_mean_token_mean: each process's loss is the mean over its sequences, so ZeRO-3's gradient
    # average over the processes is the one process's gradient over the whole batch.
    results, references = zero3_runs
    reference = references[case, method]
    share = fsdp_workers.GLOBAL_BATCH // WORLD
    job = case, method
    for result in results:
        assert result[job]["head_numel"] == 0  # the head partitioned: its gathering and reduction were tested
    losses = torch.stack([result[job]["loss"] for result in results])
    torch.testing.assert_close(losses.mean(), reference["loss"], rtol=1e-5, atol=1e-6)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result[job]["logps"], reference["logps"][rank * share:(rank + 1) * share],
                                   rtol=1e-5, atol=1e-5)
    grads = results[0][job]["grads"]
    assert set(grads) == set(reference["grads"])
    assert ("lm_head.weight" in grads) != (case == "tied")  # tied: one parameter, named by the embedding
    for name, want in reference["grads"].items():
        assert want is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6,
                                   msg=lambda message, name=name: f"{case}: {name}: {message}")
    for result in results[1:]:  # every process ends with the same whole gradient
        for name, grad in result[job]["grads"].items():
            torch.testing.assert_close(grad, grads[name], rtol=0, atol=0)


def test_a_bare_partitioned_weight_is_refused(zero3_runs):
    # Outside the head's forward its ZeRO-3 weight has 0 elements: the op says to pass the module instead.
    results, _ = zero3_runs
    for result in results:
        assert result["bare_weight_numel"] == 0
        message = result["bare_weight_error"]
        assert message is not None and "ZeRO-3" in message and "model.lm_head" in message
