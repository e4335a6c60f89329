"""SkyRL 0.3.0's own policy losses, off-policy correction and mini-batch loss reduction (read from the
installed ``skyrl`` wheel: its modules import ray, omegaconf and its gym configs) against dgpo-ops on the same
inputs.

SkyRL's trainer scales the advantages by the loss reduction's count before the loss
(``apply_loss_reduction_to_advantages_minibatch``, ``skyrl.train.trainer``), then a registered policy loss
(``PolicyLossRegistry``: ``@register_policy_loss(PolicyLossType.X)``) computes the per-token loss, applies
``apply_off_policy_correction`` (a TIS weight times the loss, rejections taken out of ``loss_mask``) and sums
it over the mask (``reduce_loss``). One mini-batch = one micro-batch on one process here: the loss is that
sum."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from wheel_source import ROUTES, assert_beyond_the_clamp, assert_same, load, ours, ragged_batch, require, theirs

require("skyrl", "0.3.0")

from dgpo_ops.corrections import SkyRLCorrection  # noqa: E402

UTILS = "skyrl/backends/skyrl_train/utils/"
TORCH_UTILS = load("skyrl", UTILS + "torch_utils.py", ["masked_mean", "safe_exp_delta"])
HELPERS = {"masked_mean": TORCH_UTILS["masked_mean"], "safe_exp_delta": TORCH_UTILS["safe_exp_delta"]}
CORRECTION = load("skyrl", UTILS + "off_policy_correction_utils.py",
                  ["off_policy_correction_enabled", "compute_tis_ratio", "compute_outlier_token_mask",
                   "compute_token_mask", "compute_sequence_mask", "compute_off_policy_correction",
                   "apply_off_policy_correction"], dict(HELPERS))
REGISTRY = {}


def register_policy_loss(name):
    """What SkyRL's decorator does, minus the ray actor that shares the registry: the loss under its type
    name."""
    def decorator(function):
        REGISTRY[str(name)] = function
        return function
    return decorator


PPO_UTILS = load("skyrl", UTILS + "ppo_utils.py",
                 ["PolicyLossType", "ppo_policy_loss", "sapo_policy_loss", "gspo_policy_loss",
                  "compute_policy_loss_cispo", "rollout_is_policy_loss", "dppo_policy_loss", "reduce_loss",
                  "apply_loss_reduction_to_advantages_minibatch"],
                 {**HELPERS, "StrEnum": StrEnum, "register_policy_loss": register_policy_loss,
                  "apply_off_policy_correction": CORRECTION["apply_off_policy_correction"]})
CONFIG = load("skyrl", "skyrl/train/config/config.py",
              ["SAPOConfig", "CISPOConfig", "DPPOConfig", "OffPolicyCorrectionConfig"],
              {"dataclass": dataclass, "field": field, "Optional": Optional, "BaseConfig": object})
# SkyRL's loss_reduction -> dgpo-ops' aggregation
REDUCTIONS = {"token_mean": "token_mean", "sequence_mean": "seq_mean_token_mean",
              "seq_mean_token_sum_norm": "seq_mean_token_sum_norm"}


def algorithm(policy_loss_type, loss_reduction, off_policy_correction=None, **fields):
    """SkyRL's ``trainer.algorithm`` with its defaults (``AlgorithmConfig``'s eps_clip_low/high 0.2,
    clip_ratio_c 3.0; its sub-configs' own dataclasses) and ``fields`` over them."""
    defaults = dict(eps_clip_low=0.2, eps_clip_high=0.2, clip_ratio_c=3.0, sapo=CONFIG["SAPOConfig"](),
                    cispo=CONFIG["CISPOConfig"](), dppo=CONFIG["DPPOConfig"]())
    return SimpleNamespace(**{**defaults, **fields}, policy_loss_type=policy_loss_type,
                           loss_reduction=loss_reduction,
                           off_policy_correction=CONFIG["OffPolicyCorrectionConfig"](
                               **(off_policy_correction or {})))


def skyrl_loss(batch, config, rollout=True, micro_batch_size=None):
    """SkyRL's mini-batch step: GRPO's per-token advantages (the response's score on its tokens), scaled by
    the loss reduction over the whole mini-batch, then the registered loss with the rollout log-probs on each
    micro-batch of ``micro_batch_size`` responses (all of them by default), their losses summed as the
    worker's backward passes add their gradients."""
    _, _, mask, old_logp, rollout_logp, advantages = batch
    loss_mask = mask.double()
    size = micro_batch_size or mask.shape[0]
    scaled = PPO_UTILS["apply_loss_reduction_to_advantages_minibatch"](
        advantages[:, None] * loss_mask, loss_mask, config.loss_reduction, micro_batch_size=size,
        max_seq_len=mask.shape[1])
    loss_fn = REGISTRY[config.policy_loss_type]
    rollout_logp = rollout_logp if rollout else None

    def loss(logp):
        parts = [slice(start, start + size) for start in range(0, mask.shape[0], size)]
        return sum(loss_fn(logp[s], old_logp[s], scaled[s], config, loss_mask[s],
                           None if rollout_logp is None else rollout_logp[s])[0] for s in parts)
    return loss


