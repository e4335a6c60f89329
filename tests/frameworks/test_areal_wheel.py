"""AReaL 1.0.4's own GRPO actor loss (read from the installed ``areal`` wheel: ``import areal`` starts its
launchers, and its functional module imports its whole CLI config) against dgpo-ops on the same inputs.

``PPOActor.ppo_update`` hands each micro-batch to ``grpo_loss_fn`` (``areal.trainer.ppo.actor``): M2PO's mask
(``_apply_m2po_masking``) first, then ``ppo_actor_loss_fn`` (``areal.utils.functional.functional``): the
behaviour weight of ``apply_rejection_sampling`` (``RejectionSamplingConfig``), PPO's clip against the
proximal policy with ``c_clip``, the masked sum over the count taken before the rejection; or
``sapo_loss_fn``. The engine scales a micro-batch's loss by its share of the scored tokens
(``loss_weight_fn``), 1 for the one micro-batch here. ``grpo_loss_fn``'s statistics logging runs into a sink
(``NoStats``); the loss is AReaL's."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from wheel_source import ROUTES, assert_beyond_the_clamp, assert_same, load, ours, ragged_batch, require, theirs

require("areal", "1.0.4")

from dgpo_ops.corrections import ArealCorrection, decoupled_ppo, m2po  # noqa: E402


class NoStats:
    """A sink for AReaL's stats_tracker and logging helpers, which only record statistics."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


CONSTANTS = load("areal", "areal/utils/constants.py")
KL = load("areal", "areal/utils/data.py", ["KLEstimator"])
CLI = load("areal", "areal/api/cli_args.py", ["RejectionSamplingConfig"],
           {"dataclass": dataclass, "field": field})
FUNCTIONAL = load("areal", "areal/utils/functional/functional.py",
                  ["_compute_sequence_level_ratio_and_advantages", "RejectionSamplingResult", "_check_bounds",
                   "apply_rejection_sampling", "ppo_actor_loss_fn", "sapo_loss_fn"],
                  {"dataclass": dataclass, "np": np, "KLEstimator": KL["KLEstimator"],
                   "RejectionSamplingConfig": CLI["RejectionSamplingConfig"]})
STATS = load("areal", "areal/trainer/ppo/stats.py", ["infer_token_denominator"])
ACTOR = load("areal", "areal/trainer/ppo/actor.py",
             ["grpo_loss_fn", "_resolve_proximal_logp", "_apply_m2po_masking", "_get_m2po_loss_mask"],
             {**{name: value for name, value in CONSTANTS.items()
                 if name.startswith("PROX_") or name == "ProxLogpMethod"},
              "ppo_actor_loss_fn": FUNCTIONAL["ppo_actor_loss_fn"],
              "sapo_loss_fn": FUNCTIONAL["sapo_loss_fn"],
              "infer_token_denominator": STATS["infer_token_denominator"], "stats_tracker": NoStats(),
              "_log_proximal_approximation_stats": NoStats().log})
RejectionSamplingConfig = CLI["RejectionSamplingConfig"]


def areal_loss(batch, **options):
    """``grpo_loss_fn`` on one padded micro-batch: the proximal log-probs are the old ones (a recomputed
    forward pass), the behaviour's the rollout's (``input_data["logprobs"]``), GRPO's per-token advantages."""
    _, _, mask, old_logp, rollout_logp, advantages = batch
    input_data = {"logprobs": rollout_logp, "advantages": advantages[:, None] * mask, "loss_mask": mask,
                  "prox_logp": old_logp}
    options = {"eps_clip": 0.2, "eps_clip_higher": None, "c_clip": None, **options}
    return lambda logp: ACTOR["grpo_loss_fn"](logp, torch.zeros_like(logp), input_data, **options)


def grpo(options):
    """AReaL's PPO clip options as dgpo-ops' grpo parameters."""
    eps_high = options.get("eps_clip_higher")
    return dict(method="grpo", eps_low=options.get("eps_clip", 0.2),
                eps_high=options.get("eps_clip", 0.2) if eps_high is None else eps_high,
                dual_clip=options.get("c_clip"), aggregation="token_mean")


