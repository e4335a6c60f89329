"""dgpo-ops inside verl 0.9.1, against verl's own code: its policy losses, its ``ppo_loss``, its registry,
its Hydra config and its torch fused log-prob backend. verl pins what the main suite cannot take, so these
run in a venv of their own (``.ci/verl_cpu.sh``, which fails if they are skipped there)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

verl = pytest.importorskip("verl", reason="verl runs in its own venv: bash .ci/verl_cpu.sh")

import verl_workers  # noqa: E402
from helpers import value_error_message  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.experimental.torch_functional import FusedLinearForPPO  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config import PolicyLossConfig as VerlPolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import dgpo_ops  # noqa: E402
from dgpo_ops import Region, method_config, reference_loss, token_terms  # noqa: E402
from dgpo_ops.integrations import verl as dgpo_verl  # noqa: E402
from dgpo_ops.integrations.verl_params import LOSS_AGG_MODES, ROW_MEAN  # noqa: E402
from dgpo_ops.methods.catalog import POLICY_LOSSES, variants  # noqa: E402

MODES = LOSS_AGG_MODES
# verl's mode -> the package's aggregation with that per-token weight; the normaliser carries verl's counts
OUR_AGGREGATION = {"token-mean": "token_mean", "token-sum": "token_sum", "seq-mean-token-sum": "token_mean",
                   "seq-mean-token-sum-norm": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean"}
DP_SIZE, MICRO_BATCHES, PER_MICRO = 2, 2, 3  # the FSDP engine's layout: each rank runs MICRO_BATCHES micro-batches
B, T, V = DP_SIZE * MICRO_BATCHES * PER_MICRO, 7, 13


def actor_config(**fields) -> ActorConfig:
    policy_loss = fields.pop("policy_loss", None)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=PER_MICRO, **fields)
    if policy_loss is not None:
        object.__setattr__(config, "policy_loss", policy_loss)
    return config


def rollout(seed: int, fully_masked: bool, drift: float = 0.4):
    """A global batch in fp64: logits (a leaf), targets, old and reference log-probs (``drift`` nats apart
    from the current ones, in standard deviations), token advantages (one per response, as verl broadcasts
    them), a response mask with ragged lengths and, optionally, fully masked responses (an over-long response
    filtered out), rollout weights."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (B, T), generator=g)
    logp = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    old = logp + drift * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios across every region
    old = old.clamp(max=-1e-3)  # a log-prob: a large drift must not make the old probability exceed 1
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if fully_masked:
        mask[1] = False
        mask[B - 2] = False
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return logits, targets, old, ref, advantages, mask, weights


def micro_batches():
    """(rank, rows) of every micro-batch: rank r holds rows [r * B / DP, (r + 1) * B / DP)."""
    for rank in range(DP_SIZE):
        for micro in range(MICRO_BATCHES):
            start = (rank * MICRO_BATCHES + micro) * PER_MICRO
            yield rank, slice(start, start + PER_MICRO)


def global_batch_info(mask, loss_scale_factor=None) -> dict:
    """As verl's FSDP engine sets it: the mini-batch's token count over every rank, the response count
    (ppo_mini_batch_size x rollout.n: fully masked responses included), dp_size."""
    return {"dp_size": DP_SIZE, "batch_num_tokens": int(mask.sum()), "global_batch_size": B,
            "loss_scale_factor": loss_scale_factor}


def policy_loss_and_grad(name, config, mode, logits, targets, old, advantages, mask, weights):
    """Every micro-batch's loss through verl's registry, and d (their sum / DP_SIZE) / d logits: the
    gradient FSDP's average over ranks leaves after the micro-batches' backwards."""
    logits = logits.detach().requires_grad_(True)
    losses, metrics = [], []
    for _, rows in micro_batches():
        log_prob = logits[rows].log_softmax(-1).gather(-1, targets[rows, :, None])[..., 0]
        loss, m = get_policy_loss_fn(name)(old_log_prob=old[rows], log_prob=log_prob, advantages=advantages[rows],
                                           response_mask=mask[rows], loss_agg_mode=mode, config=config,
                                           rollout_is_weights=None if weights is None else weights[rows])
        losses.append(loss)
        metrics.append(m)
    (torch.stack(losses).sum() / DP_SIZE).backward()
    return torch.stack(losses).detach(), logits.grad, metrics


# test id -> verl's name, ours, the fields of our policy_loss that make ours that loss, and verl's policy_loss
# fields both read (verl's defaults otherwise)
SAME_LOSSES = {
    "vanilla": ("vanilla", "dgpo_ops.grpo", {}, {}),  # dual clip from clip_ratio_c, as verl's vanilla
    "cispo": ("cispo", "dgpo_ops.cispo", {}, {}),
    "gspo": ("gspo", "dgpo_ops.grpo", {"importance_sampling_level": "sequence", "method_params": {"dual_clip": None}},
             {}),
    "sapo": ("sapo", "dgpo_ops.sapo", {}, {}),
    "gpg": ("gpg", "dgpo_ops.gpg", {}, {}),
    # verl reads clip_ratio_low / clip_ratio_high as the divergence thresholds and clip_ratio_c as the weight cap
    "dppo_tv": ("dppo_tv", "dgpo_ops.dppo_tv", {}, {}),
    "dppo_kl": ("dppo_kl", "dgpo_ops.dppo_kl", {}, {}),
    "dro": ("dro", "dgpo_ops.dro", {}, {"dro_beta": 0.3}),
    "geo_mean": ("geo_mean", "dgpo_ops.geo_mean", {}, {}),
    # a ratio that cuts every candidate: the random draw (test_clip_cov_draws_as_many_tokens_as_verl) is then moot
    "clip_cov": ("clip_cov", "dgpo_ops.clip_cov", {}, {"clip_cov_ratio": 1.0}),
    "clip_cov-band": ("clip_cov", "dgpo_ops.clip_cov", {}, {"clip_cov_ratio": 1.0, "clip_cov_lb": -0.5,
                                                            "clip_cov_ub": 0.5}),
    "kl_cov": ("kl_cov", "dgpo_ops.kl_cov", {}, {}),  # verl's defaults: one token per micro-batch
    "kl_cov-ratio": ("kl_cov", "dgpo_ops.kl_cov", {}, {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}),
}
DRIFTS = {"drift0.4": 0.4, "drift4": 4.0}  # log-ratios of about 0.4 and 4 nats (up to about 15)