SKYRL_TOLERANCE = dict(rtol=2e-6, atol=1e-7)  # safe_exp_delta exponentiates in float32


def test_the_registry_holds_the_released_losses():
    assert set(REGISTRY) == {"regular", "dual_clip", "sapo", "gspo", "cispo", "rollout_is", "dppo"}
    assert {str(t) for t in PPO_UTILS["PolicyLossType"]} >= set(REGISTRY)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 3.0])
@pytest.mark.parametrize("loss_reduction", list(REDUCTIONS))
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.5, 1.0)])
def test_rollout_is(route, drift, loss_reduction, eps):
    """SkyRL's rollout_is takes its ratio against the rollout log-probs, which dgpo-ops gets as old_logps."""
    batch = ragged_batch(seed=3, drift=drift)
    logits, targets, mask, old_logp, _, advantages = batch
    batch = (logits, targets, mask, old_logp, old_logp, advantages)  # the old pass is skipped: rollout = old
    config = algorithm("rollout_is", loss_reduction, eps_clip_low=eps[0], eps_clip_high=eps[1])
    assert_same(route, batch, skyrl_loss(batch, config), method="rollout_is",
                aggregation=REDUCTIONS[loss_reduction], eps_low=eps[0], eps_high=eps[1], **SKYRL_TOLERANCE)


# SkyRL's policy_loss_type and config fields -> dgpo-ops' method and parameters
LOSSES = {
    "regular": ({}, dict(method="grpo", eps_low=0.2, eps_high=0.2)),
    "regular-asymmetric": ({"eps_clip_low": 0.1, "eps_clip_high": 0.28}, dict(method="grpo", eps_low=0.1,
                                                                             eps_high=0.28)),
    "dual_clip": ({"clip_ratio_c": 2.0}, dict(method="grpo", eps_low=0.2, eps_high=0.2, dual_clip=2.0)),
    "cispo": ({}, dict(method="cispo", eps_low=0.0, eps_high=5.0)),  # SkyRL's CISPOConfig: [1 - 0, 1 + 5]
    "cispo-wide": ({"cispo": SimpleNamespace(cispo_eps_clip_low=0.8, cispo_eps_clip_high=0.5)},
                   dict(method="cispo", eps_low=0.8, eps_high=0.5)),
    "sapo": ({}, dict(method="sapo", gate="sigmoid", tau_pos=1.0, tau_neg=1.05)),
    "gspo": ({}, dict(method="grpo", eps_low=0.2, eps_high=0.2, importance_sampling_level="sequence")),
    # SkyRL's dppo is -r A on the kept tokens (the ratio against the rollout's, or the old log-probs without
    # them): prime-rl's loss without its penalty
    "dppo": ({}, dict(method="prime_dppo", delta_low=0.2, delta_high=0.2, adv_tau=1.0, kl_tau=0.0)),
    # binary_kl: dgpo-ops has it as verl's dppo_kl, -A sg(min(r, cap)) l: the same gradient, another value
    "dppo-kl": ({"dppo": SimpleNamespace(dppo_type="binary_kl", delta_low=0.05, delta_high=0.1)},
                dict(method="dppo_kl", delta_low=0.05, delta_high=0.1, is_cap=1e9, values=False)),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 1.5])
@pytest.mark.parametrize("loss_reduction", list(REDUCTIONS))
@pytest.mark.parametrize("case", list(LOSSES))
def test_policy_loss(route, drift, loss_reduction, case):
    """SkyRL's other registered losses (no off-policy correction) against the method dgpo-ops has for each."""
    fields, ours = LOSSES[case]
    batch = ragged_batch(seed=5, drift=drift)
    config = algorithm(case.split("-")[0], loss_reduction, **fields)
    assert_same(route, batch, skyrl_loss(batch, config, rollout=False),
                aggregation=REDUCTIONS[loss_reduction], **ours, **SKYRL_TOLERANCE)


