"""What is particular to the on-chip fused-linear kernels (``logits_on_chip=True``: logits only in
registers): vocabulary splits, strided operands, skipped blocks, no tile buffers, the errors. Their
parity with the fp64 reference for every method and precision is in ``tests/ops/test_fused_linear.py`` (the
``on_chip`` path), under the Triton interpreter here and on CUDA in ``tests/ops/test_cuda.py``."""

from __future__ import annotations

import pytest
import torch
from dgpo_ops.kernels.linear_logits import PARTIALS_SHAPE, check_hidden_strides, vocabulary_splits
from helpers import largest_allocations, linear_case, make_logits

import dgpo_ops


def test_vocabulary_splits_cover_the_vocabulary_once():
    for n_tokens, vocab in [(1, 70), (16, 4096), (8192, 151_936), (100, 129), (5, 128)]:
        splits, width = vocabulary_splits(n_tokens, vocab, PARTIALS_SHAPE)
        assert width % PARTIALS_SHAPE.block_v == 0
        assert (splits - 1) * width < vocab <= splits * width  # every split holds a column, none is left over


def test_many_vocabulary_splits_merge_exactly():
    # A wide vocabulary over few tokens: the partials kernel splits it, the rows kernel merges.
    (hidden, weight, bias), inputs = linear_case(B=1, T=3, V=1000, seed=4)
    assert vocabulary_splits(3, 1000, PARTIALS_SHAPE.fitted(3, 1000, 16))[0] > 1
    ref = dgpo_ops.reference_loss(make_logits(hidden.double(), weight.double(), bias.double()), **inputs,
                                  entropy_coef=0.1)
    out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, bias=bias, entropy_coef=0.1, backend="triton",
                                          logits_on_chip=True)
    torch.testing.assert_close(out.logps.double(), ref.logps.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ref.entropy.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_blocks_without_a_gradient_are_skipped_exactly(entropy_coef):
    # 64-token blocks that line up with responses: one with A = 0, one fully masked, one live. The
    # gradient kernel skips the products of blocks where no row has a gradient (with an entropy bonus
    # every scored row has one); the result must equal the reference either way.
    (hidden, weight, bias), inputs = linear_case(B=3, T=64, V=70, H=16, seed=8)
    inputs["advantages"] = torch.tensor([0.0, 1.0, -0.7])
    inputs["mask"][1] = False
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = dgpo_ops.reference_loss(make_logits(*ref_leaves), **inputs, entropy_coef=entropy_coef)
    out = dgpo_ops.fused_linear_dgpo_loss(leaves[0], leaves[1], **inputs, bias=leaves[2], backend="triton",
                                          logits_on_chip=True, entropy_coef=entropy_coef)
    torch.testing.assert_close(out.loss.double(), ref.loss.double(), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.loss, leaves)
    for got, want in zip(grads, torch.autograd.grad(ref.loss, ref_leaves)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    assert grads[0][1].abs().max() == 0 and grads[0][2].abs().max() > 0
    assert (grads[0][0].abs().max() > 0) == (entropy_coef != 0.0)


def test_no_tile_buffers():
    N, H, V = 256, 8, 2048  # a weight smaller than 16 rows of logits
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    target = torch.randint(0, V, (1, N), generator=g)

    def step():
        out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, target, torch.ones(1), backend="triton",
                                              logits_on_chip=True)
        out.loss.backward()

    sizes = largest_allocations(step)
    # nothing as large as 16 rows of logits (the tile path's default budget holds all 256 rows)
    assert sizes[0] < 16 * V * 4, sizes[:3]
    assert torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0


@pytest.mark.parametrize("layout", ["strided_bias", "transposed_weight", "sliced_hidden"])
def test_strided_operands(layout):
    # Every operand is read through its own strides: a bias column of a wider tensor, a weight that is
    # the transpose of an (H, V) tensor (tied embeddings stored the other way), hidden sliced in time.
    (hidden, weight, bias), inputs = linear_case(B=2, T=5, V=70, seed=6)
    if layout == "strided_bias":
        bias = torch.stack([bias, torch.randn_like(bias)], dim=1)[:, 0]
    elif layout == "transposed_weight":
        weight = weight.t().contiguous().t()
    else:
        hidden = torch.cat([hidden, torch.randn(2, 1, hidden.shape[-1])], dim=1)[:, :-1]
    assert not (bias.is_contiguous() and weight.is_contiguous() and hidden.is_contiguous())
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref = dgpo_ops.reference_loss(make_logits(*(t.double() for t in leaves)), **inputs)
    out = dgpo_ops.fused_linear_dgpo_loss(leaves[0], leaves[1], **inputs, bias=leaves[2], backend="triton",
                                          logits_on_chip=True)
    torch.testing.assert_close(out.logps.double(), ref.logps.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss.double(), ref.loss.double(), rtol=1e-5, atol=1e-6)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    want = torch.autograd.grad(dgpo_ops.reference_loss(make_logits(*ref_leaves), **inputs).loss, ref_leaves)
    for got, expected in zip(torch.autograd.grad(out.loss, leaves), want):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-6)


def test_hidden_axis_offsets_must_fit_int32():
    wide = torch.empty_strided((4, 3), (1, 2**30), device="meta")  # stride x H = 3 * 2^30
    with pytest.raises(ValueError, match="hidden-axis stride times H reaches 2"):
        check_hidden_strides(wide, torch.empty((5, 3), device="meta"))
    check_hidden_strides(torch.empty((4, 3), device="meta"), torch.empty((5, 3), device="meta"))


def test_needs_the_triton_kernels():
    (hidden, weight, bias), inputs = linear_case()
    with pytest.raises(ValueError, match="logits_on_chip=True runs Triton kernels"):
        dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, backend="torch", logits_on_chip=True)
    with pytest.raises(ValueError, match="logits_on_chip"):
        dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, backend="triton", logits_on_chip="yes")
    with pytest.raises(ValueError, match="float64 weights take the tile path"):
        dgpo_ops.fused_linear_dgpo_loss(hidden.double(), weight.double(), **inputs, backend="triton",
                                        logits_on_chip=True)