@pytest.mark.parametrize("with_weights", [True, False], ids=["rollout-weights", "no-weights"])
@pytest.mark.parametrize("drift", list(DRIFTS))
@pytest.mark.parametrize("fully_masked", [False, True], ids=["ragged", "fully-masked"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(SAME_LOSSES))
def test_same_loss_as_verl(case, mode, fully_masked, drift, with_weights):
    """verl's own loss and ours through verl's registry: every micro-batch's loss and the gradient of the
    logits (log-probs by log_softmax), 2 data-parallel ranks x 2 micro-batches, to 1e-6 in fp64."""
    verl_name, ours, extra, shared = SAME_LOSSES[case]
    logits, targets, old, _, advantages, mask, weights = rollout(10 * MODES.index(mode) + len(verl_name), fully_masked,
                                                                 DRIFTS[drift])
    if not with_weights:
        weights = None
    fields = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
                  loss_agg_mode=mode)
    verl_config = actor_config(**fields, policy_loss=VerlPolicyLossConfig(loss_mode=verl_name, **shared))
    policy_loss = dgpo_verl.PolicyLossConfig(loss_mode=ours, **extra, **shared)
    our_config = actor_config(**fields, policy_loss=policy_loss)
    for config in (verl_config, our_config):
        config.global_batch_info.update(global_batch_info(mask, loss_scale_factor=5 if "norm" in mode else None))
    # verl's sapo aggregates by seq-mean-token-mean whatever loss_agg_mode says; ours follows loss_agg_mode
    our_mode = "seq-mean-token-mean" if verl_name == "sapo" else mode
    if verl_name == "gspo" and weights is not None:
        # verl's gspo is GSPO-token: token t's ratio carries the gradient of its own log-prob only, so a
        # per-token rollout weight weighs that token's gradient; ours differentiates the sequence ratio, whose
        # gradient spreads over the response. The two agree for weights constant over a response.
        weights = weights[:, :1].expand(B, T).contiguous()
    theirs_loss, theirs_grad, theirs_metrics = policy_loss_and_grad(verl_name, verl_config, mode, logits, targets, old,
                                                                    advantages, mask, weights)
    our_loss, our_grad, our_metrics = policy_loss_and_grad(ours, our_config, our_mode, logits, targets, old,
                                                           advantages, mask, weights)
    torch.testing.assert_close(our_loss, theirs_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(our_grad, theirs_grad, rtol=1e-6, atol=1e-6)
    assert theirs_grad.abs().sum() > 0
    for ours_m, theirs_m in zip(our_metrics, theirs_metrics):
        if verl_name == "gpg":  # verl's gpg reports no metrics
            assert theirs_m == {}
            continue
        if verl_name == "kl_cov":  # verl's kl_cov logs the mean |l - l_old| as ppo_kl, ours the signed mean
            continue
        assert ours_m["actor/ppo_kl"] == pytest.approx(theirs_m["actor/ppo_kl"], abs=1e-6)
        if verl_name in ("vanilla", "gspo"):  # the clip fractions mean the same there (cispo counts both sides)
            assert ours_m["actor/pg_clipfrac"] == pytest.approx(theirs_m["actor/pg_clipfrac"], abs=1e-6)
            assert ours_m["actor/pg_clipfrac_lower"] == pytest.approx(theirs_m["actor/pg_clipfrac_lower"], abs=1e-6)


@pytest.mark.parametrize("verl_name", ["dppo_tv", "dppo_kl"])
def test_dppo_drops_and_caps_tokens_as_verl(verl_name):
    """Thresholds tight enough that DPPO drops tokens for both signs of the advantage and the cap truncates
    weights (the default ones drop few in this rollout): still verl's loss, gradient and dropped fraction."""
    logits, targets, old, _, advantages, mask, weights = rollout(5, False)
    fields = dict(clip_ratio_low=0.01, clip_ratio_high=0.015, clip_ratio_c=1.2, loss_agg_mode="token-mean")
    verl_config = actor_config(**fields)
    our_config = actor_config(**fields, policy_loss=dgpo_verl.PolicyLossConfig(loss_mode=f"dgpo_ops.{verl_name}"))
    for config in (verl_config, our_config):
        config.global_batch_info.update(global_batch_info(mask))
    log_prob = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    cfg = method_config(verl_name, delta_low=0.01, delta_high=0.015, is_cap=1.2)
    region = token_terms(cfg, log_prob - old, advantages, old).region[mask]
    assert {Region.HP, Region.LN, Region.DUAL} <= set(region.tolist())  # dropped on both sides, and capped
    theirs = policy_loss_and_grad(verl_name, verl_config, "token-mean", logits, targets, old, advantages, mask,
                                  weights)
    ours = policy_loss_and_grad(f"dgpo_ops.{verl_name}", our_config, "token-mean", logits, targets, old, advantages,
                                mask, weights)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-6, atol=1e-6)
    for ours_m, theirs_m in zip(ours[2], theirs[2]):  # no A = 0 token here: the dropped fractions agree
        assert ours_m["actor/pg_clipfrac"] == pytest.approx(theirs_m["actor/pg_clipfrac"], abs=1e-6)
        assert ours_m["actor/pg_clipfrac_lower"] == pytest.approx(theirs_m["actor/pg_clipfrac_lower"], abs=1e-6)


