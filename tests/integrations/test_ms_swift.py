"""ms-swift's FIPO loss re-derived from ms-swift's source, against dgpo-ops' ``fipo``.

ms-swift's FIPO is a method of its GRPOTrainer, whose module imports trl, transformers, accelerate and swift's
internals, so its lines are written here as they compute, from modelscope/ms-swift at ``MS_SWIFT_COMMIT`` (the files
and lines in ``MS_SWIFT_SOURCE``): ``_compute_fipo_influence`` zeroes the log-ratios off the completion mask (and,
with ``delta``, where the ratio is above it), sums each token's later ones discounted by ``gamma = 2^(-1 /
fipo_decay_rate)`` with the ``T x T`` decay matrix (no reset inside a padded row), zeroes the sum off the mask,
exponentiates, clips to ``[1 or 1 - r, 1 + r]``, detaches and, for ``A < 0`` with the ratio above
``fipo_safety_threshold``, clamps to ``[0.8, 1]``; the loss is that weight times grpo's ``-min(coef_1 A, coef_2
A)`` (``coef_1`` capped at ``delta``), summed over the mask and divided by the token count: ``token_mean``."""

from __future__ import annotations

import pytest
import torch
from oracle_routes import ROUTES, assert_route_matches, ragged_batch

MS_SWIFT_COMMIT = "3602360a562313afbf2ef6065fdf61f271a2c5b9"
MS_SWIFT_SOURCE = {
    "_compute_fipo_influence": "swift/rlhf_trainers/grpo_trainer.py, lines 899-946",
    "the fipo loss branch": "swift/rlhf_trainers/grpo_trainer.py, lines 1049-1081",
    "aggregation": "swift/rlhf_trainers/grpo_trainer.py, lines 1140-1143",
    "fipo_decay_rate, fipo_clip_range, fipo_clip_high_only, fipo_safety_threshold":
        "swift/rlhf_trainers/args_mixin.py, lines 466-469",
}


def swift_fipo_influence(log_ratio, coef_1, mask, advantages, decay_rate, clip_range, clip_high_only,
                         safety_threshold, delta):
    deltas = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    if delta is not None:
        deltas = torch.where(coef_1 > delta, torch.zeros_like(deltas), deltas)
    gamma = 2 ** (-1.0 / decay_rate)
    positions = torch.arange(log_ratio.shape[-1])
    later = positions[None, :] - positions[:, None]  # [t, k] = k - t
    decay = torch.where(later >= 0, gamma ** later.clamp(min=0).to(log_ratio.dtype), 0.0)
    future_kl = torch.where(mask, deltas @ decay.T, 0.0)
    influence = torch.exp(future_kl)
    if clip_range:
        influence = torch.clamp(influence, 1.0 if clip_high_only else 1.0 - clip_range, 1.0 + clip_range)
    influence = influence.detach()
    if safety_threshold is not None:
        safe = ~((advantages < 0) & (coef_1 > safety_threshold))
        influence = torch.where(safe, influence, torch.clamp(influence, 0.8, 1.0))
    return influence


def swift_fipo_loss(logp, old_logp, advantages, mask, params):
    """ms-swift's fipo loss on one process (importance_sampling_level 'token', no KL, no rollout IS)."""
    epsilon, epsilon_high, delta = params.get("epsilon", 0.2), params.get("epsilon_high", 0.2), params.get("delta")
    advantages = advantages[:, None]
    log_ratio = logp - old_logp
    coef_1 = torch.exp(log_ratio)
    influence = swift_fipo_influence(log_ratio, coef_1, mask, advantages, params.get("fipo_decay_rate", 32.0),
                                     params.get("fipo_clip_range", 0.2), params.get("fipo_clip_high_only", True),
                                     params.get("fipo_safety_threshold", 4.0), delta)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token = influence * -torch.min(coef_1 * advantages, coef_2 * advantages)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


# ms-swift's arguments -> dgpo-ops' fipo parameters
CASES = {
    "defaults": ({}, {}),
    "both-sides-delta": ({"epsilon_high": 0.28, "delta": 2.5, "fipo_decay_rate": 2.0, "fipo_clip_range": 0.5,
                          "fipo_clip_high_only": False, "fipo_safety_threshold": 1.5},
                         {"eps_high": 0.28, "delta": 2.5, "decay_rate": 2.0, "clip_range": 0.5, "clip_side": "both",
                          "safety_threshold": 1.5}),
    "unclipped": ({"fipo_clip_range": 0, "fipo_safety_threshold": None, "fipo_decay_rate": 4.0},
                  {"clip_range": 0.0, "safety_threshold": None, "decay_rate": 4.0}),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 3.0])
@pytest.mark.parametrize("case", list(CASES))
def test_fipo_is_ms_swifts(route, drift, case):
    swift_params, params = CASES[case]
    batch = ragged_batch(seed=13, drift=drift)
    assert_route_matches(
        route, batch,
        lambda logp, old_logp, advantages, mask: swift_fipo_loss(logp, old_logp, advantages, mask, swift_params),
        method="fipo", aggregation="token_mean", **params)


def test_the_influence_reaches_both_clips_and_the_safety_cap():
    """At 3 nats of drift the influence weight is clipped on both sides and the safety cap fires, so the comparison
    above covers every branch of ms-swift's influence."""
    logits, targets, mask, old_logp, advantages = ragged_batch(seed=13, drift=3.0)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    log_ratio = logp - old_logp
    raw = swift_fipo_influence(log_ratio, log_ratio.exp(), mask, advantages[:, None], 2.0, 0, True, None, 2.5)[mask]
    assert (raw < 0.5).any() and (raw > 1.5).any()
    assert ((advantages[:, None] < 0) & (log_ratio.exp() > 1.5) & mask).any()
