"""OpenRLHF 0.11.2's own ``PolicyLoss`` and ``aggregate_loss`` (read from the installed ``openrlhf`` wheel:
its ``openrlhf.models`` package imports deepspeed, peft and transformers) against dgpo-ops on the same inputs.

The actor (``openrlhf.trainer.ray.ppo_actor``) builds ``PolicyLoss`` from ``--actor.eps_clip_low_high``,
``--actor.dual_clip``, ``--actor.loss_agg_mode`` (``token-mean``: ``token_level_loss``),
``--actor.policy_loss_type`` and the ``--algo.advantage.is_correction_*`` options, and calls it with
``get_loss_batch_info``'s counts: the tokens of the step (``batch_num_tokens``) and its responses with a token
(``global_batch_size``), here one micro-batch on one process. dgpo-ops' ``OpenRLHFCorrection`` names the three
schemes OpenRLHF's help text names (TIS = token clip, ICEPOP = token mask, seq-mask-tis = seq mask, all on the
ratio)."""

from __future__ import annotations

from typing import Optional, Tuple

import pytest
import torch
from wheel_source import ROUTES, assert_beyond_the_clamp, assert_same, load, ours, ragged_batch, require, theirs

require("openrlhf", "0.11.2")

from dgpo_ops.corrections import OpenRLHFCorrection  # noqa: E402

UTILS = load("openrlhf", "openrlhf/models/utils.py", ["masked_mean"])
LOSS = load("openrlhf", "openrlhf/models/loss.py", ["aggregate_loss", "PolicyLoss"],
            {"nn": torch.nn, "F": torch.nn.functional, "dist": torch.distributed, "Optional": Optional,
             "Tuple": Tuple, "masked_mean": UTILS["masked_mean"]})
# dgpo-ops' is_correction_type -> OpenRLHF 0.11.2's (is_correction_level, _mode, _gating)
SCHEMES = {"tis": ("token", "clip", "ratio"), "icepop": ("token", "mask", "ratio"),
           "seq-mask-tis": ("seq", "mask", "ratio")}


def loss_batch_info(mask):
    """``get_loss_batch_info`` on one process: the scored tokens and the responses with one."""
    return dict(dp_size=1, batch_num_tokens=mask.sum().float(),
                global_batch_size=(mask.sum(-1) > 0).sum().float())


def openrlhf_loss(batch, **options):
    _, _, mask, old_logp, rollout_logp, advantages = batch
    policy_loss = LOSS["PolicyLoss"](**options)
    action_mask = mask.double()
    token_advantages = advantages[:, None] * action_mask
    return policy_loss, lambda logp: policy_loss(logp, old_logp, token_advantages, action_mask=action_mask,
                                                 rollout_log_probs=rollout_logp, **loss_batch_info(mask))[0]


def aggregation(policy_loss, mask):
    """OpenRLHF's loss_agg_mode as dgpo-ops' aggregation: the sample mean counts the responses with a
    token."""
    if policy_loss.token_level_loss:
        return dict(aggregation="token_mean")
    return dict(aggregation="seq_mean_token_mean", loss_normalizer=float((mask.sum(-1) > 0).sum()))


PPO_CASES = {
    "ppo": dict(clip_eps_low=0.2, clip_eps_high=0.2),
    "clip-higher": dict(clip_eps_low=0.1, clip_eps_high=0.28),
    "dual-clip": dict(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=1.5),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 1.5])
@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("case", list(PPO_CASES))
def test_ppo(route, drift, token_level_loss, case):
    options = PPO_CASES[case]
    batch = ragged_batch(seed=11, drift=drift)
    policy_loss, oracle = openrlhf_loss(batch, token_level_loss=token_level_loss, **options)
    assert_same(route, batch, oracle, method="grpo", eps_low=options["clip_eps_low"],
                eps_high=options["clip_eps_high"], dual_clip=options.get("dual_clip"),
                **aggregation(policy_loss, batch[2]))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 1.5])
@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_gspo(route, drift, dual_clip):
    """policy_loss_type gspo (no correction): the sequence's geometric-mean ratio in PPO's clip, per-sample
    mean."""
    batch = ragged_batch(seed=12, drift=drift)
    policy_loss, oracle = openrlhf_loss(batch, policy_loss_type="gspo", dual_clip=dual_clip)
    assert not policy_loss.token_level_loss
    assert_same(route, batch, oracle, method="grpo", eps_low=0.2, eps_high=0.2, dual_clip=dual_clip,
                importance_sampling_level="sequence", **aggregation(policy_loss, batch[2]))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("rollout_drift", [0.05, 1.0])