FUSED_LOSSES = ("gpg", "dppo_tv", "dppo_kl", "dro", "geo_mean", "clip_cov", "kl_cov-ratio")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", FUSED_LOSSES)
def test_fused_ops_equal_verl(case, mode):
    """``fused_dgpo_loss(logits, method=name)`` and ``fused_linear_dgpo_loss`` (both kernel sets) on each
    micro-batch, with the aggregation that is verl's mode, equal verl's own loss of that name."""
    verl_name, _, _, shared = SAME_LOSSES[case]
    logits, targets, old, _, advantages, mask, weights = rollout(31 + MODES.index(mode), True, drift=1.5)
    fields = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)
    verl_config = actor_config(**fields, policy_loss=VerlPolicyLossConfig(loss_mode=verl_name, **shared))
    info = global_batch_info(mask, loss_scale_factor=5 if "norm" in mode else None)
    verl_config.global_batch_info.update(info)
    theirs, theirs_grad, _ = policy_loss_and_grad(verl_name, verl_config, mode, logits, targets, old, advantages,
                                                  mask, weights)
    our_config = actor_config(**fields, policy_loss=dgpo_verl.PolicyLossConfig(loss_mode=f"dgpo_ops.{verl_name}",
                                                                               **shared))
    method = dgpo_verl.loss_options(f"dgpo_ops.{verl_name}", our_config).method  # verl's fields, read as verl does
    our_mode = ROW_MEAN if verl_name == "geo_mean" else mode
    hidden_weight = torch.linalg.qr(torch.randn(V, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))[0]

    def linear(logits_rows, *args, **kwargs):  # logits = hidden @ W^T with W orthogonal: hidden = logits @ W
        weight = hidden_weight.to(logits_rows.dtype)
        return dgpo_ops.fused_linear_dgpo_loss(logits_rows @ weight, weight, *args, **kwargs)

    # the torch kernels in fp64 (verl's dtype here), the Triton kernels in fp32 (their widest): fp32's tolerance
    for backend, dtype, tol in (("torch", torch.float64, 1e-6), ("triton", torch.float32, 2e-5)):
        for op in (dgpo_ops.fused_dgpo_loss, linear):
            ours, ours_grad = reference_over_micro_batches(
                our_mode, method, {}, logits.to(dtype), targets, old, None, advantages, mask, weights, 0.0, 0.0, info,
                loss_fn=functools.partial(op, backend=backend))
            torch.testing.assert_close(ours.double(), theirs, rtol=tol, atol=tol)
            torch.testing.assert_close(ours_grad.double(), theirs_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
def test_geo_mean_aggregates_as_verls_without_an_aggregation(mode, backend):
    """``fused_dgpo_loss(..., method="geo_mean")`` with no aggregation is verl's geo_mean on a micro-batch, whatever
    loss_agg_mode verl is given (token_mean there would be another loss and gradient)."""
    logits, targets, old, _, advantages, mask, _ = rollout(41, False, drift=1.5)
    rows = slice(0, PER_MICRO)
    config = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode=mode,
                          policy_loss=VerlPolicyLossConfig(loss_mode="geo_mean"))
    config.global_batch_info.update(global_batch_info(mask))
    leaf = logits[rows].clone().requires_grad_(True)
    log_prob = leaf.log_softmax(-1).gather(-1, targets[rows, :, None])[..., 0]
    theirs, _ = get_policy_loss_fn("geo_mean")(old_log_prob=old[rows], log_prob=log_prob, advantages=advantages[rows],
                                               response_mask=mask[rows], loss_agg_mode=mode, config=config,
                                               rollout_is_weights=None)
    (theirs_grad,) = torch.autograd.grad(theirs, [leaf])
    dtype, tol = (torch.float64, 1e-6) if backend == "torch" else (torch.float32, 2e-5)
    ours_leaf = logits[rows].to(dtype).clone().requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(ours_leaf, targets[rows], advantages[rows].to(dtype), mask[rows],
                                   old[rows].to(dtype), method="geo_mean", backend=backend)
    (ours_grad,) = torch.autograd.grad(out.loss, [ours_leaf])
    torch.testing.assert_close(out.loss.double(), theirs.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ours_grad.double(), theirs_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("verl_name", ["clip_cov", "kl_cov"])
def test_null_fields_are_read_as_verl_reads_them(verl_name):
    """verl's clip_cov and kl_cov read a null policy_loss field as their code's constant (kl_cov's ppo_kl_coef as
    1.0, not the config's 0.1): so does dgpo_ops.<name>."""
    logits, targets, old, _, advantages, mask, weights = rollout(23, False, drift=0.3)
    nulls = {"clip_cov": dict(clip_cov_ratio=1.0, clip_cov_lb=None, clip_cov_ub=None),
             "kl_cov": dict(kl_cov_ratio=None, ppo_kl_coef=None)}[verl_name]
    fields = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean")
    verl_config = actor_config(**fields, policy_loss=VerlPolicyLossConfig(loss_mode=verl_name, **nulls))
    our_config = actor_config(**fields, policy_loss=dgpo_verl.PolicyLossConfig(loss_mode=f"dgpo_ops.{verl_name}",
                                                                               **nulls))
    theirs = policy_loss_and_grad(verl_name, verl_config, "token-mean", logits, targets, old, advantages, mask, weights)
    ours = policy_loss_and_grad(f"dgpo_ops.{verl_name}", our_config, "token-mean", logits, targets, old, advantages,
                                mask, weights)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-6, atol=1e-6)
    if verl_name == "kl_cov":
        assert dgpo_verl.loss_options(f"dgpo_ops.{verl_name}", our_config).method.ppo_kl_coef == 1.0


