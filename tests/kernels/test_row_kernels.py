"""The kernels themselves: each Triton kernel (interpreter) against its torch twin, tiles, the launch
grid, the interpreter guard, the exhaustive method switch, and the memory the CPU path allocates."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from helpers import TOKEN_LEVEL_VARIANTS, largest_allocations, logits_batch, variant_id

import dgpo_ops
from dgpo_ops.core.aggregation import AGGREGATIONS
from dgpo_ops.core.inputs import LossInputs, normalizer_spec, token_inputs
from dgpo_ops.kernels import finalize as finalize_module
from dgpo_ops.kernels import logits_grad as grad_module
from dgpo_ops.kernels import logprob_entropy as forward_module
from dgpo_ops.kernels import prologue as prologue_module
from dgpo_ops.kernels import torch_twins
from dgpo_ops.kernels.interface import Denominator, Plane, SequenceStat, Status
from dgpo_ops.kernels.row_io import RowWorkspace
from dgpo_ops.kernels.torch_twins import logits_grad_torch, logprob_entropy_torch, token_prologue_torch

import dgpo_ops
from dgpo_ops.core.aggregation import AGGREGATIONS
from dgpo_ops.core.inputs import LossInputs, normalizer_spec, token_inputs

REPO = pathlib.Path(__file__).resolve().parents[2]


def row_inputs(B, T, V, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    return logits, target, mask


def workspace_after_prologue(logits, target, mask, prologue=token_prologue_torch, aggregation="token_mean",
                             loss_normalizer=None, **per_token):
    loss_batch = LossInputs(target, per_token.pop("advantages", torch.ones(logits.shape[0])), mask, **per_token)
    batch = token_inputs(logits.shape, logits.dtype, logits.device, loss_batch, aggregation=aggregation)
    workspace = RowWorkspace.allocate(logits.shape[:-1], batch.grid[0], logits.device)
    prologue(batch, workspace.sequence_stats, workspace.seq_scale, workspace.status, logits.shape[-1],
             AGGREGATIONS[aggregation], normalizer_spec(loss_normalizer, logits.device))
    return batch, workspace


PROLOGUE_CASES = {
    "token_mean": dict(),
    "seq_mean_token_mean": dict(aggregation="seq_mean_token_mean"),
    "seq_mean_token_sum_norm": dict(aggregation="seq_mean_token_sum_norm"),
    "seq_sum_token_mean": dict(aggregation="seq_sum_token_mean"),
    "normalizer_value": dict(loss_normalizer=13.0),
    "normalizer_tensor": dict(loss_normalizer="tensor"),
    "int_mask_and_per_token_floats": dict(int_mask=True, floats=True),
    "bad_target": dict(bad="target"),
    "bad_mask": dict(bad="mask"),
    "nan_old_logps": dict(bad="old", floats=True),
    "bad_normalizer": dict(loss_normalizer="zero"),
}


@pytest.mark.parametrize("case", list(PROLOGUE_CASES))
def test_prologue_matches_the_twin(case):
    options = dict(PROLOGUE_CASES[case])
    logits, target, mask = row_inputs(3, 37, 20, seed=1)
    target[0, 5] = -100
    per_token = {}
    if options.pop("floats", False):
        per_token = dict(old_logps=-torch.rand(3, 37), ref_logps=-torch.rand(3, 37),
                         rollout_weights=torch.rand(3, 37), advantages=torch.randn(3, 37))
    if options.pop("int_mask", False):
        mask = mask.to(torch.int32)
    bad = options.pop("bad", None)
    if bad == "target":
        target[2, 30], target[1, 4] = 25, -3  # the first in row-major order is reported: -3
    elif bad == "mask":
        mask = mask.to(torch.float32)
        mask[1, 1] = 0.5
    elif bad == "old":
        per_token["old_logps"][2, 36] = float("nan")
        mask[2, 36] = True
    normalizer = options.pop("loss_normalizer", None)
    normalizer = {"tensor": torch.tensor(6.0), "zero": torch.tensor(0.0)}.get(normalizer, normalizer)
    results = []
    for prologue in (prologue_module.token_prologue, token_prologue_torch):
        _, workspace = workspace_after_prologue(logits, target, mask, prologue, loss_normalizer=normalizer,
                                                **dict(per_token), **options)
        results.append(workspace)
    got, want = results
    assert torch.equal(got.status[:Status.ARRIVED], want.status[:Status.ARRIVED])
    assert got.status[Status.ARRIVED] == 3  # every program arrived
    assert torch.equal(got.sequence_stats[SequenceStat.TOKENS], want.sequence_stats[SequenceStat.TOKENS])
    torch.testing.assert_close(got.seq_scale, want.seq_scale, rtol=0, atol=0, equal_nan=True)
    if bad == "target":
        assert got.status[Status.BAD_TARGET] == -3
    assert (got.status[Status.ERRORS] != 0) == (bad is not None or normalizer is not None and case == "bad_normalizer")


@pytest.mark.parametrize("V, block_v", [(1000, 128), (37, 16), (64, 64), (129, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_tiles_match_the_twin(V, block_v, dtype):
    logits, target, mask = row_inputs(2, 5, V, dtype=dtype)
    batch, got = workspace_after_prologue(logits, target, mask)
    _, want = workspace_after_prologue(logits, target, mask)
    target[1, 2] = -100
    mask[0, 0] = False
    forward_module.logprob_entropy(logits, batch, got, 1 / 0.9, block_v=block_v)
    logprob_entropy_torch(logits, batch, want, 1 / 0.9)
    assert torch.equal(got.target_index, want.target_index)
    assert got.target_index[7] == -1 and got.target_index[0] == -1
    for plane in (Plane.ROW_MAX, Plane.LOG_NORM, Plane.LOGP, Plane.ENTROPY):
        torch.testing.assert_close(got.per_token[plane], want.per_token[plane], rtol=1e-5, atol=1e-5, msg=plane.name)


@pytest.mark.parametrize("V, block_v", [(1000, 128), (37, 16)])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
@pytest.mark.parametrize("scaled", [False, True])
def test_backward_tiles_match_the_twin(V, block_v, entropy_coef, scaled):
    logits, target, mask = row_inputs(2, 5, V, seed=1)
    batch, workspace = workspace_after_prologue(logits, target, mask, aggregation="seq_mean_token_mean")
    logprob_entropy_torch(logits, batch, workspace, 1.3)
    workspace.per_token[Plane.DLOSS_DLOGP] = torch.randn(2, 5)
    coefficient = torch.randn(10) if scaled else None
    grad_loss = torch.tensor(0.7)
    got = grad_module.logits_grad(logits, torch.empty_like(logits), workspace, 5, 1.3, entropy_coef, grad_loss,
                                  coefficient, block_v=block_v)
    want = logits_grad_torch(logits, torch.empty_like(logits), workspace, 5, 1.3, entropy_coef, grad_loss, coefficient)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert got[~mask].abs().max() == 0


def test_finalize_matches_the_torch_metrics():
    inputs = logits_batch(3, 7, 40, seed=5, ref_logps=True)
    out = dgpo_ops.fused_dgpo_loss(**inputs, backend="triton", method="grpo", dual_clip=3.0, beta=0.1)
    ref = dgpo_ops.fused_dgpo_loss(**inputs, backend="torch", method="grpo", dual_clip=3.0, beta=0.1)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-7)
    for name in ref.metrics:
        torch.testing.assert_close(out.metrics[name], ref.metrics[name], rtol=1e-6, atol=1e-7, msg=name)
    assert all(out.metrics[name] > 0 for name in ("ln_fraction", "hp_fraction", "lp_fraction", "hn_fraction",
                                                  "dual_clip_fraction", "kl_mean"))


@pytest.mark.parametrize("variant", TOKEN_LEVEL_VARIANTS, ids=variant_id)
def test_the_twin_epilogue_writes_the_triton_epilogues_planes(variant):
    """The torch twins evaluate a token-level method where they finish a chunk of rows (dgpo_ops.ops.epilogues)
    and finalize it (finalize_torch) as the Triton row kernel's epilogue and finalize do: the same planes, loss and
    metrics for every token-level method, with a KL times the ratio, an entropy bonus and rollout weights."""
    from dgpo_ops.core.options import LossOptions
    from dgpo_ops.ops.logits import forward_pass, logits_plan

    name, params = variant
    inputs = logits_batch(3, 7, 40, seed=5, ref_logps=True)
    weights = torch.rand(3, 7, generator=torch.Generator().manual_seed(5)) + 0.5
    batch = LossInputs(inputs["target_ids"], inputs["advantages"], inputs["mask"], inputs["old_logps"],
                      inputs["ref_logps"], weights)
    results = []
    for backend in ("triton", "torch"):
        options = LossOptions.build(name, backend=backend, beta=0.1, kl_ratio_correction=True, entropy_coef=0.02,
                                    **params)
        plan = logits_plan(inputs["logits"], batch, options, needs_grad=True)
        workspace, loss, stats, coefficient = forward_pass(inputs["logits"], plan)
        assert plan.uses_epilogue and coefficient is None  # the coefficients are the epilogue's plane
        results.append((workspace, loss, stats))
    (got, got_loss, got_stats), (want, want_loss, want_stats) = results
    scored = want.target_index >= 0
    assert torch.equal(got.target_index, want.target_index) and scored.any() and not scored.all()
    for plane in (Plane.TOKEN_LOSS, Plane.DLOSS_DLOGP, Plane.RATIO, Plane.PSI, Plane.REGION, Plane.KL):
        torch.testing.assert_close(got.planes()[plane][scored], want.planes()[plane][scored], rtol=1e-5, atol=1e-6,
                                   msg=plane.name)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_stats, want_stats, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bad", [False, True])
def test_the_finalizing_prologue_equals_the_finalize_kernel(bad):
    # The logits op reduces the loss and metrics in the prologue's last program; the fused-linear op
    # launches finalize_kernel. Both must give the same bits from the same planes.
    from dgpo_ops.core.options import LossOptions
    from dgpo_ops.ops.logits import forward_pass, logits_plan

    inputs = logits_batch(5, 9, 40, seed=11, ref_logps=True)
    if bad:
        inputs["target_ids"][3, 2] = 40  # out of range: the loss must come out NaN either way
    batch = LossInputs(inputs["target_ids"], inputs["advantages"], inputs["mask"], inputs["old_logps"],
                      inputs["ref_logps"])
    options = LossOptions.build("grpo", beta=0.1, dual_clip=3.0, backend="triton", validation="deferred")
    plan = logits_plan(inputs["logits"], batch, options, needs_grad=False)
    workspace, loss, stats, _ = forward_pass(inputs["logits"], plan)
    finalized = (loss.clone(), stats.clone())
    assert workspace.status[Status.ARRIVED] == 5
    loss.fill_(123.0)
    stats.fill_(123.0)
    finalize_module.finalize(workspace, plan.grid_seq_len, plan.has_kl)
    torch.testing.assert_close((loss, stats), finalized, rtol=0, atol=0, equal_nan=True)
    assert loss.isnan().item() == bad
    assert (stats[:5] > 0).all()  # every region and the dual clip occur: the counts were reduced
    if bad:
        with pytest.raises(ValueError, match="target_ids"):
            dgpo_ops.raise_deferred_errors()


@pytest.mark.parametrize("shape", [(0, 5, 11), (0, 11), (2, 0, 11)], ids=["no_responses", "no_tokens_flat", "T0"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_an_empty_batch_has_loss_zero(backend, shape):
    # No prologue program runs when there is no response: the loss and metrics still come out 0, as
    # the reference's sum over no tokens, not whatever the allocator left in the buffers.
    logits = torch.randn(*shape, requires_grad=True)
    target = torch.zeros(shape[:-1], dtype=torch.long)
    advantages = torch.ones(shape[0]) if len(shape) == 3 else torch.ones(shape[:-1])
    out = dgpo_ops.fused_dgpo_loss(logits, target, advantages, backend=backend, validation="deferred", beta=0.0)
    out.loss.backward()
    dgpo_ops.raise_deferred_errors()
    assert out.loss.item() == 0.0
    assert all(value.item() == 0.0 for value in out.metrics.values())
    assert logits.grad.shape == logits.shape


def test_twin_chunks_match_one_chunk():
    logits, target, mask = row_inputs(3, 7, 50, seed=2)
    batch, whole = workspace_after_prologue(logits, target, mask)
    _, chunked = workspace_after_prologue(logits, target, mask)
    logprob_entropy_torch(logits, batch, whole, 1.0)
    logprob_entropy_torch(logits, batch, chunked, 1.0, chunk_rows=4)
    rows = slice(Plane.ROW_MAX, Plane.ENTROPY + 1)  # the planes the row twin writes
    torch.testing.assert_close(chunked.per_token[rows], whole.per_token[rows])
    whole.per_token[Plane.DLOSS_DLOGP] = torch.randn(3, 7)
    a = logits_grad_torch(logits, torch.empty_like(logits), whole, 7, 1.0, 0.0)
    b = logits_grad_torch(logits, torch.empty_like(logits), whole, 7, 1.0, 0.0, chunk_rows=4)
    torch.testing.assert_close(a, b)


class RecordingKernel:
    """Stands in for a Triton kernel: records the launch grid instead of running."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_long_completions_launch_on_grid_axis_zero(monkeypatch):
    # 70,000 tokens in one response: past CUDA's 65,535 cap on grid axes 1 and 2.
    recorder = RecordingKernel()
    monkeypatch.setattr(dgpo_ops.ops.backends, "triton_is_interpreted", lambda: True)
    for module, name in ((forward_module, "logprob_entropy_fwd_kernel"), (grad_module, "logits_grad_kernel"),
                         (prologue_module, "token_prologue_kernel"), (finalize_module, "finalize_kernel")):
        monkeypatch.setattr(module, name, recorder)
    logits = torch.empty(1, 70_000, 8)
    target = torch.zeros(1, 70_000, dtype=torch.long)
    dgpo_ops.fused_dgpo_loss(logits.requires_grad_(True), target, torch.ones(1), backend="triton",
                             validation="deferred").loss.backward()
    dgpo_ops.raise_deferred_errors()
    assert recorder.grids == [(70_000,), (1,), (70_000,)]  # rows, prologue per response (it finalizes), rows


