"""AReaL's behaviour weight (``apply_rejection_sampling``), M2PO and decoupled PPO loss as the correction stage
equal AReaL's code, re-derived below from its source (AREAL_FUNCTIONAL at AREAL_FUNCTIONAL_COMMIT:
``apply_rejection_sampling`` and ``ppo_actor_loss_fn``; AREAL_ACTOR at AREAL_ACTOR_COMMIT: ``_get_m2po_loss_mask``
and its sorting wrapper), on every route, with ragged and fully masked responses and drifts of several nats.
Here ``old_logps`` are AReaL's proximal log-probs and ``rollout_logps`` its behaviour (inference) log-probs."""

from __future__ import annotations

import pytest
import torch
from rollout_cases import CORRECTION_ROUTES, assert_same_as_weights, mismatch_batch, run_route

import dgpo_ops
from dgpo_ops.corrections import ArealCorrection, decoupled_ppo, m2po

AREAL_FUNCTIONAL = "areal/utils/functional/functional.py"  # apply_rejection_sampling, ppo_actor_loss_fn
AREAL_FUNCTIONAL_COMMIT = "2274616c3d28d2120de3beb0831d08b6b6d243ea"
AREAL_KL = "areal/utils/data.py"  # KLEstimator._compute_approx_kl (L1619-1656), at AREAL_FUNCTIONAL_COMMIT
AREAL_ACTOR = "areal/trainer/ppo/actor.py"  # _apply_m2po_masking / _get_m2po_loss_mask (L769-850)
AREAL_ACTOR_COMMIT = "4aef98d8d818af55b43621aaadba047ae10f4e77"


def areal_approx_kl(log_probs, log_probs_base, kl_estimator):
    """AREAL_KL's ``KLEstimator._compute_approx_kl`` with ``apply_clamp=False``, as it reads."""
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k2":
        log_ratio = log_ratio ** 2 / 2.0
    if kl_estimator == "k3":
        log_ratio = -log_ratio
        log_ratio = log_ratio.exp() - 1 - log_ratio
    return log_ratio


def areal_rejection_sampling(prox, behave, loss_mask, level, action, metric, agg, upper, lower):
    """AReaL's apply_rejection_sampling on 2D padded inputs: (loss_mask, behave_imp_weight, filtered_fraction)."""
    def check_bounds(value):
        return (value >= lower) & (value <= upper) if lower is not None else value <= upper

    log_ratio = prox.float() - behave.float()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    d = prox.float() - behave.float()
    metric_value = torch.exp(log_ratio) if metric == "ratio" else areal_approx_kl(prox, behave, metric[3:])
    weight = torch.exp(log_ratio)
    original = weight
    use_log = metric == "ratio"
    if level == "sequence":
        agg_values = log_ratio if use_log else metric_value
        masked_agg = torch.where(loss_mask.bool(), agg_values, 0.0)
        valid_count = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1)
        if use_log:
            weight = torch.exp(masked_agg.sum(dim=-1, keepdim=True) / valid_count).expand_as(log_ratio)
            original = weight
        if agg == "sum":
            seq_agg = masked_agg.sum(dim=-1, keepdim=True)
        elif agg == "mean":
            seq_agg = masked_agg.sum(dim=-1, keepdim=True) / valid_count
        else:
            seq_agg = agg_values.masked_fill(~loss_mask.bool(), float("-inf")).max(dim=-1, keepdim=True)[0]
            all_masked = loss_mask.sum(dim=-1, keepdim=True) == 0
            seq_agg = torch.where(all_masked, torch.zeros_like(seq_agg), seq_agg)
        seq_metric = torch.exp(seq_agg) if use_log else seq_agg
        if action == "mask":
            in_bounds = check_bounds(seq_metric).expand_as(loss_mask)
        else:
            out = (~check_bounds(seq_metric)).expand_as(loss_mask)
            weight = torch.where(out, weight.clamp(min=lower if lower is not None else 0.0, max=upper), weight)
    elif action == "mask":
        in_bounds = check_bounds(metric_value)
    else:
        weight = weight.clamp(min=lower if lower is not None else 0.0, max=upper)
    if action == "mask":
        updated = loss_mask.bool() & in_bounds
        fraction = (loss_mask.bool() & ~in_bounds).sum().item() / max(loss_mask.bool().sum().item(), 1)
    else:
        updated = loss_mask.bool()
        fraction = (loss_mask.bool() & (original != weight)).sum().item() / max(updated.sum().item(), 1)
    return updated, torch.where(updated, weight, 0.0), fraction