def test_clip_cov_draws_as_many_tokens_as_verl():
    """At verl's default ratio clip_cov cuts a random few of its candidates. verl draws them with
    ``torch.randperm(K)`` on the CPU's default generator, which needs their count K on the host; ours ranks
    random keys on the device, so the same generator state cannot give the same tokens. What must agree: per
    micro-batch, the number cut (``max(int(ratio N), 1)``, at most K), that every cut token is a candidate, and
    the gradient of every token neither cut: verl's clip_cov with no candidates (a band no covariance reaches)
    gives it."""
    logits, targets, old, _, advantages, mask, weights = rollout(17, False, drift=0.1)
    ratio, band = 0.2, dict(clip_cov_lb=-1.0, clip_cov_ub=1.0)  # a band with more candidates than are cut
    cases = {"verl": ("clip_cov", VerlPolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=ratio, **band)),
             "ours": ("dgpo_ops.clip_cov", dgpo_verl.PolicyLossConfig(loss_mode="dgpo_ops.clip_cov",
                                                                    clip_cov_ratio=ratio, **band)),
             "none": ("clip_cov", VerlPolicyLossConfig(loss_mode="clip_cov", clip_cov_lb=1e9, clip_cov_ub=2e9))}
    per_token = {}
    for key, (name, policy_loss) in cases.items():
        config = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean",
                              policy_loss=policy_loss)
        config.global_batch_info.update(global_batch_info(mask))
        grads = torch.zeros(B, T, dtype=torch.float64)
        for _, rows in micro_batches():
            log_prob = (logits[rows].log_softmax(-1).gather(-1, targets[rows, :, None])[..., 0]).requires_grad_(True)
            torch.manual_seed(3)
            loss, _ = get_policy_loss_fn(name)(old_log_prob=old[rows], log_prob=log_prob, advantages=advantages[rows],
                                               response_mask=mask[rows], loss_agg_mode="token-mean", config=config,
                                               rollout_is_weights=weights[rows])
            (grads[rows],) = torch.autograd.grad(loss, log_prob)
        per_token[key] = grads
    plain = per_token["none"]
    for _, rows in micro_batches():
        m = mask[rows]
        log_prob = logits[rows].log_softmax(-1).gather(-1, targets[rows, :, None])[..., 0]
        r = (log_prob - old[rows]).exp()
        adv = advantages[rows]
        clipped = (-adv * r.clamp(0.8, 1.28) > -adv * r) & m
        a_mean, l_mean = (adv * m).sum() / (m.sum() + 1e-8), (log_prob * m).sum() / (m.sum() + 1e-8)
        cov = (adv - a_mean) * (log_prob - l_mean)
        candidates = m & ~clipped & (cov > -1.0) & (cov < 1.0)
        expected = min(max(int(ratio * int(m.sum())), 1), int(candidates.sum()))
        assert int(candidates.sum()) > expected >= 1, "the rollout must leave a choice to the draw"
        for key in ("verl", "ours"):
            cut = (per_token[key][rows] == 0) & (plain[rows] != 0)
            assert int(cut.sum()) == expected and not (cut & ~candidates).any(), key
            torch.testing.assert_close(per_token[key][rows][~cut], plain[rows][~cut], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_sapo_follows_loss_agg_mode(mode):
    """Ours aggregates SAPO as loss_agg_mode says (verl's sapo always uses seq-mean-token-mean): the
    same per-token loss as the package's reference under every mode."""
    logits, targets, old, _, advantages, mask, _ = rollout(7, True)
    config = actor_config(loss_agg_mode=mode, policy_loss=dgpo_verl.PolicyLossConfig(loss_mode="dgpo_ops.sapo"))
    config.global_batch_info.update(global_batch_info(mask))
    loss, grad, _ = policy_loss_and_grad("dgpo_ops.sapo", config, mode, logits, targets, old, advantages, mask, None)
    expected, expected_grad = reference_over_micro_batches(mode, "sapo", {}, logits, targets, old, None, advantages,
                                                           mask, None, 0.0, 0.0, global_batch_info(mask))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-9)


def our_normalizer(mode, info, T_):
    """The package's loss_normalizer giving verl's normalisation: counts over dp_size (DP's averaging)."""
    count = {"token-mean": info["batch_num_tokens"], "token-sum": 1}.get(mode, info["global_batch_size"])
    if mode == "seq-mean-token-sum-norm":
        count = count * (info["loss_scale_factor"] or T_)
    return count / info["dp_size"]


def reference_over_micro_batches(mode, method, params, logits, targets, old, ref, advantages, mask, weights, beta,
                                 entropy_coef, info, sequence_level=False, loss_fn=reference_loss):
    """``loss_fn`` (the reference, or a fused op) per micro-batch with verl's normalisation of ``mode``; the mode
    ``ROW_MEAN`` is verl's geo_mean's mean over the micro-batch's responses."""
    logits = logits.detach().requires_grad_(True)
    losses = []
    if mode == ROW_MEAN:
        aggregation, normalizer = "seq_mean_token_mean", PER_MICRO
    else:
        aggregation, normalizer = OUR_AGGREGATION[mode], our_normalizer(mode, info, T)
    for _, rows in micro_batches():
        out = loss_fn(logits[rows], targets[rows], advantages[rows, 0], mask[rows], old[rows],
                             None if ref is None else ref[rows], method=method, aggregation=aggregation,
                             loss_normalizer=normalizer, beta=beta, entropy_coef=entropy_coef,
                             rollout_weights=None if weights is None else weights[rows],
                             importance_sampling_level="sequence" if sequence_level else "token", **params)
        losses.append(out.loss)
    (torch.stack(losses).sum() / DP_SIZE).backward()
    return torch.stack(losses).detach(), logits.grad


