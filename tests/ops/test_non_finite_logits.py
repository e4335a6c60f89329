"""A NaN or infinite logit (or hidden state) on a scored token is not refused: the loss and gradient are NaN on
every route, as docs/api.md says and as the frameworks' losses are."""

from __future__ import annotations

import pytest
import torch
from rollout_cases import linear_inputs, mismatch_batch, run_route

import dgpo_ops


def clean_batch():
    batch = mismatch_batch(0.3, seed=9)
    batch.pop("rollout_logps")
    assert bool(batch["mask"][0, 1])  # the token made non-finite below is scored
    return batch


@pytest.mark.parametrize("route", ["reference", "torch", "triton", "packed"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_logit_on_a_scored_token_gives_a_nan_loss(route, value):
    batch = clean_batch()
    clean, _ = run_route(route, batch, method="grpo")
    assert torch.isfinite(clean.loss)
    batch["logits"] = batch["logits"].clone()
    batch["logits"][0, 1, 3] = value
    out, grad = run_route(route, batch, method="grpo")
    assert torch.isnan(out.loss)
    assert torch.isnan(grad).any()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_hidden_state_on_a_scored_token_gives_a_nan_loss(value):
    batch = clean_batch()
    hidden, weight, _ = linear_inputs(batch)
    batch.pop("logits")
    hidden[0, 1, 2] = value
    hidden.requires_grad_(True)
    out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **batch, method="grpo", backend="torch")
    out.loss.backward()
    assert torch.isnan(out.loss)
    assert torch.isnan(hidden.grad).any()
