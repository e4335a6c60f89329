"""Every framework row over a whole data-parallel step: two gloo ranks (real processes) of three micro-batches each
(ragged and fully masked responses, a micro-batch without a scored token), the ranks' gradients averaged as DDP
does, dgpo-ops with ``aggregation="framework:mode"`` and the row's step normaliser (``N / dp_size``,
``dgpo_ops.frameworks.step_normalizer``) against the framework's own step (``dp_steps.STEPS``): the released code
of TRL (``GRPOTrainer._compute_loss``, every loss type's objective and normalisation; the main suite's trl), of verl
(``agg_loss`` with the global batch info; the venv of .ci/verl_cpu.sh) and of OpenRLHF, SkyRL and AReaL (the venv
of .ci/frameworks_cpu.sh), where installed, else skipped with what installs it; ROLL's and NeMo-RL's re-derived
from their source."""

from __future__ import annotations

import functools
import importlib.metadata as md
import pathlib
import tempfile

import dp_steps
import pytest
import torch
from worlds import XDIST_GROUP, start_world

from dgpo_ops.frameworks import FRAMEWORK_AGGREGATIONS, FRAMEWORKS

# One world per framework for the module (world_gradients, cached in the test process): the tests run on one
# xdist worker, or a framework's rows on both workers started its world twice, side by side.
pytestmark = pytest.mark.xdist_group(XDIST_GROUP)


def installed(step: dp_steps.Step) -> bool:
    if step.distribution is None:
        return True
    try:
        found = md.version(step.distribution)
    except md.PackageNotFoundError:
        return False
    assert found == step.version, f"{step.distribution} {found} is installed; the step reads {step.version}'s code"
    return True


@functools.cache
def world_gradients(framework: str) -> dict:
    """Rank 0's gradients of every row of ``framework`` (ours, theirs), after checking every rank holds the
    same averaged gradients."""
    with tempfile.TemporaryDirectory() as folder:
        start_world(dp_steps.worker, (dp_steps.DP, str(pathlib.Path(folder) / "init"), folder, framework),
                    nprocs=dp_steps.DP)
        results = [torch.load(pathlib.Path(folder) / f"rank{rank}.pt") for rank in range(dp_steps.DP)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    for name, pair in results[0]["gradients"].items():
        for other in results[1:]:
            for ours_or_theirs, again in zip(pair, other["gradients"][name]):
                torch.testing.assert_close(again, ours_or_theirs, rtol=0, atol=0)  # the all-reduced mean
    return results[0]["gradients"]


ROWS = [name for name in FRAMEWORK_AGGREGATIONS]


def test_every_framework_with_rows_has_its_step():
    assert {name for name, spec in FRAMEWORKS.items() if spec.aggregations} == set(dp_steps.STEPS)


@pytest.mark.parametrize("name", ROWS)
def test_a_rows_step_over_two_ranks_is_the_frameworks(name):
    framework = name.split(":", 1)[0]
    step = dp_steps.STEPS[framework]
    if not installed(step):
        pytest.skip(f"{step.distribution} is not installed ({step.where} installs "
                    f"{step.distribution}=={step.version})")
    ours, theirs = world_gradients(framework)[name]
    assert theirs.abs().max() > 1e-3  # a step that moves the weights
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)  # the frameworks' + 1e-8 in their means