def ppo_loss_data(rows, logits, targets, old, ref, advantages, mask, weights, info, prompt_len=2):
    """verl's ``ppo_loss`` inputs for one micro-batch, as its FSDP engine hands them over: the model's
    per-token outputs over packed prompt + response tokens (the log-prob of token j+1 at j), the
    response tensors padded, and the global batch info."""
    n = rows.stop - rows.start
    log_prob = logits[rows].log_softmax(-1).gather(-1, targets[rows, :, None])[..., 0]
    log_probs = logits[rows].log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    length = prompt_len + T
    at = (torch.arange(n)[:, None] * length + prompt_len - 1 + torch.arange(T)[None, :]).reshape(-1)

    def packed(values):  # (n, T) response values -> (n * length,) as the model's packed output
        return torch.zeros(n * length, dtype=values.dtype).index_put((at,), values.reshape(-1))

    data = TensorDict({
        "prompts": torch.zeros(n, prompt_len, dtype=torch.long),
        "responses": targets[rows],
        "attention_mask": torch.ones(n, length, dtype=torch.long),
        "response_mask": mask[rows].long(),
        "old_log_probs": old[rows],
        "advantages": advantages[rows],
        "ref_log_prob": ref[rows],
        "rollout_is_weights": weights[rows],
    }, batch_size=[n])
    tu.assign_non_tensor(data, dp_size=info["dp_size"], batch_num_tokens=info["batch_num_tokens"],
                         global_batch_size=info["global_batch_size"])
    return {"log_probs": packed(log_prob), "entropy": packed(entropy)}, data


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("method", "params"), variants(), ids=[f"{m}-{i}" for i, (m, _) in enumerate(variants())])
def test_ppo_loss_equals_reference(method, params, mode):
    """Every method of the table through verl's ``ppo_loss`` (its entropy bonus and low-variance KL
    included, rollout weights on) equals ``reference_loss`` under the same aggregation, with the
    normalisation of 2 ranks x 2 micro-batches, fully masked responses among them."""
    logits, targets, old, ref, advantages, mask, weights = rollout(11, True)
    info = global_batch_info(mask)
    params = dict(params)
    config = actor_config(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05,
                          kl_loss_type="low_var_kl", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                          policy_loss=dgpo_verl.PolicyLossConfig(loss_mode=f"dgpo_ops.{method}",
                                                                 method_params=params))
    leaf = logits.detach().requires_grad_(True)
    losses = []
    for _, rows in micro_batches():
        model_output, data = ppo_loss_data(rows, leaf, targets, old, ref, advantages, mask, weights, info)
        loss, metrics = ppo_loss(config, model_output, data)
        losses.append(loss)
    (torch.stack(losses).sum() / DP_SIZE).backward()
    # verl's fields the method reads (clip_ratio_* and tau_*: verl's defaults), as the reference takes them
    resolved = dgpo_verl.loss_options(f"dgpo_ops.{method}", config).method
    if resolved.name == "geo_mean":  # verl's geo_mean: a mean over the micro-batch's rows, its own; the terms
        # ppo_loss adds (entropy, KL) by loss_agg_mode: the policy term alone, then those with A = 0 (no policy term)
        policy, policy_grad = reference_over_micro_batches(  # no KL term here, so no reference log-probs
            ROW_MEAN, resolved, {}, logits, targets, old, None, advantages, mask, weights, 0.0, 0.0, info)
        terms, terms_grad = reference_over_micro_batches(
            mode, resolved, {}, logits, targets, old, ref, torch.zeros_like(advantages), mask, weights, 0.05, 0.01,
            info)
        expected, expected_grad = policy + terms, policy_grad + terms_grad
    else:
        expected, expected_grad = reference_over_micro_batches(
            mode, resolved, {}, logits, targets, old, ref, advantages, mask, weights, 0.05, 0.01, info)
    torch.testing.assert_close(torch.stack(losses).detach(), expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(leaf.grad, expected_grad, rtol=1e-6, atol=1e-9)
    assert "actor/dgpo_ops/eur" in metrics and "kl_loss" in metrics


def test_gspo_through_ppo_loss():
    """importance_sampling_level='sequence' (GSPO's ratio) through ppo_loss equals the reference."""
    logits, targets, old, ref, advantages, mask, weights = rollout(13, False)
    info = global_batch_info(mask)
    mode = "seq-mean-token-mean"
    config = actor_config(loss_agg_mode=mode, policy_loss=dgpo_verl.PolicyLossConfig(
        loss_mode="dgpo_ops.dgpo", importance_sampling_level="sequence", method_params={"n": 2.0}))
    leaf = logits.detach().requires_grad_(True)
    losses = []
    for _, rows in micro_batches():
        model_output, data = ppo_loss_data(rows, leaf, targets, old, ref, advantages, mask, weights, info)
        losses.append(ppo_loss(config, model_output, data)[0])
    (torch.stack(losses).sum() / DP_SIZE).backward()
    expected, expected_grad = reference_over_micro_batches(mode, "dgpo", {"n": 2.0}, logits, targets, old, None,
                                                           advantages, mask, weights, 0.0, 0.0, info,
                                                           sequence_level=True)
    torch.testing.assert_close(torch.stack(losses).detach(), expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(leaf.grad, expected_grad, rtol=1e-6, atol=1e-9)


def test_one_process_normalisation_leaves_fully_masked_responses_out():
    """Without global_batch_info (one process) verl counts this micro-batch's responses that have a
    scored token; so do we, for every sequence-level mode."""
    logits, targets, old, _, advantages, mask, _ = rollout(5, True)
    log_prob = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    for mode in MODES:
        config = actor_config(loss_agg_mode=mode)
        ours = get_policy_loss_fn("dgpo_ops.grpo")(old, log_prob, advantages, mask, mode, config)[0]
        theirs = get_policy_loss_fn("vanilla")(old, log_prob, advantages, mask, mode, config)[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


def test_entry_point_registers_on_plain_import():
    """``import verl`` alone (no import of dgpo_ops) makes every dgpo_ops.<method> a verl policy loss."""
    code = ("import verl\nfrom verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
            "import sys\nprint(sorted(n for n in sys.modules if n.startswith('dgpo_ops.integrations')))\n"
            f"print([get_policy_loss_fn('dgpo_ops.' + m).__name__ for m in {list(POLICY_LOSSES)!r}])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "auto"}).stdout
    assert "dgpo_ops.integrations.verl" in out
    for name in POLICY_LOSSES:
        assert f"policy_loss_{name}" in out


def test_dapo_is_grpo_with_clip_higher_over_verls_field():
    """``dgpo_ops.dapo`` takes DAPO's eps_high = 0.28 whatever clip_ratio_high says (verl's fields always
    hold a value); ``method_params`` still wins."""
    logits, targets, old, _, advantages, mask, _ = rollout(17, False)
    log_prob = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    ours = get_policy_loss_fn("dgpo_ops.dapo")(old, log_prob, advantages, mask, "token-mean", actor_config())[0]
    theirs = get_policy_loss_fn("vanilla")(old, log_prob, advantages, mask, "token-mean",
                                           actor_config(clip_ratio_high=0.28))[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)
    config = actor_config(policy_loss=dgpo_verl.PolicyLossConfig(loss_mode="dgpo_ops.dapo",
                                                                 method_params={"eps_high": 0.4}))
    assert dgpo_verl.loss_options("dgpo_ops.dapo", config).method.eps_high == 0.4


def test_hydra_command_line_sets_method_params():
    """The README's command line: verl's own ppo_trainer config composed with the overrides, the actor
    config built as verl's workers build it (hydra instantiate), and the loss reads n and m."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    overrides = ["actor_rollout_ref.actor.policy_loss.loss_mode=dgpo_ops.dgpo",
                 "actor_rollout_ref.actor.policy_loss._target_=dgpo_ops.integrations.verl.PolicyLossConfig",
                 "+actor_rollout_ref.actor.policy_loss.method_params.n=3",
                 "+actor_rollout_ref.actor.policy_loss.method_params.m=4",
                 "actor_rollout_ref.actor.clip_ratio_high=0.28",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, dgpo_verl.PolicyLossConfig)
    method = dgpo_verl.loss_options("dgpo_ops.dgpo", actor).method
    assert (method.n, method.m, method.eps_high) == (3, 4, 0.28)
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        bad = compose(config_name="ppo_trainer", overrides=overrides[:2] + [
            "+actor_rollout_ref.actor.policy_loss.method_params.q=3",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    with pytest.raises(Exception) as error:  # hydra wraps the config's ValueError in its InstantiationException
        omega_conf_to_dataclass(bad.actor_rollout_ref.actor)
    assert "actor_rollout_ref.actor.policy_loss.method_params.q" in str(error.value)


def test_method_params_need_no_target_line():
    """Without the ``_target_`` line verl's actor config names this package's PolicyLossConfig (the plugin selects
    it on import), so ``method_params`` reach the loss; a bad name is still named; a loss of verl's builds as
    before."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")

    def actor(*overrides):
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=[
                *overrides, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
        return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)

    built = actor("actor_rollout_ref.actor.policy_loss.loss_mode=dgpo_ops.dgpo",
                  "+actor_rollout_ref.actor.policy_loss.method_params.n=3")
    assert isinstance(built.policy_loss, dgpo_verl.PolicyLossConfig)
    assert dgpo_verl.loss_options("dgpo_ops.dgpo", built).method.n == 3
    with pytest.raises(Exception) as error:  # hydra wraps the config's ValueError in its InstantiationException
        actor("actor_rollout_ref.actor.policy_loss.loss_mode=dgpo_ops.dgpo",
              "+actor_rollout_ref.actor.policy_loss.method_params.q=3")
    assert "actor_rollout_ref.actor.policy_loss.method_params.q" in str(error.value)
    vanilla = actor("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla")
    assert vanilla.policy_loss.loss_mode == "vanilla" and vanilla.policy_loss.method_params == {}


def test_bad_input_is_named():
    logits, targets, old, _, advantages, mask, _ = rollout(3, False)
    log_prob = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    fn = get_policy_loss_fn("dgpo_ops.dgpo")

    def message(config, mode="token-mean", response_mask=mask):
        return value_error_message(lambda: fn(old, log_prob, advantages, response_mask, mode, config))

    # an unknown hyperparameter, at the first step when the config was not built by hydra
    config = actor_config(policy_loss=dgpo_verl.PolicyLossConfig(loss_mode="dgpo_ops.grpo"))
    object.__setattr__(config.policy_loss, "method_params", {"eps_low_pos": 0.1})
    assert "policy_loss.method_params.eps_low_pos" in message(config)
    # a value out of range from a verl field, named by that field
    assert "actor_rollout_ref.actor.clip_ratio_low" in message(actor_config(clip_ratio_low=1.5))
    # an aggregation verl does not have
    assert "seq-sum-token-mean" in message(actor_config(), mode="seq-sum-token-mean")
    # a config that is not verl's actor config
    assert "actor_rollout_ref.actor" in message({"clip_ratio": 0.2})
    assert "needs verl's actor config" in message(None)
    # dp_size > 1 without the global counts verl's engine sets
    config = actor_config()
    config.global_batch_info.update(dp_size=2)
    assert "global_batch_info['batch_num_tokens']" in message(config)
    assert "response_mask must have shape" in message(actor_config(), response_mask=mask[:, :-1])
    config = actor_config()
    config.global_batch_info.update(dp_size=0)
    assert "dp_size" in message(config)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        dgpo_verl.PolicyLossConfig(loss_mode="dgpo_ops.grpo", importance_sampling_level="seq")
    with pytest.raises(ValueError, match="read by the losses dgpo_ops"):
        dgpo_verl.PolicyLossConfig(loss_mode="vanilla", method_params={"n": 2})


# --------------------------------------------------------------------------------------------
# The fused backend against verl's torch backend
# --------------------------------------------------------------------------------------------


def fused_pair(dtype, shape=(3, 9), H=16, V_=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g, dtype=dtype)
    weight = torch.randn(V_, H, generator=g, dtype=dtype) / 2
    labels = torch.randint(0, V_, shape, generator=g)
    grads = torch.randn(2, *shape, generator=g, dtype=torch.float64)
    return hidden, weight, labels, grads


def run_backend(fn, hidden, weight, labels, grads, temperature):
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, entropy = fn(hidden, weight, labels, temperature)
    logp, entropy = logp.reshape(labels.shape), entropy.reshape(labels.shape)
    (logp * grads[0].to(logp.dtype) + entropy * grads[1].to(entropy.dtype)).sum().backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight.grad


def exact_backend(hidden, weight, labels, temperature):
    """log_softmax and autograd in the inputs' dtype (fp64: the ground truth)."""
    log_probs = ((hidden @ weight.t()) / temperature).log_softmax(-1)
    return log_probs.gather(-1, labels[..., None])[..., 0], -(log_probs.exp() * log_probs).sum(-1)


def verl_torch_backend(hidden, weight, labels, temperature):
    return FusedLinearForPPO(chunk_size=4)(hidden, weight, labels, temperature)


def ours(backend):
    def run(hidden, weight, labels, temperature):
        logp, entropy = dgpo_verl.linear_logprob_entropy(hidden, weight, labels, temperature=temperature,
                                                         backend=backend, memory_budget=37 * 8 * 8)
        return logp, entropy
    return run


# verl's torch backend takes log-probs in fp32 whatever the input (fp64 too): tolerances of fp32
@pytest.mark.parametrize(("backend", "dtype", "tol"), [("torch", torch.float64, 1e-5), ("torch", torch.float32, 2e-5),
                                                      ("triton", torch.float32, 2e-5)])
@pytest.mark.parametrize("shape", [(3, 9), (27,), (1, 31)], ids=["batch", "flat", "packed"])
def test_fused_backend_equals_verl_torch_backend(backend, dtype, tol, shape):
    """log-probs, entropies and the gradients of hidden and weight from both outputs, against verl's
    FusedLinearForPPO (chunked torch), at temperature 0.7; several token chunks on our side."""
    hidden, weight, labels, grads = fused_pair(dtype, shape)
    theirs = run_backend(verl_torch_backend, hidden, weight, labels, grads, 0.7)
    got = run_backend(ours(backend), hidden, weight, labels, grads, 0.7)
    for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), got, theirs):
        torch.testing.assert_close(a.to(b.dtype), b, rtol=tol, atol=tol, msg=name)


def test_linear_cross_entropy_contract():
    """verl's signature: flat per-token outputs, reduction='none' only."""
    hidden, weight, labels, _ = fused_pair(torch.float32, (2, 5))
    logp, entropy = dgpo_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "none")
    assert logp.shape == entropy.shape == (10,) and logp.dtype == entropy.dtype == torch.float32
    expected = (hidden @ weight.t()).log_softmax(-1).gather(-1, labels[..., None]).reshape(-1)
    torch.testing.assert_close(logp, expected)
    assert "reduction" in value_error_message(
        lambda: dgpo_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "mean"))