REJECTION = {  # RejectionSamplingConfig fields (dgpo-ops' ArealCorrection takes the same names)
    "defaults": {},
    "token-ratio-band": dict(lower=0.6, upper=1.8),
    "token-clamp": dict(action="clamp", lower=0.6, upper=1.8),
    "token-k2": dict(metric="kl_k2", upper=0.3),
    "token-k1-band": dict(metric="kl_k1", lower=-0.5, upper=0.5),
    "sequence-ratio-mean": dict(level="sequence", lower=0.85, upper=1.4),
    "sequence-ratio-sum": dict(level="sequence", agg="sum", lower=0.6, upper=3.0),
    "sequence-ratio-max": dict(level="sequence", agg="max", upper=2.5),
    "sequence-k3-mean": dict(level="sequence", metric="kl_k3", upper=0.2),
    "sequence-k2-max": dict(level="sequence", metric="kl_k2", agg="max", upper=0.5),
    "sequence-k1-sum": dict(level="sequence", metric="kl_k1", agg="sum", lower=-0.5, upper=1.0),
    "sequence-clamp": dict(level="sequence", action="clamp", lower=0.85, upper=1.4),
}
CLIPS = {"ppo": {}, "decoupled-dual": dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0)}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("rollout_drift", [0.05, 0.8])
@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("case", list(REJECTION))
def test_decoupled_ppo(route, rollout_drift, clip, case):
    """The loss and gradient, and AReaL's filtered fraction (rs_filtered_fraction)."""
    batch = ragged_batch(seed=17, drift=0.5, rollout_drift=rollout_drift)
    fields = REJECTION[case]
    config = RejectionSamplingConfig(**fields)
    out = assert_same(route, batch, areal_loss(batch, rejection_sampling=config, **CLIPS[clip]),
                      rollout_logps=batch[4], rollout_correction=decoupled_ppo(**fields), **grpo(CLIPS[clip]))
    _, _, mask, old_logp, rollout_logp, _ = batch
    filtered = FUNCTIONAL["apply_rejection_sampling"](old_logp, rollout_logp, mask, None, config)
    filtered = filtered.filtered_fraction
    assert out.metrics["rs_filtered_fraction"].item() == pytest.approx(filtered, abs=1e-6)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("threshold", [0.001, 0.02, 0.1, 10.0])
@pytest.mark.parametrize("rejection", [None, "token-ratio-band", "sequence-ratio-mean"])
def test_m2po(route, threshold, rejection):
    """M2PO's mask before the loss (the normaliser counts the tokens it keeps), alone or with a behaviour
    weight."""
    batch = ragged_batch(seed=19, drift=0.5, rollout_drift=0.6)
    fields = REJECTION.get(rejection)
    oracle = areal_loss(batch, m2_threshold=threshold,
                        rejection_sampling=None if fields is None else RejectionSamplingConfig(**fields))
    assert_same(route, batch, oracle, rollout_logps=batch[4],
                rollout_correction=m2po(threshold, **(fields or {})), **grpo({}))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", ["defaults", "token-clamp", "sequence-ratio-mean"])
def test_gspo_with_the_behaviour_weight(route, case):
    """importance_sampling_level sequence: the geometric-mean ratio (differentiated) in the clip, per-token
    behaviour weights on it."""
    batch = ragged_batch(seed=23, drift=0.5, rollout_drift=0.5)
    fields = REJECTION[case]
    oracle = areal_loss(batch, rejection_sampling=RejectionSamplingConfig(**fields),
                        importance_sampling_level="sequence")
    assert_same(route, batch, oracle, rollout_logps=batch[4], rollout_correction=decoupled_ppo(**fields),
                importance_sampling_level="sequence", **grpo({}))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 1.5])
@pytest.mark.parametrize("taus", [(1.0, 1.05), (2.0, 0.5)])
def test_sapo(route, drift, taus):
    """use_sapo_loss (AReaL's defaults tau_pos 1, tau_neg 1.05): the sigmoid gates, token mean."""
    batch = ragged_batch(seed=29, drift=drift)
    batch = (*batch[:4], batch[3], batch[5])
    oracle = areal_loss(batch, use_sapo_loss=True, sapo_tau_pos=taus[0], sapo_tau_neg=taus[1])
    assert_same(route, batch, oracle, method="sapo", gate="sigmoid", tau_pos=taus[0], tau_neg=taus[1],
                aggregation="token_mean")


