"""FSDP2 (and DDP) with real processes (gloo, CPU): the fused-linear loss as DGPOTrainer computes it,
under every wrapping a training job uses, gives the gradients of one process over the same global batch.

Before the op ran as the lm_head's forward (``dgpo_ops.distributed.head``), the head's own FSDP unit got a
gradient 100 % off (the head's forward never ran, so FSDP never reduced it) and the tied embedding
with the head as one unit 71 % off, with no error; these tests fail on that code."""

from __future__ import annotations

import functools

import fsdp_workers as workers
import pytest
import torch
from worlds import XDIST_GROUP, start_world

from dgpo_ops.ops.backends import triton_is_interpreted

# One start of each world for the module (runs_of): the tests run on one xdist worker, so each world starts
# once and the two one after the other (side by side, their gloo processes on two cores waited on each other).
pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed"),
              pytest.mark.xdist_group(XDIST_GROUP), pytest.mark.early]

FP32_CASES = [case for case, (_, mixed, _) in workers.CASES.items() if not mixed]
BF16_CASES = [case for case, (_, mixed, _) in workers.CASES.items() if mixed]


def run_world(tmp_path, world: int, jobs) -> list[dict]:
    start_world(workers.fsdp_worker, (world, str(tmp_path / "init"), str(tmp_path), jobs), nprocs=world)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return results


SEQUENCE_LEVEL_CASES = ["head_unit_reshard", "accelerate_tied"]
ON_CHIP_CASES = ["head_unit_reshard", "accelerate_tied"]
MODULE_CALL_CASES = ["head_unit_reshard", "tied_embedding_head_unit", "root_only"]


def jobs_for(world: int) -> list:
    """Everything a world runs, in one world (starting the processes is most of the time): every
    wrapping on 2 processes, GSPO with KL and (under the interpreter) the on-chip kernels on some."""
    jobs = [(case, "dgpo", False) for case in workers.CASES]
    if world == 2:
        jobs += [(case, "gspo", False) for case in SEQUENCE_LEVEL_CASES]
        jobs += [(case, "dgpo@module", False) for case in MODULE_CALL_CASES]
        if triton_is_interpreted():  # the Triton kernels on CPU tensors; the processes inherit TRITON_INTERPRET
            jobs += [(case, "dgpo", True) for case in ON_CHIP_CASES]
    return jobs


_RUNS: dict[int, list[dict]] = {}


def runs_of(world: int, tmp_path_factory) -> tuple[int, list[dict]]:
    if world not in _RUNS:  # one start per world for the whole module
        _RUNS[world] = run_world(tmp_path_factory.mktemp(f"fsdp{world}"), world, jobs_for(world))
    return world, _RUNS[world]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"{world}ranks")
def fsdp_runs(request, tmp_path_factory):
    return runs_of(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    return runs_of(2, tmp_path_factory)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


@functools.cache
def one_process(case: str, method: str) -> dict:
    """One process's loss, log-probs and gradients over the whole batch: the same for every world size and for
    the on-chip kernels (a model built and run once per case, not once per test)."""
    return workers.unsharded_result(case, method)


def check_against_one_process(world, results, case, method="dgpo", on_chip=False, tolerance=None):
    """The processes' losses average to one process's loss over the whole batch, their log-probs are
    its rows, and every whole gradient is its gradient (the one-process reference takes the tile path;
    the on-chip kernels agree with it to fp32 rounding)."""
    reference = one_process(case, method.partition("@")[0])
    share = workers.GLOBAL_BATCH // world
    job = (case, method, on_chip)
    losses = torch.stack([result[job]["loss"] for result in results])
    grads = results[0][job]["grads"]
    assert set(grads) == set(reference["grads"])
    if tolerance is None:  # fp32: the same numbers up to summation order
        torch.testing.assert_close(losses.mean(), reference["loss"], rtol=1e-5, atol=1e-6)
        for rank, result in enumerate(results):
            torch.testing.assert_close(result[job]["logps"], reference["logps"][rank * share:(rank + 1) * share],
                                       rtol=1e-5, atol=1e-5)
        for name, want in reference["grads"].items():
            assert want is not None and grads[name] is not None, f"{case}: {name}"
            torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=f"{case}: {name}")
    else:  # bf16 parameters: every gradient within bf16 rounding of the fp32 one
        assert abs(float(losses.mean() - reference["loss"])) < tolerance * max(1.0, abs(float(reference["loss"])))
        for name, want in reference["grads"].items():
            assert relative_error(grads[name], want) < tolerance, f"{case}: {name}"
    for result in results[1:]:  # every process ends with the same whole gradient
        for name, grad in result[job]["grads"].items():
            torch.testing.assert_close(grad, grads[name], rtol=0, atol=0)


@pytest.mark.parametrize("case", FP32_CASES)
def test_wrapping_gives_the_gradients_of_one_process(fsdp_runs, case):
    world, results = fsdp_runs
    check_against_one_process(world, results, case)


@pytest.mark.parametrize("case", BF16_CASES)
def test_fsdp2_bf16_mixed_precision_within_bf16_rounding(fsdp_runs, case):
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the products in bf16, as the model's own
    # lm_head would run them; 2 % is bf16 rounding (measured 2.1e-2 at worst, on a bias), an unreduced
    # gradient is 50-100 % off.
    world, results = fsdp_runs
    check_against_one_process(world, results, case, tolerance=5e-2)


def test_a_bare_sharded_weight_is_refused(fsdp_runs):
    # Outside the head's forward its weight is a Shard(0) DTensor: gathering it would give a gradient
    # FSDP never reduces, so the op refuses it and says what to pass instead.
    _, results = fsdp_runs
    for result in results:
        message = result["bare_dtensor_error"]
        assert message is not None and "Shard(dim=0)" in message and "model.lm_head" in message


@pytest.mark.parametrize("case", SEQUENCE_LEVEL_CASES)
def test_fsdp2_sequence_level_with_kl(two_process_runs, case):
    # GSPO's sequence ratio (a second sweep recomputes the tiles) and a k3 KL.
    world, results = two_process_runs
    check_against_one_process(world, results, case, "gspo")


@pytest.mark.skipif(not triton_is_interpreted(), reason="the on-chip kernels run here through the Triton interpreter")
@pytest.mark.parametrize("case", ON_CHIP_CASES)
def test_fsdp2_logits_on_chip(two_process_runs, case):
    # The on-chip kernels (Triton interpreter on CPU) under FSDP2, against the one-process tile path.
    world, results = two_process_runs
    check_against_one_process(world, results, case, on_chip=True)


@pytest.mark.parametrize("case", MODULE_CALL_CASES)
def test_fsdp2_the_public_call_with_the_head_module(two_process_runs, case):
    # fused_linear_dgpo_loss(hidden, model.lm_head, ...) after the model's forward, as the error for a
    # bare sharded weight tells a user to call it: the op runs as the head's forward there too.
    world, results = two_process_runs
    check_against_one_process(world, results, case, "dgpo@module")