def test_fp32_head_projects_in_fp32_under_autocast():
    """An fp32 lm_head with bf16 hidden states under bf16 autocast (TRL's cast_lm_head_to_fp32; a head kept in
    fp32): the projection runs in fp32, values and the hidden states' gradient, not in autocast's bf16."""
    hidden, weight, labels, _ = fused_pair(torch.float32, (4, 16))
    hidden = (hidden * 3).to(torch.bfloat16).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = dgpo_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "none")
    wide = hidden.detach().float().requires_grad_(True)
    expected = (wide @ weight.t()).log_softmax(-1).gather(-1, labels[..., None]).reshape(-1)
    torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-5)
    bf16 = (hidden.detach() @ weight.to(torch.bfloat16).t()).float().log_softmax(-1).gather(-1, labels[..., None])
    assert (bf16.reshape(-1) - expected).abs().max() > 1e-3  # what autocast's products would have given
    (logp.sum() + entropy.sum()).backward()
    probs = (wide @ weight.t()).softmax(-1)
    (expected.sum() - (probs * probs.log()).sum()).backward()
    torch.testing.assert_close(hidden.grad.float(), wide.grad, rtol=2e-2, atol=2e-2)  # a bf16 gradient


def test_fused_backend_with_a_split_vocabulary(tmp_path):
    """2 gloo processes, each with half the lm_head's rows and ``dist_process_group``: log-probs,
    entropies, the hidden state's gradient and each process's rows of the weight's gradient equal verl's
    torch backend on the whole weight."""
    world = 2
    mp.spawn(verl_workers.split_vocabulary_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world,
             join=True)
    hidden, weight, labels, grads = verl_workers.split_inputs()
    rows = weight.shape[0] // world
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("error")
    # fp64 against the exact answer; against verl's torch backend (fp32 inside) to fp32's precision
    for backend, tol in ((exact_backend, 1e-10), (verl_torch_backend, 1e-5)):
        logp, entropy, grad_hidden, grad_weight = run_backend(backend, hidden, weight, labels, grads,
                                                              verl_workers.TEMPERATURE)
        for rank, result in enumerate(results):
            got = (result["logp"].reshape(labels.shape), result["entropy"].reshape(labels.shape),
                   result["grad_hidden"], result["grad_weight"])
            expected = (logp, entropy, grad_hidden, grad_weight[rank * rows:(rank + 1) * rows])
            for name, a, b in zip(("logp", "entropy", "d hidden", "d weight rows"), got, expected):
                torch.testing.assert_close(a, b.to(a.dtype), rtol=tol, atol=tol, msg=f"rank {rank}: {name}")