# Three checks that need Triton's real compiler, not the interpreter, run by one process without TRITON_INTERPRET
# (uninterpreted, below): a process of their own each spent most of its time importing torch, Triton and the
# package. Each check runs in its own try, its outcome (printed lines, or the traceback) kept for its test.
UNINTERPRETED_CHECKS = """
import contextlib, io, json, traceback


def outcome(check):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            check()
    except Exception:
        return {"lines": out.getvalue().splitlines(), "error": traceback.format_exc()}
    return {"lines": out.getvalue().splitlines(), "error": None}


def cpu_message():  # first: before anything but torch and the package is imported, as a user's script
    import torch, dgpo_ops
    try:
        dgpo_ops.fused_dgpo_loss(torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), torch.ones(1),
                                 backend='triton')
    except ValueError as e:
        print(e)


def first_cause(error):
    cause = error
    while cause.__cause__ is not None:  # the assert sits in a helper the kernel calls
        cause = cause.__cause__
    return cause


def method_ids():
    import triton
    from triton.backends.compiler import GPUTarget
    from bench import aot
    spec = aot._forward('fp32')
    for method in (int(aot.MethodId.SAPO), 99):
        try:
            triton.compile(aot._source(spec, {'METHOD': method}), target=GPUTarget('cuda', 90, 32),
                           options=aot.LAUNCH['forward'])
            print(method, 'compiled')
        except Exception as error:
            cause = first_cause(error)
            print(method, 'failed', type(cause).__name__, 'unknown METHOD id' in str(cause))


def denominators():
    import triton
    from triton.backends.compiler import GPUTarget
    from bench import aot
    spec = aot._prologue(False)
    for name, value in (('DENOMINATOR', int(aot.Denominator.ONE)), ('DENOMINATOR', 99), ('NORMALIZER', 99)):
        try:
            triton.compile(aot._source(spec, {name: value}), target=GPUTarget('cuda', 90, 32),
                           options=aot.LAUNCH['prologue'])
            print(name, value, 'compiled')
        except Exception as error:
            cause = first_cause(error)
            print(name, value, 'failed', type(cause).__name__, f'unknown {name}' in str(cause))


print(json.dumps({check.__name__: outcome(check) for check in (cpu_message, method_ids, denominators)}))
"""


