"""ROLL's kimi15 and topr losses re-derived from ROLL's source, against dgpo-ops' ``kimi15`` (dro with
``dro_beta = 0.1``) and ``topr``.

ROLL cannot be installed as an oracle (the PyPI package ``roll`` is another project), so its lines are written here as
they compute, from alibaba/ROLL at ``ROLL_COMMIT`` (the files and lines in ``ROLL_SOURCE``): ``_compute_kimi15_loss``
is ``-A logp + tau / 2 (logp - lp_old)^2`` with ``kimi15_tau`` 0.1 by default, and ``agg_loss``'s
``seq-mean-token-mean``, ROLL's default ``loss_agg_mode``, is each response's masked mean (``sum / (mask_sum + 1e-8)``,
0 for an empty one), summed over the responses with a scored token and divided by their count plus 1e-8.
``_compute_topr_loss`` splits the samples by their score (``score > 0`` positive, else negative), not by the
advantage: ``w_pos (-A logp)`` on the positive ones, ``w_neg (-sg(clamp(r, 0, 1)) A logp)`` on the negative ones."""

from __future__ import annotations

import pytest
import torch
from oracle_routes import ROUTES, assert_route_matches, ragged_batch

import dgpo_ops

ROLL_COMMIT = "8eb27cc2dc34c4d1310b169d9b86d339004d811a"
ROLL_SOURCE = {
    "_compute_kimi15_loss": "roll/pipeline/rlvr/actor_pg_worker.py, lines 408-442",
    "agg_loss, masked_mean": "roll/utils/functionals.py, lines 229-297",
    "_compute_topr_loss (scores: data.batch['scores'])": "roll/pipeline/rlvr/actor_pg_worker.py, lines 253-331",
    "topr_positive_weight, topr_negative_weight": "roll/configs/worker_config.py, lines 138-145",
}


def roll_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask_sum = mask.sum(-1)
    return torch.where(mask_sum > 0, (values * mask).sum(-1) / (mask_sum + 1e-8), 0.0)


def roll_kimi15(logp, old_logp, advantages, mask, tau=0.1):
    """ROLL's kimi15 loss with ``loss_agg_mode="seq-mean-token-mean"`` on one process."""
    loss_mat = -advantages[:, None] * logp + tau / 2 * (logp - old_logp) ** 2
    valid = (mask.sum(-1) > 0).to(logp.dtype)
    return (roll_masked_mean(loss_mat, mask) * valid).sum() / (valid.sum() + 1e-8)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 3.0])
@pytest.mark.parametrize("tau", [None, 0.5])  # None: kimi15's own 0.1
def test_kimi15_is_rolls_loss(route, drift, tau):
    batch = ragged_batch(seed=5, drift=drift)
    mask = batch[2]
    valid = float((mask.sum(-1) > 0).sum())  # ROLL counts the responses with a scored token
    assert_route_matches(
        route, batch,
        lambda logp, old_logp, advantages, mask: roll_kimi15(logp, old_logp, advantages, mask.double(),
                                                             0.1 if tau is None else tau),
        method="kimi15", aggregation="seq_mean_token_mean", loss_normalizer=valid,
        **({} if tau is None else {"dro_beta": tau}))


def roll_seq_mean_token_mean(loss_mat, mask):
    valid = (mask.sum(-1) > 0).to(loss_mat.dtype)
    return (roll_masked_mean(loss_mat, mask) * valid).sum() / (valid.sum() + 1e-8)


def roll_topr(logp, old_logp, advantages, mask, scores, positive_weight=1.0, negative_weight=1.0):
    """ROLL's topr loss with ``loss_agg_mode="seq-mean-token-mean"`` on one process."""
    ratio = torch.exp(logp - old_logp)
    advantages = advantages[:, None]
    positive = (scores > 0).to(logp.dtype)[:, None]
    negative = (scores <= 0).to(logp.dtype)[:, None]
    loss_mat = (positive_weight * positive * (-advantages * logp)
                + negative_weight * negative * (-torch.clamp(ratio, 0, 1).detach() * advantages * logp))
    return roll_seq_mean_token_mean(loss_mat, mask)


def disagreeing_scores(advantages):
    """Scores whose sign differs from the advantage's on responses 0 and 2 (2 is fully masked) and agrees on 1, 3."""
    return torch.where(torch.arange(len(advantages)) % 2 == 0, -advantages, advantages)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 3.0])
@pytest.mark.parametrize("weights", [None, (0.5, 2.0)])  # None: ROLL's 1.0 and 1.0
def test_topr_is_rolls_loss(route, drift, weights):
    batch = ragged_batch(seed=5, drift=drift)
    mask, advantages = batch[2], batch[4]
    scores = disagreeing_scores(advantages)
    scored = mask.sum(-1) > 0
    assert (scores[scored] > 0).any() and (scores[scored] <= 0).any()  # both kinds of sample are scored
    params = {} if weights is None else {"positive_weight": weights[0], "negative_weight": weights[1]}
    assert_route_matches(
        route, batch,
        lambda logp, old_logp, advantages, mask: roll_topr(logp, old_logp, advantages, mask.double(), scores,
                                                           **params),
        method="topr", aggregation="seq_mean_token_mean", loss_normalizer=float(scored.sum()), scores=scores,
        **params)


def test_topr_without_scores_splits_by_the_advantage():
    """Where no scores are passed (the trainer, verl) the advantage's sign stands in: ROLL's loss with score = A."""
    batch = ragged_batch(seed=5, drift=3.0)
    mask = batch[2]
    assert_route_matches(
        "reference", batch,
        lambda logp, old_logp, advantages, mask: roll_topr(logp, old_logp, advantages, mask.double(), advantages),
        method="topr", aggregation="seq_mean_token_mean", loss_normalizer=float((mask.sum(-1) > 0).sum()))


def test_kimi15_is_dro_with_rolls_tau():
    assert dgpo_ops.method_config("kimi15") == dgpo_ops.method_config("dro", dro_beta=0.1)
    assert dgpo_ops.method_config("kimi15", dro_beta=0.3).dro_beta == 0.3