@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("threshold", [(0.5, 5.0), (0.8, 1.25), (0.0, 1.25)])  # one value: (0, HIGH)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_is_correction(route, rollout_drift, token_level_loss, threshold, scheme):
    """The correction inside OpenRLHF's PPO loss (dual clip on), each scheme at OpenRLHF's default threshold
    and a narrow one; OpenRLHF's vllm_kl is dgpo-ops' mismatch_kl_k1."""
    level, mode, gating = SCHEMES[scheme]
    batch = ragged_batch(seed=13, drift=0.3, rollout_drift=rollout_drift)
    policy_loss, oracle = openrlhf_loss(batch, dual_clip=3.0, token_level_loss=token_level_loss,
                                        is_correction_level=level, is_correction_mode=mode,
                                        is_correction_gating=gating, is_correction_threshold=threshold)
    out = assert_same(route, batch, oracle, method="grpo", eps_low=0.2, eps_high=0.2, dual_clip=3.0,
                      rollout_logps=batch[4],
                      rollout_correction=OpenRLHFCorrection(level, mode, gating, threshold),
                      **aggregation(policy_loss, batch[2]))
    _, _, mask, old_logp, rollout_logp, advantages = batch
    vllm_kl = policy_loss(old_logp, old_logp, advantages[:, None] * mask, action_mask=mask.double(),
                          rollout_log_probs=rollout_logp, **loss_batch_info(mask))[3]
    torch.testing.assert_close(out.metrics["mismatch_kl_k1"].double(), vllm_kl.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("delta", [0.02, 0.2])
@pytest.mark.parametrize("level", ["token", "seq"])
@pytest.mark.parametrize("gating", ["binary_kl", "tv"])
def test_divergence_gates(route, delta, level, gating):
    """The binary-KL and total-variation trust regions (mask mode, a single upper bound), per token and per
    response's mean, inside OpenRLHF's PPO loss."""
    batch = ragged_batch(seed=14, drift=0.3, rollout_drift=1.0)
    policy_loss, oracle = openrlhf_loss(batch, dual_clip=None, token_level_loss=True, is_correction_level=level,
                                        is_correction_mode="mask", is_correction_gating=gating,
                                        is_correction_threshold=(0.0, delta))
    assert_same(route, batch, oracle, method="grpo", eps_low=0.2, eps_high=0.2, rollout_logps=batch[4],
                rollout_correction=OpenRLHFCorrection(level, "mask", gating, delta),
                **aggregation(policy_loss, batch[2]))


def test_the_narrow_threshold_bites():
    """At 1 nat of mismatch the narrow band clips or masks some tokens and some responses, and keeps
    others."""
    _, _, mask, old_logp, rollout_logp, _ = ragged_batch(seed=13, drift=0.3, rollout_drift=1.0)
    ratio = (old_logp - rollout_logp).exp()
    inside = (ratio >= 0.8) & (ratio <= 1.25)
    assert (inside & mask).any() and (~inside & mask).any()
    geometric = torch.exp(((old_logp - rollout_logp) * mask).sum(-1) / mask.sum(-1))
    responses = geometric[mask.any(-1)]
    assert ((responses >= 0.8) & (responses <= 1.25)).any() and ((responses < 0.8) | (responses > 1.25)).any()


def test_defaults_are_openrlhfs():
    """OpenRLHFCorrection's default threshold is PolicyLoss's (and the CLI's) (0.5, 5.0)."""
    policy_loss = LOSS["PolicyLoss"]()
    assert tuple(policy_loss.is_correction_threshold) == OpenRLHFCorrection().is_correction_threshold


def test_a_token_25_nats_off_policy():
    """PolicyLoss clamps the log-ratio at 20 with torch.clamp: a token beyond it gets no gradient in OpenRLHF;
    dgpo-ops' straight-through clamp gives it OpenRLHF's own gradient at 20 nats (a known difference)."""
    assert_beyond_the_clamp("reference", lambda batch: openrlhf_loss(batch)[1], method="grpo", eps_low=0.2,
                            eps_high=0.2, aggregation="token_mean")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("token_level_loss", [True, False])
def test_micro_batches(route, token_level_loss):
    """Two micro-batches of one step: OpenRLHF divides each by the step's counts (``batch_num_tokens``,
    ``global_batch_size``); dgpo-ops takes them as each micro-batch's ``loss_normalizer``. ICEPOP on."""
    batch = ragged_batch(seed=59, drift=0.5, rollout_drift=0.7)
    logits, targets, mask, old_logp, rollout_logp, advantages = batch
    options = dict(token_level_loss=token_level_loss, is_correction_level="token", is_correction_mode="mask",
                   is_correction_threshold=(0.6, 1.6))
    policy_loss = LOSS["PolicyLoss"](**options)
    step = loss_batch_info(mask)
    parts = (slice(0, 2), slice(2, 4))

    def oracle(logp):
        return sum(policy_loss(logp[p], old_logp[p], advantages[p, None] * mask[p],
                               action_mask=mask[p].double(), rollout_log_probs=rollout_logp[p], **step)[0]
                   for p in parts)

    expected, expected_grad = theirs(logits, targets, oracle)
    aggregate = aggregation(policy_loss, mask)
    if token_level_loss:
        aggregate["loss_normalizer"] = float(step["batch_num_tokens"])
    loss, grad = 0.0, torch.zeros_like(logits)
    for p in parts:
        out, grad[p] = ours(route, logits[p], targets[p], advantages[p], mask[p], old_logp[p], method="grpo",
                            rollout_logps=rollout_logp[p],
                            rollout_correction=OpenRLHFCorrection("token", "mask", is_correction_threshold=(0.6, 1.6)), **aggregate)
        loss = loss + out.loss.detach()
    torch.testing.assert_close(loss.double(), expected.double(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(grad.double(), expected_grad.double(), rtol=1e-6, atol=1e-8)
