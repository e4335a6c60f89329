"""SkyRL's ``off_policy_correction`` as the correction stage equals its ``compute_off_policy_correction``,
re-derived below from SKYRL_UTILS at SKYRL_COMMIT (SkyRL's package pins what this suite cannot take): outlier
and per-token rejection, token and sequence TIS, geometric and product sequence masks, each step on the mask the
previous left, on every route, with ragged and fully masked responses and drifts of several nats."""

from __future__ import annotations

import pytest
import torch
from rollout_cases import CORRECTION_ROUTES, assert_same_as_weights, mismatch_batch

import dgpo_ops
from dgpo_ops.corrections import SkyRLCorrection

SKYRL_UTILS = "skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py"  # compute_off_policy_correction
SKYRL_VERSION = "0.3.0"  # the PyPI wheel; tests/frameworks/ runs the released function itself
DEFAULTS = dict(tis_ratio_type=None, token_tis_ratio_clip_high=2.0, sequence_tis_ratio_clip_high=5.0,
                sequence_mask_metric=None, geo_mask_high=1.01, geo_mask_low=0.99, product_mask_high=2.0,
                product_mask_low=0.5, outlier_token_is_threshold_low=None, outlier_token_is_threshold_high=None,
                token_mask_is_threshold_low=None, token_mask_is_threshold_high=None)


def safe_exp_delta(delta, clip=20.0):
    return torch.clamp(delta.to(torch.float32), -clip, clip).exp()


def skyrl_correction(old_log_probs, rollout_logprobs, loss_mask, c):
    """(tis_ratio or ones, loss_mask) as compute_off_policy_correction returns them."""
    c = {**DEFAULTS, **c}
    log_ratio = old_log_probs - rollout_logprobs
    ratio = safe_exp_delta(log_ratio)
    over = (ratio > c["outlier_token_is_threshold_high"]) & (loss_mask > 0) \
        if c["outlier_token_is_threshold_high"] is not None else torch.zeros_like(loss_mask, dtype=torch.bool)
    under = (ratio < c["outlier_token_is_threshold_low"]) & (loss_mask > 0) \
        if c["outlier_token_is_threshold_low"] is not None else torch.zeros_like(loss_mask, dtype=torch.bool)
    loss_mask = loss_mask * ((~over & ~under) | (loss_mask == 0)).all(dim=-1, keepdim=True).float()
    if c["token_mask_is_threshold_low"] is not None and c["token_mask_is_threshold_high"] is not None:
        in_bounds = (ratio >= c["token_mask_is_threshold_low"]) & (ratio <= c["token_mask_is_threshold_high"])
        loss_mask = loss_mask * (in_bounds | (loss_mask == 0)).float()
    tis = torch.ones_like(ratio)
    if c["tis_ratio_type"] == "token":
        tis = torch.clamp(ratio, max=c["token_tis_ratio_clip_high"])
    elif c["tis_ratio_type"] == "sequence":
        seq = safe_exp_delta((log_ratio * loss_mask).sum(dim=-1, keepdim=True))
        tis = torch.clamp(seq, max=c["sequence_tis_ratio_clip_high"]).expand_as(ratio)
    if c["sequence_mask_metric"] == "geometric":
        num_tokens = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        geo = safe_exp_delta((log_ratio * loss_mask).sum(dim=-1, keepdim=True) / num_tokens)
        loss_mask = loss_mask * (~(geo > c["geo_mask_high"]) & ~(geo < c["geo_mask_low"])).float()
    elif c["sequence_mask_metric"] == "product":
        seq = safe_exp_delta((log_ratio * loss_mask).sum(dim=-1, keepdim=True))
        loss_mask = loss_mask * (~(seq > c["product_mask_high"]) & ~(seq < c["product_mask_low"])).float()
    return tis, loss_mask.bool()


CASES = [
    dict(tis_ratio_type="token"), dict(tis_ratio_type="sequence"), dict(sequence_mask_metric="geometric"),
    dict(sequence_mask_metric="geometric", geo_mask_low=0.6, geo_mask_high=1.5),
    dict(sequence_mask_metric="product", product_mask_low=0.1, product_mask_high=10.0),
    dict(tis_ratio_type="token", outlier_token_is_threshold_low=0.05, outlier_token_is_threshold_high=20.0),
    dict(tis_ratio_type="sequence", token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0),
    dict(outlier_token_is_threshold_high=5.0), dict(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0),
    dict(tis_ratio_type="token", token_mask_is_threshold_low=0.7, token_mask_is_threshold_high=1.5,
         sequence_mask_metric="geometric", geo_mask_low=0.5, geo_mask_high=2.0, outlier_token_is_threshold_high=50.0),
]


