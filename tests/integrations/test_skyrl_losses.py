"""SkyRL's ``rollout_is`` policy loss re-derived from SkyRL's source, against dgpo-ops' ``rollout_is``.

SkyRL's loss module imports ray, omegaconf and its gym configs, so its lines are written here as they compute, from
NovaSky-AI/SkyRL at ``SKYRL_COMMIT`` (the files and lines in ``SKYRL_SOURCE``): ``compute_policy_loss_rollout_is``
weighs ``-A logp`` by ``r = exp(clamp(float32(logp - lp_roll), -20, 20))`` inside the open band
``(1 - eps_clip_low, 1 + eps_clip_high)``, detached, 0 outside; ``reduce_loss`` sums the masked loss, after the
advantages were scaled by the ``loss_reduction`` (``apply_loss_reduction_to_advantages_minibatch``). SkyRL takes the
ratio against the rollout log-probs, which dgpo-ops receives as ``old_logps``."""

from __future__ import annotations

import pytest
import torch
from oracle_routes import ROUTES, assert_route_matches, ragged_batch

SKYRL_COMMIT = "a9564572eb8e91076be43c1bd5e4615e3de17265"
SKYRL_SOURCE = {
    "compute_policy_loss_rollout_is": "skyrl/backends/skyrl_train/utils/ppo_utils.py, lines 824-863",
    "reduce_loss": "skyrl/backends/skyrl_train/utils/ppo_utils.py, lines 1145-1149",
    "apply_loss_reduction_to_advantages_minibatch": "skyrl/backends/skyrl_train/utils/ppo_utils.py, lines 1152-1220",
    "safe_exp_delta": "skyrl/backends/skyrl_train/utils/torch_utils.py, lines 180-192",
}


def skyrl_scaled_advantages(advantages, mask, loss_reduction):
    """The advantages per token, scaled as SkyRL's loss reduction does before the loss (max_seq_len: the grid's)."""
    advantages = advantages[:, None].expand(mask.shape).to(torch.float64)
    B, T = mask.shape
    if loss_reduction == "token_mean":
        return advantages / mask.sum().clamp(min=1)
    if loss_reduction == "sequence_mean":
        return advantages / (B * mask.sum(-1, keepdim=True).clamp(min=1))
    assert loss_reduction == "seq_mean_token_sum_norm"
    return advantages / (B * T)


def skyrl_rollout_is(logp, rollout_logp, advantages, mask, loss_reduction, eps_clip_low=0.2, eps_clip_high=0.2):
    ratio = torch.exp(torch.clamp((logp - rollout_logp).float(), -20.0, 20.0)).to(logp.dtype)  # safe_exp_delta
    in_range = (ratio > 1 - eps_clip_low) & (ratio < 1 + eps_clip_high)
    weight = torch.where(in_range, ratio, torch.zeros_like(ratio))
    loss = -(weight.detach() * skyrl_scaled_advantages(advantages, mask, loss_reduction) * logp)
    return (loss * mask).sum()


AGGREGATIONS = {"token_mean": "token_mean", "sequence_mean": "seq_mean_token_mean",
                "seq_mean_token_sum_norm": "seq_mean_token_sum_norm"}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 3.0])
@pytest.mark.parametrize("loss_reduction", list(AGGREGATIONS))
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.5, 1.0)])
def test_rollout_is_is_skyrls(route, drift, loss_reduction, eps):
    batch = ragged_batch(seed=3, drift=drift)
    assert_route_matches(
        route, batch,
        lambda logp, old_logp, advantages, mask: skyrl_rollout_is(logp, old_logp, advantages, mask, loss_reduction,
                                                                  *eps),
        method="rollout_is", aggregation=AGGREGATIONS[loss_reduction], eps_low=eps[0], eps_high=eps[1])


def test_the_band_cuts_at_three_nats():
    """At 3 nats of drift tokens lie on both sides of the band and inside it, so the comparison covers all three."""
    logits, targets, mask, old_logp, _ = ragged_batch(seed=3, drift=3.0)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    ratio = torch.exp(logp - old_logp)[mask]
    assert (ratio <= 0.8).any() and (ratio >= 1.2).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
