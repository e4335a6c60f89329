"""A framework's aggregation row (``aggregation="framework:mode"``) divides as its row says on every route: the
row's loss equals the same route's token sum (or per-response mean sum) divided by the count the row names,
counted here from the mask (docs/normalization.md's table is written from the rows by docs/generate.py)."""

from __future__ import annotations

import re

import pytest
import torch
from rollout_cases import ROUTES, mismatch_batch, run_route

import dgpo_ops
from dgpo_ops.frameworks import FRAMEWORKS
from dgpo_ops.kernels.interface import Denominator


def divisor(denominator: Denominator, mask: torch.Tensor) -> float:
    """What each denominator counts, restated from its meaning (at least 1)."""
    B, T = mask.shape
    counts = {Denominator.TOKENS: int(mask.sum()), Denominator.RESPONSES: B, Denominator.GRID: B * T,
              Denominator.ONE: 1, Denominator.SCORED_RESPONSES: int(mask.any(dim=1).sum()), Denominator.HORIZON: T}
    return float(max(counts[denominator], 1))


def batch_without_rollout_logps(seed=21):
    batch = mismatch_batch(0.5, seed=seed)
    assert not bool(batch["mask"].any(dim=1).all())  # a fully masked response: SCORED_RESPONSES < B
    return batch


DENOMINATOR_ROWS = {}  # one row per (per_response, denominator): the routes see a row only through its codes
for _name, _row in dgpo_ops.FRAMEWORK_AGGREGATIONS.items():
    DENOMINATOR_ROWS.setdefault((_row.per_response, _row.denominator), _name)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", sorted(DENOMINATOR_ROWS.values()))
def test_a_rows_divisor_on_every_route(route, name):
    row = dgpo_ops.FRAMEWORK_AGGREGATIONS[name]
    batch = batch_without_rollout_logps()
    got, got_grad = run_route(route, batch, method="grpo", aggregation=name)
    within = "seq_sum_token_mean" if row.per_response else "token_sum"
    want, want_grad = run_route("torch" if route == "compiled" else route, batch, method="grpo", aggregation=within,
                                loss_normalizer=divisor(row.denominator, batch["mask"]))
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)


def test_every_denominator_has_a_row():
    assert {row.denominator for row in dgpo_ops.FRAMEWORK_AGGREGATIONS.values()} == set(Denominator)


def test_flat_logits_take_token_level_rows_only():
    batch = batch_without_rollout_logps()
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2}
    flat["advantages"] = torch.ones(flat["target_ids"].shape)
    dgpo_ops.reference_loss(**flat, method="grpo", aggregation="roll:token-mean")
    with pytest.raises(ValueError, match="aggregation 'roll:seq-mean-token-mean'"):
        dgpo_ops.reference_loss(**flat, method="grpo", aggregation="roll:seq-mean-token-mean")


def test_an_unknown_framework_lists_the_frameworks():
    batch = batch_without_rollout_logps()
    batch.pop("rollout_logps")
    with_rows = ", ".join(sorted(name for name, spec in FRAMEWORKS.items() if spec.aggregations))
    with pytest.raises(ValueError, match=re.escape(f"'framework:mode' ({with_rows};")):
        dgpo_ops.reference_loss(**batch, aggregation="openrlhf2:token-mean")