def areal_m2po_mask(behave, prox, loss_mask, m2_threshold):
    """AReaL's _apply_m2po_masking with _get_m2po_loss_mask."""
    delta = behave - prox
    m2 = delta * delta
    mask_flat = loss_mask.reshape(-1)
    m2_selected = m2.reshape(-1)[mask_flat]
    if m2_selected.numel() == 0:
        return loss_mask
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored = torch.argsort(indices)
    n = sorted_m2.numel()
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    below = torch.where(suffix_sums / counts < m2_threshold)[0]
    num_to_mask = below[0].item() if len(below) > 0 else n - 1
    sorted_mask = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        sorted_mask[:num_to_mask] = False
    full = torch.zeros_like(mask_flat, dtype=torch.bool)
    full[mask_flat] = sorted_mask[restored]
    return full.view_as(loss_mask)


def areal_ppo_actor_loss(logprobs, prox, behave, advantages, eps_clip, loss_mask, eps_clip_higher, c_clip, rs):
    """AReaL's ppo_actor_loss_fn at token level (rs: the rejection-sampling fields, or None)."""
    loss_mask_count = loss_mask.count_nonzero() or 1
    if rs is not None:
        loss_mask, behave_imp_weight, _ = areal_rejection_sampling(prox, behave, loss_mask, **rs)
    ratio = torch.where(loss_mask, torch.exp(logprobs - prox), 0)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    pg_loss = torch.max(-advantages * ratio, -advantages * clipped)
    if c_clip is not None:
        pg_loss = torch.min(pg_loss, torch.sign(advantages) * c_clip * advantages)
    if rs is not None:
        pg_loss = pg_loss * behave_imp_weight
    return torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count


RS_DEFAULTS = dict(level="token", action="mask", metric="ratio", agg="mean", upper=5.0, lower=None)
RS_CASES = [
    {}, dict(lower=0.5, upper=2.0), dict(action="clamp", upper=2.0), dict(action="clamp", lower=0.5, upper=1.5),
    dict(metric="kl_k1", upper=0.5, lower=-0.5), dict(metric="kl_k2", upper=0.3), dict(metric="kl_k3", upper=0.4),
    dict(level="sequence", upper=1.5, lower=0.6), dict(level="sequence", agg="sum", upper=3.0),
    dict(level="sequence", agg="max", upper=4.0), dict(level="sequence", action="clamp", upper=1.2, lower=0.9),
    dict(level="sequence", metric="kl_k3", agg="mean", upper=0.5), dict(level="sequence", metric="kl_k2",
                                                                       agg="max", upper=1.0),
    dict(level="sequence", metric="kl_k1", agg="sum", upper=1.0, lower=-1.0),
]


@pytest.mark.parametrize("fields", RS_CASES, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "default")
@pytest.mark.parametrize("drift", [0.2, 2.5])
def test_behaviour_weight_equals_areal(fields, drift):
    batch = mismatch_batch(drift, seed=11)
    rs = {**RS_DEFAULTS, **fields}
    mask, weight, fraction = areal_rejection_sampling(batch["old_logps"], batch["rollout_logps"], batch["mask"], **rs)
    # AReaL keeps the pre-rejection count: its rejected tokens stay in our mask, with weight 0
    every_route = not fields or fields.get("level") == "sequence" and drift == 0.2
    routes = CORRECTION_ROUTES if every_route else ("reference", "packed")
    metrics = assert_same_as_weights(ArealCorrection(**rs), batch, weight, batch["mask"], routes, method="grpo")
    torch.testing.assert_close(metrics["rs_filtered_fraction"].double(), torch.tensor(fraction, dtype=torch.float64))