def test_megatron_layout_and_megatron_forwards():
    """Megatron's packed path hands hidden states (total, 1, H) with labels (1, total): tokens are tokens, as
    in verl's kernel. A Megatron forward module loaded before the switch gets our function too."""
    hidden, weight, labels, _ = fused_pair(torch.float32, (7,))
    flat = dgpo_verl.linear_cross_entropy(hidden, weight, labels)
    packed = dgpo_verl.linear_cross_entropy(hidden[:, None, :], weight, labels[None, :])
    for a, b in zip(packed, flat):
        torch.testing.assert_close(a, b)
    assert "labels hold 6 tokens" in value_error_message(
        lambda: dgpo_verl.linear_cross_entropy(hidden, weight, labels[:6]))
    import types

    stand_in = types.ModuleType(dgpo_verl.MEGATRON_FORWARDS[0])
    stand_in.linear_cross_entropy = object()
    sys.modules[stand_in.__name__] = stand_in
    try:
        dgpo_verl.use_fused_kernels()
        assert stand_in.linear_cross_entropy is dgpo_verl.linear_cross_entropy
    finally:
        del sys.modules[stand_in.__name__]
        import verl.utils.kernel.linear_cross_entropy as verl_kernel

        verl_kernel.linear_cross_entropy = verl_kernel.LinearCrossEntropy.apply  # verl's own again