# the tests that read the process: one xdist worker runs it, once
UNINTERPRETED_GROUP = pytest.mark.xdist_group("row_kernels_uninterpreted")


@pytest.fixture(scope="module")
def uninterpreted() -> dict:
    """Each of UNINTERPRETED_CHECKS' checks: its printed lines, and its traceback or None."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", UNINTERPRETED_CHECKS], env=env, cwd=REPO, capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def checked(outcome: dict) -> list[str]:
    assert outcome["error"] is None, outcome["error"]
    return outcome["lines"]


@UNINTERPRETED_GROUP
def test_an_unknown_method_id_does_not_compile(uninterpreted):
    # kernel_token_terms names every MethodId and static_asserts otherwise: no silent fall-through to a method.
    # The compile report's specialisations (bench/aot.py) build the kernel source.
    from bench import aot

    spec = aot._forward("fp32")
    assert spec.kernel == "forward"
    out = checked(uninterpreted["method_ids"])
    assert out == ["6 compiled", "99 failed CompileTimeAssertionFailure True"], out


@UNINTERPRETED_GROUP
def test_an_unknown_denominator_or_normalizer_does_not_compile(uninterpreted):
    # The prologue's DENOMINATOR and NORMALIZER branches name every member and static_assert otherwise: a new
    # Denominator is a compile error, never another one's count.
    out = checked(uninterpreted["denominators"])
    assert out == [f"DENOMINATOR {int(Denominator.ONE)} compiled",
                   "DENOMINATOR 99 failed CompileTimeAssertionFailure True",
                   "NORMALIZER 99 failed CompileTimeAssertionFailure True"], out


def test_every_denominator_has_one_size_in_the_twins(monkeypatch):
    # the torch twins' and the reference's denominators: counted from the scored tokens or fixed by the grid
    torch_twins.check_denominators()
    with monkeypatch.context() as patch:
        patch.delitem(torch_twins.COUNTED_DENOMINATORS, Denominator.SCORED_RESPONSES)
        with pytest.raises(AssertionError, match="every Denominator needs one size"):
            torch_twins.check_denominators()
    monkeypatch.setitem(torch_twins.FIXED_DENOMINATORS, Denominator.TOKENS, lambda n_responses, width: 1)
    with pytest.raises(AssertionError, match="every Denominator needs one size"):
        torch_twins.check_denominators()


@UNINTERPRETED_GROUP
def test_triton_backend_on_cpu_without_the_interpreter_says_how_to_enable_it(uninterpreted):
    assert "TRITON_INTERPRET=1" in "\n".join(checked(uninterpreted["cpu_message"]))


@pytest.mark.parametrize("inplace", [False, True])
def test_cpu_path_allocates_no_vocabulary_sized_temporaries(inplace):
    N, V = 2048, 8192  # N * V = 2^24 elements; one torch-twin chunk holds 2^22
    inputs = logits_batch(1, N, V, seed=3, dtype=torch.bfloat16, ref_logps=True)
    logits = inputs.pop("logits").requires_grad_(True)
    produced = logits * 1.0  # a non-leaf, as from a model
    holder = {}

    def forward():
        holder["out"] = dgpo_ops.fused_dgpo_loss(produced, **inputs, backend="torch", inplace=inplace,
                                                 entropy_coef=0.01, beta=0.01)

    forward_sizes = largest_allocations(forward)
    assert forward_sizes[0] < N * V * 4, "an (N, V) fp32 temporary in forward"

    backward_sizes = largest_allocations(lambda: torch.autograd.grad(holder["out"].loss, produced))
    logits_sized = [s for s in backward_sizes if s >= N * V * produced.element_size()]
    assert len(logits_sized) == (0 if inplace else 1), backward_sizes[:4]


def test_host_launch_arithmetic_equals_tritons():
    # The launch wrappers size grids and blocks with plain-Python twins of triton.next_power_of_2 and
    # triton.cdiv (Triton's are ConstexprFunction objects, several microseconds a call on the host).
    import triton
    from dgpo_ops.kernels.interface import cdiv, next_power_of_2

    for n in [*range(0, 5000), 65_535, 65_536, 65_537, 151_936, 262_144, 2**31 - 1, 2**31]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in [*range(0, 600), 151_936, 2**31 + 5]:
        for b in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    with pytest.raises(ValueError):
        next_power_of_2(-1)