@pytest.mark.parametrize("threshold", [0.01, 0.5, 4.0, 100.0])
@pytest.mark.parametrize("drift", [0.3, 3.0])
def test_m2po_equals_areal(threshold, drift):
    batch = mismatch_batch(drift, seed=12)
    mask = areal_m2po_mask(batch["rollout_logps"], batch["old_logps"], batch["mask"], threshold)
    assert_same_as_weights(m2po(threshold), batch, torch.ones_like(batch["old_logps"]), mask,
                           CORRECTION_ROUTES if threshold == 0.5 else ("reference", "torch", "packed"),
                           method="grpo")


@pytest.mark.parametrize("rs,m2_threshold", [
    (RS_DEFAULTS, None), (dict(RS_DEFAULTS, action="clamp", upper=1.5), None),
    (dict(RS_DEFAULTS, level="sequence", lower=0.5, upper=2.0), None), (None, 0.3), (RS_DEFAULTS, 0.3),
    (dict(RS_DEFAULTS, level="sequence", lower=0.5, upper=2.0), 0.3)])
@pytest.mark.parametrize("route", ["reference", "torch", "triton", "packed", "compiled"])
def test_decoupled_ppo_equals_areal_loss(rs, m2_threshold, route):
    """grpo (eps_low = eps_clip, eps_high = eps_clip_higher, dual_clip = c_clip) with the behaviour weight and
    M2PO is AReaL's decoupled loss: M2PO masks before ppo_actor_loss_fn, whose count is taken before rejection."""
    batch = mismatch_batch(1.0, seed=13)
    batch["advantages"] = batch["advantages"][:, None].expand(batch["mask"].shape).contiguous()
    logits = batch["logits"].double().requires_grad_(True)
    logprobs = torch.log_softmax(logits, -1).gather(-1, batch["target_ids"][..., None])[..., 0]
    mask = batch["mask"]
    if m2_threshold is not None:
        mask = areal_m2po_mask(batch["rollout_logps"].double(), batch["old_logps"].double(), mask, m2_threshold)
    want = areal_ppo_actor_loss(logprobs, batch["old_logps"].double(), batch["rollout_logps"].double(),
                                batch["advantages"].double(), 0.2, mask, 0.28, 3.0, rs)
    (want_grad,) = torch.autograd.grad(want, logits)
    correction = ArealCorrection(**(rs or {}), rejection_sampling=rs is not None, m2_threshold=m2_threshold)
    got, got_grad = run_route(route, batch, method="grpo", eps_low=0.2, eps_high=0.28, dual_clip=3.0,
                              rollout_correction=correction)
    torch.testing.assert_close(got.loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-4, atol=1e-6)


def test_presets_and_checks():
    assert decoupled_ppo() == ArealCorrection()
    assert m2po(0.04) == ArealCorrection(rejection_sampling=False, m2_threshold=0.04)
    for fields in (dict(metric="ratio", upper=1.0), dict(metric="kl_k2", upper=0.0), dict(action="clamp",
                   metric="kl_k1"), dict(lower=3.0, upper=2.0), dict(level="seq"), dict(rejection_sampling=False),
                   dict(m2_threshold=-1.0)):
        with pytest.raises(ValueError):
            ArealCorrection(**fields)


def test_m2po_keeps_at_least_one_token_and_changes_the_normaliser():
    batch = mismatch_batch(3.0, seed=14)
    out = dgpo_ops.reference_loss(**batch, method="grpo", rollout_correction=m2po(1e-9))
    assert float(out.metrics["m2po_masked_fraction"]) == pytest.approx(1 - 1 / float(batch["mask"].sum()))


def test_kl_k3_is_areals_non_negative_estimator():
    """AReaL's kl_k3 metric is ``exp(-d) - 1 + d`` for ``d = prox - behave`` (AREAL_KL; >= 0): the tokens at
    ``d = 1`` and ``d = -1`` (0.37 and 0.72) are out of an upper bound of 0.3, the others (``d = 0``) in."""
    batch = mismatch_batch(0.0, seed=11)
    d = torch.zeros_like(batch["old_logps"])
    d[0, 0], d[0, 3] = 1.0, -1.0
    batch["rollout_logps"] = batch["old_logps"] - d
    out = dgpo_ops.reference_loss(**batch, method="grpo", rollout_correction=ArealCorrection(metric="kl_k3", upper=0.3))
    torch.testing.assert_close(out.metrics["rs_filtered_fraction"], 2 / batch["mask"].sum().float())
