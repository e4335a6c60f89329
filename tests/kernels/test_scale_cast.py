"""The fused-linear backward's scale-and-cast kernel (interpreter) against its torch twin and against the product
rounded once: every output dtype, sizes around its block, scales that round."""

from __future__ import annotations

import pytest
import torch

from dgpo_ops.kernels import scale_cast as scale_cast_module
from dgpo_ops.kernels.torch_twins import scale_cast_torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 17, scale_cast_module.BLOCK, scale_cast_module.BLOCK * 2 + 5])
@pytest.mark.parametrize("scale", [1.0, 0.3, -2.5e-3])
def test_kernel_equals_the_twin_and_the_product_rounded_once(dtype, n, scale):
    g = torch.Generator().manual_seed(n)
    accumulator = torch.randn(n, generator=g) * 7
    scale_t = torch.tensor([scale])
    kernel_out, twin_out = torch.full((n,), float("nan"), dtype=dtype), torch.empty(n, dtype=dtype)
    scale_cast_module.scale_cast(accumulator, scale_t, kernel_out)
    scale_cast_torch(accumulator, scale_t, twin_out)
    expected = (accumulator * scale).to(dtype)  # fp32 product, one rounding to nearest even
    assert torch.equal(kernel_out, expected)
    assert torch.equal(twin_out, expected)


def test_a_matrix_is_scaled_whole_and_an_empty_one_launches_nothing():
    accumulator = torch.randn(33, 70)
    out = torch.empty(33, 70, dtype=torch.bfloat16)
    scale_cast_module.scale_cast(accumulator, torch.tensor([0.5]), out)
    assert torch.equal(out, (accumulator * 0.5).to(torch.bfloat16))
    scale_cast_module.scale_cast(torch.empty(0, 70), torch.tensor([0.5]), torch.empty(0, 70, dtype=torch.bfloat16))