# trainer.algorithm.off_policy_correction fields, SkyRL's names (SkyRLCorrection takes the same)
CORRECTIONS = {
    "token-tis": dict(tis_ratio_type="token"),
    "sequence-tis": dict(tis_ratio_type="sequence"),
    "geometric": dict(sequence_mask_metric="geometric"),
    "geometric-wide": dict(sequence_mask_metric="geometric", geo_mask_low=0.6, geo_mask_high=1.5),
    "product": dict(sequence_mask_metric="product", product_mask_low=0.3, product_mask_high=5.0),
    "token-tis-outlier": dict(tis_ratio_type="token", outlier_token_is_threshold_low=0.2,
                              outlier_token_is_threshold_high=4.0),
    "sequence-tis-token-mask": dict(tis_ratio_type="sequence", token_mask_is_threshold_low=0.5,
                                    token_mask_is_threshold_high=2.0),
    "everything": dict(tis_ratio_type="token", sequence_mask_metric="geometric", geo_mask_low=0.5,
                       geo_mask_high=2.0, outlier_token_is_threshold_high=6.0,
                       token_mask_is_threshold_low=0.3, token_mask_is_threshold_high=3.0),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("rollout_drift", [0.02, 1.0])
@pytest.mark.parametrize("loss_reduction", list(REDUCTIONS))
@pytest.mark.parametrize("case", list(CORRECTIONS))
def test_off_policy_correction(route, rollout_drift, loss_reduction, case):
    """SkyRL's correction inside its regular loss, the advantages scaled by the reduction before it: a token
    rejected by a mask leaves the sum, not the count the advantages were divided by."""
    batch = ragged_batch(seed=7, drift=0.3, rollout_drift=rollout_drift)
    config = algorithm("regular", loss_reduction, CORRECTIONS[case])
    assert_same(route, batch, skyrl_loss(batch, config), method="grpo", eps_low=0.2, eps_high=0.2,
                aggregation=REDUCTIONS[loss_reduction], rollout_logps=batch[4],
                rollout_correction=SkyRLCorrection(**CORRECTIONS[case]), **SKYRL_TOLERANCE)


@pytest.mark.parametrize("thresholds", [
    dict(outlier_token_is_threshold_high=1.5),
    dict(token_mask_is_threshold_low=0.7, token_mask_is_threshold_high=1.4)])
def test_a_mask_alone_is_a_correction(thresholds):
    """SkyRL 0.3.0 applies its correction when only the outlier or the token mask is set
    (``off_policy_correction_enabled``)."""
    batch = ragged_batch(seed=7, drift=0.3, rollout_drift=1.0)
    assert CORRECTION["off_policy_correction_enabled"](CONFIG["OffPolicyCorrectionConfig"](**thresholds))
    config = algorithm("regular", "token_mean", thresholds)
    assert_same("reference", batch, skyrl_loss(batch, config), method="grpo", aggregation="token_mean",
                rollout_logps=batch[4], rollout_correction=SkyRLCorrection(**thresholds), **SKYRL_TOLERANCE)


def test_the_cases_reject_and_truncate():
    """At 1 nat of mismatch each mask rejects some tokens and keeps others, and the TIS caps bind."""
    _, _, mask, old_logp, rollout_logp, _ = ragged_batch(seed=7, drift=0.3, rollout_drift=1.0)
    loss_mask = mask.double()
    for case in ("token-tis-outlier", "sequence-tis-token-mask", "geometric-wide", "product", "everything"):
        _, _, kept = CORRECTION["compute_off_policy_correction"](
            old_logp, rollout_logp, loss_mask, CONFIG["OffPolicyCorrectionConfig"](**CORRECTIONS[case]))
        assert 0 < kept.sum() < loss_mask.sum(), case
    ratio = (old_logp - rollout_logp).exp()[mask]
    assert (ratio > 2.0).any() and (ratio < 2.0).any()


def test_defaults_are_skyrls():
    """SkyRLCorrection's defaults are SkyRL's OffPolicyCorrectionConfig's."""
    theirs = CONFIG["OffPolicyCorrectionConfig"]()
    ours = SkyRLCorrection(tis_ratio_type="token")
    for name in ("token_tis_ratio_clip_high", "sequence_tis_ratio_clip_high", "geo_mask_high", "geo_mask_low",
                 "product_mask_high", "product_mask_low", "outlier_token_is_threshold_low",
                 "outlier_token_is_threshold_high", "token_mask_is_threshold_low",
                 "token_mask_is_threshold_high"):
        assert getattr(ours, name) == getattr(theirs, name), name


@pytest.mark.parametrize("policy_loss_type", ["regular", "dual_clip"])
def test_a_token_25_nats_off_policy(policy_loss_type):
    """safe_exp_delta clamps the log-ratio at 20 with torch.clamp, so a token beyond it gets no gradient in
    SkyRL; dgpo-ops' straight-through clamp gives it SkyRL's own gradient at 20 nats (a known difference)."""
    config = algorithm(policy_loss_type, "token_mean")
    assert_beyond_the_clamp("reference", lambda batch: skyrl_loss(batch, config, rollout=False), method="grpo",
                            aggregation="token_mean", dual_clip=3.0 if policy_loss_type == "dual_clip" else None,
                            differs=policy_loss_type != "dual_clip", **SKYRL_TOLERANCE)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("loss_reduction", list(REDUCTIONS))
@pytest.mark.parametrize("policy_loss_type", ["regular", "rollout_is"])
def test_micro_batches(route, loss_reduction, policy_loss_type):
    """Two micro-batches of one mini-batch: SkyRL scales the advantages by the mini-batch's count; dgpo-ops
    takes that count as each micro-batch's ``loss_normalizer`` (tokens; responses; responses x
    max_seq_len)."""
    batch = ragged_batch(seed=47, drift=1.0)
    logits, targets, mask, old_logp, _, advantages = batch
    batch = (logits, targets, mask, old_logp, old_logp, advantages)
    config = algorithm(policy_loss_type, loss_reduction)
    oracle = skyrl_loss(batch, config, rollout=policy_loss_type == "rollout_is", micro_batch_size=2)
    expected, expected_grad = theirs(logits, targets, oracle)
    normalizer = {"token_mean": float(mask.sum()), "sequence_mean": float(mask.shape[0]),
                  "seq_mean_token_sum_norm": float(mask.shape[0] * mask.shape[1])}[loss_reduction]
    method = "grpo" if policy_loss_type == "regular" else "rollout_is"
    loss, grad = 0.0, torch.zeros_like(logits)
    for part in (slice(0, 2), slice(2, 4)):
        out, part_grad = ours(route, logits[part], targets[part], advantages[part], mask[part],
                              old_logp[part], method=method, aggregation=REDUCTIONS[loss_reduction],
                              loss_normalizer=normalizer)
        loss, grad[part] = loss + out.loss.detach(), part_grad
    torch.testing.assert_close(loss.double(), expected.double(), **SKYRL_TOLERANCE)
    torch.testing.assert_close(grad.double(), expected_grad.double(), **SKYRL_TOLERANCE)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", ["cispo", "sapo", "dual_clip", "gspo"])
@pytest.mark.parametrize("tis_ratio_type", ["token", "sequence"])
def test_correction_in_other_losses(route, case, tis_ratio_type):
    """The correction is applied inside every registered loss. gspo is GSPO-token (each token's ratio carries
    its own log-prob's gradient), so per-token TIS weights weigh each token's own gradient, where dgpo-ops'
    sequence ratio would spread the weighted terms over the response: that pair is refused; the per-response
    weights give SkyRL's loss."""
    fields, params = LOSSES[case]
    batch = ragged_batch(seed=7, drift=0.3, rollout_drift=1.0)
    correction = {"tis_ratio_type": tis_ratio_type}
    config = algorithm(case, "sequence_mean", correction, **fields)
    if case == "gspo" and tis_ratio_type == "token":  # refused: dgpo-ops' GSPO is not GSPO-token
        with pytest.raises(ValueError, match="SkyRL's gspo is GSPO-token"):
            ours(route, *batch[:2], batch[5], batch[2], batch[3], aggregation="seq_mean_token_mean",
                 rollout_logps=batch[4], rollout_correction=SkyRLCorrection(**correction), **params)
        return
    assert_same(route, batch, skyrl_loss(batch, config), aggregation="seq_mean_token_mean",
                rollout_logps=batch[4], rollout_correction=SkyRLCorrection(**correction), **params,
                **SKYRL_TOLERANCE)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", ["dppo", "dppo-kl"])
def test_dppo_against_the_rollout(route, case):
    """With rollout log-probs SkyRL's dppo takes its ratio and its divergence against them (the behaviour
    policy, its paper's section 5.2), not the old ones: dgpo-ops gets them as old_logps, as for rollout_is."""
    fields, params = LOSSES[case]
    batch = ragged_batch(seed=53, drift=0.5, rollout_drift=0.5)
    logits, targets, mask, old_logp, rollout_logp, advantages = batch
    config = algorithm("dppo", "token_mean", **fields)
    oracle = skyrl_loss(batch, config)
    assert_same(route, (logits, targets, mask, rollout_logp, rollout_logp, advantages), oracle,
                aggregation="token_mean", **params, **SKYRL_TOLERANCE)
