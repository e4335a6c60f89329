"""prime-rl's default loss and its ``ipo`` re-derived from prime-rl's source, against dgpo-ops' ``prime_dppo`` and
``prime_ipo``.

prime-rl is not on PyPI and its loss module imports its configs package and wandb, so its lines are written here as
they compute, from PrimeIntellect-ai/prime-rl at ``PRIME_RL_COMMIT`` (the files and lines in ``PRIME_RL_SOURCE``):
``default_loss_fn`` keeps a token unless its probability moved past ``dppo_mask_high`` (A > 0) or
``-dppo_mask_low`` (A <= 0), ``ipo_loss_fn`` unless ``|p - q| > ipo_threshold``; both give
``-(adv_tau A) keep r + kl_tau mask (log r)^2`` against the inference log-probs, summed and divided by the global
count of loss-mask tokens (at least 1): dgpo-ops' ``token_mean`` with ``old_logps`` = the inference log-probs."""

from __future__ import annotations

import pytest
import torch
from oracle_routes import ROUTES, assert_route_matches, ragged_batch

PRIME_RL_COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"
PRIME_RL_SOURCE = {
    "default_loss_fn": "src/prime_rl/trainer/rl/loss.py, lines 109-161",
    "ipo_loss_fn": "src/prime_rl/trainer/rl/loss.py, lines 164-196",
    "the loss scale (count of loss_mask tokens, at least 1)": "src/prime_rl/trainer/rl/train.py, lines 301-323",
    "DefaultLossConfig, IPOLossConfig": "packages/prime-rl-configs/src/prime_rl/configs/trainer.py, lines 494-532",
}


def prime_rl_is_masked(logp, inference_logp, advantages, loss_type, params):
    probability_diff = torch.exp(logp) - torch.exp(inference_logp)
    if loss_type == "ipo":
        return probability_diff.abs() > params.get("ipo_threshold", 0.1)
    invalid_high = probability_diff > params.get("dppo_mask_high", 0.2)
    invalid_low = probability_diff < -params.get("dppo_mask_low", 0.2)
    return torch.where(advantages > 0, invalid_high, invalid_low)


def prime_rl_loss(logp, inference_logp, advantages, mask, loss_type, params):
    """prime-rl's loss ("default" or "ipo") of one process, divided by its loss scale."""
    advantages = advantages[:, None].expand_as(logp)  # prime-rl's advantages are per token
    log_ratio = logp - inference_logp
    ratio = torch.exp(log_ratio)
    keep = mask & ~prime_rl_is_masked(logp.detach(), inference_logp, advantages, loss_type, params)
    per_token = (-(params.get("adv_tau", 1.0) * advantages) * keep * ratio
                 + params.get("kl_tau", 1e-3) * mask * log_ratio ** 2)
    return per_token.sum() / mask.sum().clamp(min=1)


# prime-rl's parameter -> dgpo-ops'
NAMES = {"dppo_mask_low": "delta_low", "dppo_mask_high": "delta_high", "ipo_threshold": "threshold",
         "adv_tau": "adv_tau", "kl_tau": "kl_tau"}
CASES = [("default", "prime_dppo", {}), ("default", "prime_dppo", {"dppo_mask_low": 0.02, "dppo_mask_high": 0.05,
                                                                    "adv_tau": 0.5, "kl_tau": 0.3}),
         ("ipo", "prime_ipo", {}), ("ipo", "prime_ipo", {"ipo_threshold": 0.02, "adv_tau": 2.0, "kl_tau": 0.1})]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 3.0])
@pytest.mark.parametrize("loss_type,method,params", CASES)
def test_prime_rl_losses_are_prime_rls(route, drift, loss_type, method, params):
    batch = ragged_batch(seed=7, drift=drift)
    assert_route_matches(
        route, batch,
        lambda logp, old_logp, advantages, mask: prime_rl_loss(logp, old_logp, advantages, mask, loss_type, params),
        method=method, aggregation="token_mean", **{NAMES[k]: v for k, v in params.items()})


@pytest.mark.parametrize("loss_type,method,params", CASES)
def test_the_batch_drops_tokens_and_keeps_others(loss_type, method, params):
    """At 3 nats of drift the keep mask cuts both ways, so the comparison above covers dropped tokens too."""
    logits, targets, mask, old_logp, advantages = ragged_batch(seed=7, drift=3.0)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    dropped = prime_rl_is_masked(logp, old_logp, advantages[:, None].expand_as(logp), loss_type, params)[mask]
    assert dropped.any() and not dropped.all()
