"""The row kernels themselves: Triton (interpreter) against the torch twins, tiles, launch grid,
the interpreter guard, and the memory the CPU path allocates."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import dgpo_ops
from dgpo_ops.kernels import logits_grad as grad_module
from dgpo_ops.kernels import logprob_entropy as forward_module
from dgpo_ops.kernels.torch_twins import logits_grad_torch, logprob_entropy_torch
from helpers import logits_batch


def row_inputs(B, T, V, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    return logits, target, mask


@pytest.mark.parametrize("V, block_v", [(1000, 128), (37, 16), (64, 64), (129, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_tiles_match_the_twin(V, block_v, dtype):
    logits, target, mask = row_inputs(2, 5, V, dtype=dtype)
    got = forward_module.logprob_entropy(logits, target, mask, 1 / 0.9, block_v=block_v)
    want = logprob_entropy_torch(logits, target, mask, 1 / 0.9)
    for name in ("row_max", "log_norm", "logp", "entropy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("V, block_v", [(1000, 128), (37, 16)])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_backward_tiles_match_the_twin(V, block_v, with_entropy):
    logits, target, mask = row_inputs(2, 5, V, seed=1)
    rows = logprob_entropy_torch(logits, target, mask, 1.3)
    g = torch.randn(2, 5) * mask
    h = torch.randn(2, 5) * mask if with_entropy else None
    got = grad_module.logits_grad(logits, torch.empty_like(logits), target, rows.row_max, rows.log_norm, rows.entropy, g, h, 1.3,
                                  block_v=block_v)
    want = logits_grad_torch(logits, torch.empty_like(logits), target, rows.row_max, rows.log_norm, rows.entropy, g, h, 1.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert got[~mask].abs().max() == 0


def test_twin_chunks_match_one_chunk():
    logits, target, mask = row_inputs(3, 7, 50, seed=2)
    whole = logprob_entropy_torch(logits, target, mask, 1.0)
    chunked = logprob_entropy_torch(logits, target, mask, 1.0, chunk_rows=4)
    torch.testing.assert_close(chunked.log_norm, whole.log_norm)
    g = torch.randn(3, 7)
    a = logits_grad_torch(logits, torch.empty_like(logits), target, whole.row_max, whole.log_norm, whole.entropy, g, None, 1.0)
    b = logits_grad_torch(logits, torch.empty_like(logits), target, whole.row_max, whole.log_norm, whole.entropy, g, None, 1.0,
                          chunk_rows=4)
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
    monkeypatch.setattr(forward_module, "logprob_entropy_fwd_kernel", recorder)
    monkeypatch.setattr(grad_module, "logits_grad_kernel", recorder)
    logits = torch.empty(1, 70_000, 8)
    target = torch.zeros(1, 70_000, dtype=torch.long)
    mask = torch.ones(1, 70_000, dtype=torch.bool)
    rows = forward_module.logprob_entropy(logits, target, mask, 1.0)
    grad_module.logits_grad(logits, logits, target, rows.row_max, rows.log_norm, rows.entropy, rows.logp, None, 1.0)
    assert recorder.grids == [(70_000,), (70_000,)]


def test_triton_backend_on_cpu_without_the_interpreter_says_how_to_enable_it():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch, dgpo_ops\n"
        "try:\n"
        "    dgpo_ops.fused_dgpo_loss(torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), torch.ones(1),"
        " backend='triton')\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "TRITON_INTERPRET=1" in out


def largest_allocations(fn) -> list[int]:
    """Bytes each op allocated itself while fn runs, largest first: an upper bound on every single
    allocation (an op that made two buffers counts as one of their sum, which only errs strict)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    return sorted(sizes, reverse=True)


@pytest.mark.parametrize("inplace", [False, True])
def test_cpu_path_allocates_no_vocabulary_sized_temporaries(inplace):
    N, V = 2048, 8192  # N * V = 2^24 elements; one torch-twin chunk holds 2^22
    inputs = logits_batch(1, N, V, seed=3, dtype=torch.bfloat16)
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