@pytest.mark.parametrize("fields", CASES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("drift", [0.2, 2.0])
def test_skyrl_equals_skyrl(fields, drift):
    batch = mismatch_batch(drift, seed=41)
    tis, corrected = skyrl_correction(batch["old_logps"], batch["rollout_logps"], batch["mask"].float(), fields)
    routes = CORRECTION_ROUTES if fields is CASES[-1] else ("reference", "torch", "packed")
    # SkyRL's loss: sum(loss * tis * corrected_mask), the advantages scaled by the uncorrected mask's count
    expected_weights = (tis if "tis_ratio_type" in fields else torch.ones_like(tis)) * corrected
    assert_same_as_weights(SkyRLCorrection(**fields), batch, expected_weights, batch["mask"], routes, method="grpo")


@pytest.mark.parametrize("fields,message", [
    (dict(), "only with tis_ratio_type, sequence_mask_metric"), (dict(tis_ratio_type="seq"), "tis_ratio_type"),
    (dict(sequence_mask_metric="mean"), "sequence_mask_metric"),
    (dict(tis_ratio_type="token", geo_mask_high=None), "geo_mask_high must be a finite number"),
    (dict(sequence_mask_metric="geometric", geo_mask_low=1.02), "geo_mask_low \\(1.02\\) must be <= geo_mask_high"),
    (dict(sequence_mask_metric="product", product_mask_low=3.0), "product_mask_low"),
    (dict(tis_ratio_type="token", outlier_token_is_threshold_low=5.0, outlier_token_is_threshold_high=2.0),
     "outlier_token_is_threshold_low"),
    (dict(tis_ratio_type="token", token_tis_ratio_clip_high=-1.0), "token_tis_ratio_clip_high must be > 0"),
    (dict(tis_ratio_type="token", token_mask_is_threshold_low=0.2),
     "token_mask_is_threshold_low and token_mask_is_threshold_high go together"),
    (dict(token_mask_is_threshold_low=2.0, token_mask_is_threshold_high=0.5), "token_mask_is_threshold_low"),
])
def test_fields_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        SkyRLCorrection(**fields)


def test_skyrls_own_field_names_are_absolute_bounds():
    """SkyRL's config copies over: ``token_mask_is_threshold_low/_high`` bound the ratio itself (0.5 and 2.0 keep
    [0.5, 2.0], not [1 - 0.5, 1 + 2.0])."""
    batch = mismatch_batch(1.0, seed=45)
    fields = dict(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0)
    ratio = torch.exp((batch["old_logps"] - batch["rollout_logps"]).clamp(-20, 20))
    assert bool(((ratio > 2.0) & (ratio <= 3.0) & batch["mask"]).any())  # tokens a [0.5, 3.0] window would keep
    expected = ((ratio >= 0.5) & (ratio <= 2.0)).float()
    assert_same_as_weights(SkyRLCorrection(**fields), batch, expected, batch["mask"], ("reference",), method="grpo")
    with pytest.raises(TypeError, match="token_mask_eps_low"):
        SkyRLCorrection(token_mask_eps_low=0.5, token_mask_eps_high=1.0)


def test_a_rejected_response_stays_in_the_token_count():
    """SkyRL divides by the mini-batch's tokens before its correction: 2 responses x 4 tokens, on-policy, A = 1,
    one response rejected by the outlier threshold: -4 / 8 = -0.5 (not -4 / 4)."""
    logits = torch.zeros(2, 4, 8, requires_grad=True)
    target_ids = torch.zeros(2, 4, dtype=torch.long)
    old_logps = torch.full((2, 4), -torch.log(torch.tensor(8.0)).item())
    rollout_logps = old_logps.clone()
    rollout_logps[1, 2] -= 3.0  # its ratio e^3 > 10: the response is an outlier
    out = dgpo_ops.reference_loss(logits, target_ids, torch.ones(2), old_logps=old_logps, rollout_logps=rollout_logps,
                                  method="grpo", aggregation="token_mean",
                                  rollout_correction=SkyRLCorrection(outlier_token_is_threshold_high=10.0))
    torch.testing.assert_close(out.loss, torch.tensor(-0.5))


@pytest.mark.parametrize("aggregation", sorted(dgpo_ops.AGGREGATIONS))
def test_rejections_keep_every_aggregations_normaliser(aggregation):
    batch = mismatch_batch(1.0, seed=42)
    tis, corrected = skyrl_correction(batch["old_logps"], batch["rollout_logps"], batch["mask"].float(), CASES[-1])
    assert 0 < int(corrected.sum()) < int(batch["mask"].sum())
    assert_same_as_weights(SkyRLCorrection(**CASES[-1]), batch, tis * corrected, batch["mask"],
                           ("reference", "torch", "triton", "packed"), method="grpo", aggregation=aggregation,
                           loss_normalizer=None)


@pytest.mark.parametrize("method", ["geo_mean", "vespo"])
def test_rejections_are_refused_where_the_weights_fold_into_a_statistic(method):
    """A SkyRL rejection is a weight 0 that the normaliser still counts; geo_mean and vespo fold the weights into
    their sequence statistic, where it would change the whole response: refused (SkyRL has neither method);
    TIS alone folds as any rollout weight does."""
    batch = mismatch_batch(1.0, seed=44)
    with pytest.raises(ValueError, match=f"{method} folds the rollout weights"):
        dgpo_ops.reference_loss(**batch, method=method,
                                rollout_correction=SkyRLCorrection(outlier_token_is_threshold_high=5.0))
    out = dgpo_ops.reference_loss(**batch, method=method, rollout_correction=SkyRLCorrection(tis_ratio_type="token"))
    assert torch.isfinite(out.loss)
