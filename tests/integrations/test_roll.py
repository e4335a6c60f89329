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
    "batch_num_tokens, global_valid_samples (over every dp rank)": "roll/distributed/strategy/strategy.py, "
                                                                   "lines 355-431",
    "loss *= loss_scale (micro-batches x dp, cancelling the backend's mean)": "roll/distributed/strategy/"
                                                                             "megatron_strategy.py, lines 255-272, "
                                                                             "635-660",
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


def roll_agg_loss(loss_mat, mask, mode):
    """ROLL's ``agg_loss`` on one process and one micro-batch, where ``batch_num_tokens`` and
    ``global_valid_samples`` are that micro-batch's scored tokens and responses with a scored token (its strategy
    counts them over every dp rank and multiplies each micro-batch's loss by micro-batches x dp, which the backend's
    mean cancels)."""
    valid = (mask.sum(-1) > 0).to(loss_mat.dtype)
    token_sums = torch.where(mask.sum(-1) > 0, (loss_mat * mask).sum(-1), 0.0)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return (roll_masked_mean(loss_mat, mask) * valid).sum() / (valid.sum().clamp(min=1) + 1e-8)
    if mode == "seq-mean-token-sum":
        return (token_sums * valid).sum() / (valid.sum().clamp(min=1) + 1e-8)
    if mode == "seq-mean-token-sum-norm":
        return (token_sums * valid).sum() / mask.shape[-1]
    raise ValueError(mode)


ROLL_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mode", ROLL_MODES)
def test_rolls_aggregations_by_their_own_names(route, mode):
    """``aggregation="roll:<loss_agg_mode>"`` is ROLL's divisor with no loss_normalizer: its seq-mean modes divide
    by the responses with a scored token (the batch has a fully masked one), seq-mean-token-sum-norm by T alone."""
    batch = ragged_batch(seed=6, drift=0.5)
    assert not bool(batch[2][2].any())  # a fully masked response
    assert_route_matches(
        route, batch,
        lambda logp, old_logp, advantages, mask: roll_agg_loss(
            -advantages[:, None] * logp + 0.05 * (logp - old_logp) ** 2, mask.double(), mode),
        method="kimi15", dro_beta=0.1, aggregation=f"roll:{mode}")


@pytest.mark.parametrize("mode,ours", [("seq-mean-token-mean", "seq_mean_token_mean"),
                                       ("seq-mean-token-sum-norm", "seq_mean_token_sum_norm")])
def test_rolls_divisor_differs_from_the_unqualified_aggregation(mode, ours):
    """The row is needed: with a fully masked response, our own seq_mean_token_mean divides by every row and
    seq_mean_token_sum_norm by B x T, each another number than ROLL's."""
    logits, targets, mask, old_logp, advantages = ragged_batch(seed=6, drift=0.5)
    kwargs = dict(mask=mask, old_logps=old_logp, method="kimi15")
    rolls = dgpo_ops.reference_loss(logits, targets, advantages, aggregation=f"roll:{mode}", **kwargs).loss
    plain = dgpo_ops.reference_loss(logits, targets, advantages, aggregation=ours, **kwargs).loss
    ratio = float(plain / rolls)
    assert ratio == pytest.approx(3 / 4 if mode == "seq-mean-token-mean" else 1 / 4)


def test_an_unknown_roll_mode_is_refused_with_rolls_modes():
    logits, targets, mask, old_logp, advantages = ragged_batch(seed=6, drift=0.5)
    with pytest.raises(ValueError, match="roll's: roll:token-mean, roll:seq-mean-token-mean"):
        dgpo_ops.reference_loss(logits, targets, advantages, mask=mask, aggregation="roll:seq-mean")


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
        method="topr", aggregation="roll:seq-mean-token-mean", scores=scores, **params)


def test_topr_without_scores_splits_by_the_advantage():
    """Where no scores are passed (the trainer, verl) the advantage's sign stands in: ROLL's loss with score = A."""
    batch = ragged_batch(seed=5, drift=3.0)
    mask = batch[2]
    assert_route_matches(
        "reference", batch,
        lambda logp, old_logp, advantages, mask: roll_topr(logp, old_logp, advantages, mask.double(), advantages),
        method="topr", aggregation="roll:seq-mean-token-mean")


def test_kimi15_is_dro_with_rolls_tau():
    assert dgpo_ops.method_config("kimi15") == dgpo_ops.method_config("dro", dro_beta=0.1)
    assert dgpo_ops.method_config("kimi15", dro_beta=0.3).dro_beta == 0.3
