"""A boolean loss option takes a bool: a string or a number would be read by its truth value without a word."""

from __future__ import annotations

import pytest
import torch

import dgpo_ops


@pytest.mark.parametrize("value", ["no", 0.0, 1])
def test_kl_ratio_correction_is_a_bool(value):
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="kl_ratio_correction must be a bool"):
        dgpo_ops.reference_loss(logits, torch.zeros(2, 3, dtype=torch.long), torch.ones(2), kl_ratio_correction=value)