@pytest.mark.parametrize("case", ["defaults", "token-k2", "token-k1-band", "sequence-ratio-mean",
                                  "sequence-k3-mean", "sequence-clamp"])
def test_non_finite_behaviour_log_probs(case):
    """A NaN and a -inf inference log-prob on scored tokens: AReaL's log-ratio turns them into 0 (weight 1),
    its KL metrics see them unsanitised (NaN and inf fall outside every bound)."""
    batch = ragged_batch(seed=17, drift=0.5, rollout_drift=0.8)
    rollout_logp = batch[4].clone()
    rollout_logp[0, 2], rollout_logp[1, 0] = float("nan"), float("-inf")
    batch = (*batch[:4], rollout_logp, batch[5])
    fields = REJECTION[case]
    assert_same("reference", batch, areal_loss(batch, rejection_sampling=RejectionSamplingConfig(**fields)),
                rollout_logps=rollout_logp, rollout_correction=decoupled_ppo(**fields), **grpo({}))


def packed(batch):
    """The batch's responses back to back (AReaL's 1D packed layout, ``cu_seqlens`` with the empty response's
    zero-length segment): the per-token tensors flat, the per-response advantages as they are."""
    logits, targets, mask, old_logp, rollout_logp, advantages = batch
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(-1).cumsum(0)])
    flat = (logits[mask], targets[mask], torch.ones(int(mask.sum()), dtype=torch.bool), old_logp[mask],
            rollout_logp[mask], advantages)
    return flat, cu_seqlens


def areal_packed_loss(flat, cu_seqlens, **options):
    """``grpo_loss_fn`` on the packed micro-batch: AReaL's 1D path, the advantages per token."""
    _, _, mask, old_logp, rollout_logp, advantages = flat
    input_data = {"logprobs": rollout_logp, "loss_mask": mask, "prox_logp": old_logp,
                  "cu_seqlens": cu_seqlens, "advantages": advantages.repeat_interleave(cu_seqlens.diff())}
    options = {"eps_clip": 0.2, "eps_clip_higher": None, "c_clip": None, **options}
    return lambda logp: ACTOR["grpo_loss_fn"](logp, torch.zeros_like(logp), input_data, **options)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", ["token-ratio-band", "token-clamp", "sequence-ratio-mean",
                                  "sequence-ratio-max", "sequence-k2-max", "sequence-clamp"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_packed(route, case, level):
    """AReaL's packed path (``cu_seqlens``: its scatter-add reductions per sequence) against dgpo-ops' packed
    route, with M2PO on and the PPO ratio at either importance-sampling level."""
    flat, cu_seqlens = packed(ragged_batch(seed=17, drift=0.5, rollout_drift=0.8))
    fields = REJECTION[case]
    oracle = areal_packed_loss(flat, cu_seqlens, rejection_sampling=RejectionSamplingConfig(**fields),
                               m2_threshold=0.1, importance_sampling_level=level)
    assert_same(route, flat, oracle, rollout_logps=flat[4], rollout_correction=m2po(0.1, **fields),
                cu_seqlens=cu_seqlens, max_seqlen=7, importance_sampling_level=level, **grpo({}))


