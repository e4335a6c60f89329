"""VAPO's positive-example NLL as NeMo-RL's ClippedPGLossFn adds it, re-derived from NeMo-RL's source, against
dgpo-ops' ``positive_nll_coef`` (a term added to any method, with the ``scores`` input as NeMo-RL's rewards).

NeMo-RL is not on PyPI (``nemo-rl`` 0.0.0 is a placeholder) and its loss module imports its distributed and model
utilities, so its lines are written here as they compute, from NVIDIA-NeMo/RL at ``NEMO_RL_COMMIT`` (the files and
lines in ``NEMO_RL_SOURCE``): the clipped loss ``max(-A r, -A clamp(r, 1 - 0.2, 1 + 0.2))`` over the valid tokens
(``token_level_loss``: their sum over their count plus 1e-8; else the mean over samples of each sample's token mean),
plus ``positive_example_nll_weight`` times the mean ``-logp`` over the tokens of the samples whose reward is > 0,
over this micro-batch's count of them plus 1e-8 (nothing where there is none), whatever the aggregation."""

from __future__ import annotations

import pytest
import torch
from oracle_routes import ROUTES, assert_route_matches, ragged_batch

import dgpo_ops

NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
NEMO_RL_SOURCE = {
    "ClippedPGLossFn.__call__ (clip loss, aggregation, VAPO NLL)":
        "nemo_rl/algorithms/loss/loss_functions.py, lines 374-788 (519-561, 678-693, 719-735)",
    "masked_mean": "nemo_rl/algorithms/utils.py, lines 212-224",
    "positive_example_nll_weight": "nemo_rl/algorithms/loss/loss_functions.py, lines 111-164",
}


def nemo_masked_mean(values, mask, dim=None):
    if dim is None:
        return (values * mask).sum() / (mask.sum() + 1e-8)
    return (values * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def nemo_clipped_pg_loss(logp, prev_logp, advantages, mask, rewards, nll_weight, token_level_loss):
    """NeMo-RL's loss of one micro-batch with ratio_clip_min = ratio_clip_max = 0.2, no KL, no IS correction."""
    mask = mask.to(logp.dtype)
    advantages = advantages[:, None]
    ratio = torch.exp(logp - prev_logp)
    clip_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 0.8, 1.2))
    if token_level_loss:
        actor_loss = nemo_masked_mean(clip_loss, mask)
    else:
        sample_mask = (mask.sum(-1) > 0).to(logp.dtype)  # a sample with no valid token is not valid
        actor_loss = nemo_masked_mean(nemo_masked_mean(clip_loss, mask, dim=-1), sample_mask)
    correct_mask = mask * (rewards > 0).to(logp.dtype)[:, None]
    if nll_weight > 0 and correct_mask.sum() > 0:
        actor_loss = actor_loss + nll_weight * (-logp * correct_mask).sum() / (correct_mask.sum() + 1e-8)
    return actor_loss


REWARDS = torch.tensor([1.0, -1.0, 1.0, 0.5], dtype=torch.float64)  # response 2 is fully masked


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 3.0])
@pytest.mark.parametrize("token_level_loss", [True, False], ids=["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("nll_weight", [0.1, 2.0])
def test_positive_example_nll_is_nemo_rls(route, drift, token_level_loss, nll_weight):
    batch = ragged_batch(seed=11, drift=drift)
    mask = batch[2]
    valid_samples = float((mask.sum(-1) > 0).sum())
    aggregation = dict(aggregation="token_mean") if token_level_loss else dict(
        aggregation="seq_mean_token_mean", loss_normalizer=valid_samples)
    assert_route_matches(
        route, batch,
        lambda logp, old_logp, advantages, mask: nemo_clipped_pg_loss(logp, old_logp, advantages, mask, REWARDS,
                                                                      nll_weight, token_level_loss),
        method="grpo", positive_nll_coef=nll_weight, scores=REWARDS, **aggregation)


def test_no_correct_token_adds_nothing():
    """Every reward <= 0: NeMo-RL adds no NLL, dgpo-ops' term is 0 / (0 + 1e-8) = 0."""
    batch = ragged_batch(seed=11, drift=0.5)
    rewards = -REWARDS.abs()
    assert_route_matches(
        "reference", batch,
        lambda logp, old_logp, advantages, mask: nemo_clipped_pg_loss(logp, old_logp, advantages, mask, rewards,
                                                                      0.5, True),
        method="grpo", positive_nll_coef=0.5, scores=rewards, aggregation="token_mean")


def test_the_term_needs_scores():
    logits, targets, mask, old_logp, advantages = ragged_batch(seed=11, drift=0.5)
    with pytest.raises(ValueError, match="positive_nll_coef > 0 needs scores"):
        dgpo_ops.reference_loss(logits, targets, advantages, mask, old_logp, positive_nll_coef=0.1)
    with pytest.raises(ValueError, match="positive_nll_coef must be a finite number >= 0"):
        dgpo_ops.reference_loss(logits, targets, advantages, mask, old_logp, positive_nll_coef=-0.1)