@pytest.mark.parametrize(("value", "switched"), [("1", True), ("TRUE", True), ("0", False), ("FALSE", False),
                                                 ("off", False)])
def test_switch_values(value, switched):
    code = ("import verl, verl.utils.kernel.linear_cross_entropy as k, dgpo_ops.integrations.verl as d\n"
            "print(k.linear_cross_entropy is d.linear_cross_entropy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "DGPO_OPS_VERL_FUSED_KERNELS": value}).stdout
    assert out.strip().splitlines()[-1] == str(switched)


def test_switch_makes_verl_forward_use_dgpo_ops(tmp_path):
    """DGPO_OPS_VERL_FUSED_KERNELS=1: after ``import verl`` alone, verl's Triton fused forward of a tiny
    Qwen2 (patched by verl's own apply_monkey_patch) runs dgpo-ops' kernels and gives what verl's torch
    backend gives."""
    script = tmp_path / "switch.py"
    script.write_text(SWITCH_SCRIPT)
    env = {**os.environ, "DGPO_OPS_VERL_FUSED_KERNELS": "1"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "calls: 1" in out.stdout and "match" in out.stdout, out.stdout


SWITCH_SCRIPT = r'''
import torch, verl
import verl.utils.kernel.linear_cross_entropy as verl_kernel
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.models.transformers.monkey_patch import apply_monkey_patch
import dgpo_ops.integrations.verl as dgpo_verl

assert verl_kernel.linear_cross_entropy is dgpo_verl.linear_cross_entropy, verl_kernel.linear_cross_entropy
calls = []
original = dgpo_verl.linear_logprob_entropy
def counted(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)
dgpo_verl.linear_logprob_entropy = counted

torch.manual_seed(0)
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
model = Qwen2ForCausalLM(config).float()
input_ids = torch.randint(0, 64, (2, 10))
outputs = {}
for backend in ("torch", "triton"):
    apply_monkey_patch(model=model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend=backend)
    out = model(input_ids=input_ids, temperature=0.9, return_dict=True)
    out.log_probs.sum().backward()
    outputs[backend] = (out.log_probs.reshape(-1).detach(), out.entropy.reshape(-1).detach(),
                        model.lm_head.weight.grad.clone())
    model.zero_grad()
print("calls:", len(calls))
for a, b in zip(outputs["torch"], outputs["triton"]):
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-5, atol=2e-5)
print("match")
'''


def test_bench_script_runs(tmp_path):
    """bench/verl_fused.py at a tiny size: every competitor recorded, ours and verl's torch backend on the
    same loss; verl's Triton kernel reported as needing CUDA where there is none."""
    script = Path(__file__).resolve().parents[2] / "bench" / "verl_fused.py"
    subprocess.run([sys.executable, str(script), "--sizes", "64x16x256", "--repeats", "1", "--out-dir",
                    str(tmp_path)], check=True, capture_output=True, text=True)
    (path,) = tmp_path.glob("verl_fused-*.json")
    results = json.loads(path.read_text())["rows"][0]["results"]
    assert results["ours"]["loss"] == pytest.approx(results["verl_torch"]["loss"], rel=1e-5)
    if not torch.cuda.is_available():
        assert "needs CUDA" in results["verl_triton"]["error"]
    assert path.with_suffix(".md").read_text().count("| 64 | 16 | 256 |") == 1