def test_the_cases_filter_some_tokens_and_keep_others():
    """At 0.8 nats of mismatch each rejection case filters or clamps some scored tokens and keeps others, and
    M2PO at 0.1 drops some (at 0.001 all but one); so the comparisons above see both sides of every bound."""
    _, _, mask, old_logp, rollout_logp, _ = ragged_batch(seed=17, drift=0.5, rollout_drift=0.8)
    for case, fields in REJECTION.items():
        result = FUNCTIONAL["apply_rejection_sampling"](old_logp, rollout_logp, mask, None,
                                                        RejectionSamplingConfig(**fields))
        raw = torch.exp(old_logp - rollout_logp)
        if fields.get("level") == "sequence" and fields.get("metric", "ratio") == "ratio":  # geometric mean
            raw = torch.exp(((old_logp - rollout_logp) * mask).sum(-1, keepdim=True)
                            / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(raw)
        changed = ~torch.isclose(result.behave_imp_weight.double(), raw, rtol=1e-5) & mask
        if case != "defaults":
            assert changed.any() and (mask & ~changed).any(), case
    _, _, mask, old_logp, rollout_logp, _ = ragged_batch(seed=19, drift=0.5, rollout_drift=0.6)
    kept = ACTOR["_apply_m2po_masking"](rollout_logp, old_logp, mask, 0.1)
    assert 0 < kept.sum() < mask.sum() - 1
    assert ACTOR["_apply_m2po_masking"](rollout_logp, old_logp, mask, 0.001).sum() == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_m2po_refuses_a_proximal_log_prob_that_is_not_finite(bad):
    """AReaL refuses a non-finite proximal log-prob before M2PO (``_resolve_proximal_logp``); dgpo-ops' M2PO
    refuses a non-finite old log-prob on a scored token too, rather than sort it."""
    batch = ragged_batch(seed=19, drift=0.5, rollout_drift=0.6)
    old_logp = batch[3].clone()
    old_logp[0, 2] = bad
    batch = (*batch[:3], old_logp, *batch[4:])
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        areal_loss(batch, m2_threshold=0.1)(batch[3])
    logits, targets, mask, old_logp, rollout_logp, advantages = batch
    with pytest.raises(ValueError, match="old_logps"):
        ours("reference", logits, targets, advantages, mask, old_logp, rollout_logps=rollout_logp,
             rollout_correction=m2po(0.1), **grpo({}))


def test_defaults_are_areals():
    theirs, ours = RejectionSamplingConfig(), ArealCorrection()
    for name in ("level", "action", "metric", "agg", "upper", "lower"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_a_token_25_nats_off_policy():
    """ppo_actor_loss_fn takes exp(logprobs - proximal) unclamped: a token 25 nats off contributes |A| e^25;
    dgpo-ops' straight-through clamp gives it AReaL's own value and gradient at 20 nats (a known difference)."""
    assert_beyond_the_clamp("reference", areal_loss, **grpo({}))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("m2_threshold", [None, 0.1])
def test_micro_batches(route, m2_threshold):
    """Two micro-batches: AReaL's engine scales each one's loss by its share of the scored tokens
    (``loss_weight_fn``: the count before M2PO and the rejection). Without M2PO that is dgpo-ops with the
    step's count as ``loss_normalizer``; M2PO's count is the micro-batch's own, so dgpo-ops runs each
    micro-batch with its own normaliser and the caller scales it by the same share."""
    batch = ragged_batch(seed=61, drift=0.5, rollout_drift=0.7)
    logits, targets, mask, old_logp, rollout_logp, advantages = batch
    fields = REJECTION["token-ratio-band"]
    parts = (slice(0, 2), slice(2, 4))
    total = mask.sum()
    if m2_threshold is not None:  # M2PO drops tokens in both micro-batches
        for p in parts:
            kept = ACTOR["_apply_m2po_masking"](rollout_logp[p], old_logp[p], mask[p], m2_threshold)
            assert kept.sum() < mask[p].sum()

    def oracle(logp):
        return sum(areal_loss((None, None, mask[p], old_logp[p], rollout_logp[p], advantages[p]),
                              rejection_sampling=RejectionSamplingConfig(**fields),
                              m2_threshold=m2_threshold)(logp[p]) * mask[p].sum() / total for p in parts)

    expected, expected_grad = theirs(logits, targets, oracle)
    correction = decoupled_ppo(**fields) if m2_threshold is None else m2po(m2_threshold, **fields)
    loss, grad = 0.0, torch.zeros_like(logits)
    for p in parts:
        share = float(mask[p].sum() / total)
        normalizer = {"loss_normalizer": float(total)} if m2_threshold is None else {}
        out, part_grad = ours(route, logits[p], targets[p], advantages[p], mask[p], old_logp[p],
                              rollout_logps=rollout_logp[p], rollout_correction=correction, **normalizer,
                              **grpo({}))
        scale = 1.0 if m2_threshold is None else share
        loss, grad[p] = loss + scale * out.loss.detach(), scale * part_grad
    torch.testing.assert_close(loss.double(), expected.double(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(grad.double(), expected_grad.double(), rtol=1e-6, atol=1e-8)
