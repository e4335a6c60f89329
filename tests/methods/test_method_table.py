"""The method table: psi is the derivative of L, regions follow their definitions, DGPO's claims,
and the identities between methods."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import METHOD_VARIANTS, config, spanning_tokens, variant_id

import dgpo_ops
from dgpo_ops import Region, method_config, token_terms
from dgpo_ops.methods.dcpo import dcpo_bounds

# Methods without a trust region: every token in M (kl_cov's selection adds a penalty, never a region).
NO_TRUST_REGION = ("sapo", "gpg", "vespo", "dro", "geo_mean", "kl_cov")


def unselected(cfg, log_ratio, adv, old_logp):
    """The table's per-token terms without a batch-level selection (no token scored for it)."""
    return token_terms(cfg, log_ratio, adv, old_logp, scored=torch.zeros_like(adv, dtype=torch.bool))


def expected_regions(cfg, log_ratio, adv, old_logp):
    r = log_ratio.clamp(-20, 20).exp()
    if cfg.name in NO_TRUST_REGION:
        return torch.zeros_like(r, dtype=torch.int8)
    if cfg.name in ("dppo_tv", "dppo_kl"):  # a trust region in probability space (docs/math.md)
        p, q = (log_ratio + old_logp).exp(), old_logp.exp()
        # dropped where the divergence exceeds the threshold (a NaN divergence, p > 1 here, drops nothing)
        if cfg.name == "dppo_tv":
            dropped = torch.where(adv > 0, p - q > cfg.delta_high, p - q < -cfg.delta_low)
        else:
            kl = q * (old_logp - log_ratio - old_logp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
            dropped = torch.where(adv > 0, (kl > cfg.delta_high) & (p > q), (kl > cfg.delta_low) & (p < q))
        kept = ~dropped
        region = torch.full_like(r, Region.M, dtype=torch.int8)
        region[~kept & (adv > 0)] = Region.HP
        region[~kept & (adv < 0)] = Region.LN
        region[kept & (r > cfg.is_cap) & (adv != 0)] = Region.DUAL
        return region
    if cfg.name == "topr":  # without scores the advantage's sign splits the samples: a negative one's cut ratio
        return torch.where((adv < 0) & (r > 1), Region.DUAL, Region.M).to(torch.int8)
    if cfg.name in ("prime_dppo", "prime_ipo"):  # DPPO-TV's keep mask (prime_ipo: both sides for every A)
        p, q = (log_ratio + old_logp).exp(), old_logp.exp()
        rose, fell = p - q > cfg.delta_high, p - q < -cfg.delta_low
        dropped = (rose | fell) if cfg.name == "prime_ipo" else torch.where(adv > 0, rose, fell)
        region = torch.full_like(r, Region.M, dtype=torch.int8)
        region[dropped & (p > q) & (adv > 0)] = Region.HP
        region[dropped & (p > q) & (adv < 0)] = Region.HN
        region[dropped & (p < q) & (adv > 0)] = Region.LP
        region[dropped & (p < q) & (adv < 0)] = Region.LN
        return region
    if cfg.name == "dcpo":
        low, high = dcpo_bounds(cfg, old_logp)
    elif cfg.name == "dispo":
        neg = adv < 0
        low = torch.where(neg, torch.full_like(r, 1 - cfg.eps_low_neg), torch.full_like(r, 1 - cfg.eps_low_pos))
        high = torch.where(neg, torch.full_like(r, 1 + cfg.eps_high_neg), torch.full_like(r, 1 + cfg.eps_high_pos))
    else:
        low, high = 1 - cfg.eps_low, 1 + cfg.eps_high
    region = torch.full_like(r, Region.M, dtype=torch.int8)
    region[(r < low) & (adv < 0)] = Region.LN
    region[(r > high) & (adv > 0)] = Region.HP
    region[(r < low) & (adv > 0)] = Region.LP
    region[(r > high) & (adv < 0)] = Region.HN
    # TRL's cap (grpo's, fipo's) fires where it silences a token PPO leaves alone
    if cfg.name in ("grpo", "fipo") and cfg.delta is not None:
        high = 1 + cfg.eps_high
        region[(adv > 0) & (r > cfg.delta) & (r <= high)] = Region.DUAL
        region[(adv < 0) & (r > high) & (r > cfg.delta)] = Region.DUAL
    if cfg.name in ("grpo", "gppo", "ce_gppo") and cfg.dual_clip is not None:
        region[(adv < 0) & (r > cfg.dual_clip)] = Region.DUAL
    if cfg.name == "dcpo":
        region[(adv < 0) & (r > cfg.r_max)] = Region.DUAL
    if cfg.name == "aspo":
        c = cfg.dual_clip
        region[(adv > 0) & (1 / torch.clamp(r, max=1 + cfg.eps_high) > c)] = Region.DUAL
        region[(adv < 0) & (torch.clamp(r, min=1 - cfg.eps_low) > c)] = Region.DUAL
    return region


@pytest.mark.parametrize("variant", METHOD_VARIANTS, ids=variant_id)
def test_psi_is_the_derivative_of_the_loss(variant):
    cfg = config(variant)
    log_ratio, adv, old_logp = spanning_tokens(cfg)
    log_ratio.requires_grad_(True)
    terms = token_terms(cfg, log_ratio, adv, old_logp)
    (grad,) = torch.autograd.grad(terms.loss.sum(), log_ratio)
    # a penalty whose slope is not proportional to A (dro's, kl_cov's on its chosen tokens) adds its own
    slope = 0.0 if terms.penalty_slope is None else terms.penalty_slope
    assert (terms.penalty_slope is not None) == (cfg.name in ("dro", "kl_cov", "prime_dppo", "prime_ipo"))
    torch.testing.assert_close(grad, -adv * terms.psi + slope, rtol=1e-12, atol=1e-12)
    assert not terms.psi.requires_grad
    assert torch.isfinite(terms.loss).all() and torch.isfinite(terms.psi).all()


@pytest.mark.parametrize("variant", METHOD_VARIANTS, ids=variant_id)
def test_regions_follow_their_definitions(variant):
    cfg = config(variant)
    log_ratio, adv, old_logp = spanning_tokens(cfg)
    region = unselected(cfg, log_ratio, adv, old_logp).region
    expected = expected_regions(cfg, log_ratio, adv, old_logp)
    assert torch.equal(region, expected)
    assert (region[adv == 0] == Region.M).all()
    if cfg.name in ("dppo_tv", "dppo_kl"):  # tokens are dropped on both sides, weights truncated
        assert {Region.HP, Region.LN, Region.DUAL} <= set(region.tolist())
    elif cfg.name == "topr":
        assert Region.DUAL in set(region.tolist())
    elif cfg.name == "prime_dppo":
        assert {Region.HP, Region.LN} <= set(region.tolist())
    elif cfg.name == "prime_ipo":  # dropped whatever the sign of A
        assert {Region.HP, Region.LP, Region.HN, Region.LN} <= set(region.tolist())
    elif cfg.name not in NO_TRUST_REGION:  # a ratio trust region: both sides of it are reached
        # (a delta below 1 + eps_high turns every HN token into DUAL: TRL's cap silences them)
        far_side = Region.DUAL if getattr(cfg, "delta", None) is not None and cfg.delta < 1 + cfg.eps_high else Region.HN
        assert {Region.HP, far_side} <= set(region.tolist())


def test_spanning_tokens_reach_every_region():
    cfg = method_config("grpo", dual_clip=3.0)
    region = token_terms(cfg, *spanning_tokens(cfg)).region
    assert set(region.tolist()) == {r.value for r in Region}


def test_log_ratio_clamp_bounds_psi_and_keeps_the_gradient():
    cfg = method_config("dgpo")
    log_ratio = torch.tensor([-40.0, 40.0, 25.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    terms = token_terms(cfg, log_ratio, adv, torch.zeros(3, dtype=torch.float64))
    (grad,) = torch.autograd.grad(terms.loss.sum(), log_ratio)
    assert torch.all(grad != 0)
    torch.testing.assert_close(terms.psi[1], torch.tensor(math.exp(20.0), dtype=torch.float64))
    assert terms.psi[1] == terms.psi[2]


# ----------------------------------------------------------------------------- DGPO


def dgpo_psi(r, adv, **params):
    cfg = method_config("dgpo", **params)
    r = torch.as_tensor(r, dtype=torch.float64)
    return token_terms(cfg, r.log(), torch.full_like(r, adv), torch.full_like(r, math.log(0.4))).psi


@pytest.mark.parametrize("n, m", [(0.0, 1.0), (1.0, 2.0), (2.0, 2.0), (3.5, 4.0), (1.0, 1.0)])
def test_dgpo_psi_is_continuous_at_both_boundaries(n, m):
    eps_low, eps_high = 0.2, 0.28
    for boundary, adv in ((1 - eps_low, -1.0), (1 + eps_high, 1.0)):
        delta = 1e-9
        left, at, right = dgpo_psi([boundary * (1 - delta), boundary, boundary * (1 + delta)], adv,
                                   n=n, m=m, eps_low=eps_low, eps_high=eps_high)
        assert abs(left - at) < 1e-7 and abs(right - at) < 1e-7
        assert at == pytest.approx(boundary, rel=1e-12)  # psi = r on the boundary


def test_dgpo_m1_right_boundary_is_gppo_constant():
    r = torch.tensor([1.21, 1.5, 3.0, 50.0], dtype=torch.float64)
    torch.testing.assert_close(dgpo_psi(r, 1.0, m=1.0), torch.full_like(r, 1.2), rtol=1e-12, atol=0)


def test_dgpo_n0_left_boundary_keeps_plain_ratio():
    r = torch.tensor([0.79, 0.5, 0.1, 1e-3], dtype=torch.float64)
    torch.testing.assert_close(dgpo_psi(r, -1.0, n=0.0), r, rtol=1e-12, atol=0)


@pytest.mark.parametrize("n", [1.0, 2.0])
def test_dgpo_probability_weight_vanishes_where_gppo_diverges(n):
    q = 0.4
    r = torch.tensor([1e-1, 1e-2, 1e-3, 1e-4, 1e-5], dtype=torch.float64)
    pi = r * q
    cfg_args = (r.log(), torch.full_like(r, -1.0), torch.full_like(r, math.log(q)))
    w_dgpo = token_terms(method_config("dgpo", n=n), *cfg_args).psi / pi
    w_gppo = token_terms(method_config("gppo"), *cfg_args).psi / pi
    assert torch.all(w_dgpo[1:] < w_dgpo[:-1]) and w_dgpo[-1] < 1e-4
    assert torch.all(w_gppo[1:] > w_gppo[:-1]) and w_gppo[-1] > 1e5


# ----------------------------------------------------------------------------- identities


def assert_same_terms(a, b):
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.psi, b.psi, rtol=1e-12, atol=1e-12)
    assert torch.equal(a.region, b.region)


@pytest.mark.parametrize("low, high", [(0.2, 0.28), (1.0, 4.0), (0.5, 100.0)])
def test_dispo_with_equal_bounds_is_cispo(low, high):
    cispo = method_config("cispo", eps_low=low, eps_high=high)
    dispo = method_config("dispo", eps_low_pos=low, eps_high_pos=high, eps_low_neg=low, eps_high_neg=high)
    tokens = spanning_tokens(cispo)
    assert_same_terms(token_terms(dispo, *tokens), token_terms(cispo, *tokens))


def test_ce_gppo_with_unit_betas_is_gppo():
    gppo = method_config("gppo", eps_high=0.28)
    tokens = spanning_tokens(gppo)
    ce = method_config("ce_gppo", beta1=1.0, beta2=1.0, eps_high=0.28)
    assert_same_terms(token_terms(ce, *tokens), token_terms(gppo, *tokens))


def test_grpo_with_eps_high_028_is_dapo_clip():
    cfg = method_config("grpo", eps_high=0.28)
    log_ratio, adv, old_logp = spanning_tokens(cfg)
    r = log_ratio.exp()
    dapo = torch.maximum(-adv * r, -adv * torch.clamp(r, 0.8, 1.28))
    torch.testing.assert_close(token_terms(cfg, log_ratio, adv, old_logp).loss, dapo, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", METHOD_VARIANTS, ids=variant_id)
def test_on_policy_gives_ratio_one_and_the_plain_policy_gradient(variant):
    name, params = variant
    if name == "clip_cov":  # clip_cov cuts a token's gradient on policy too: tests/methods/test_token_selection.py
        params = {**params, "clip_cov_lb": 1e6, "clip_cov_ub": 2e6}  # a covariance band no token reaches
    B, T, V = 2, 4, 7
    torch.manual_seed(0)
    logits = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, V, (B, T))
    adv = torch.tensor([0.7, -1.1], dtype=torch.float64)
    # token_mean named: dcpo's own aggregation (seq_sum_token_mean) would scale the gradient by B
    out = dgpo_ops.reference_loss(logits, target, adv, method=name, aggregation="token_mean", **params)
    assert out.metrics["ratio_mean"] == 1.0
    # psi on-policy, per response: 1, but prime-rl's adv_tau and topr's sample weights scale it
    psi = torch.full((B,), params.get("adv_tau", 1.0), dtype=torch.float64)
    if name == "topr":  # no scores: the advantage's sign splits the samples
        psi = torch.where(adv > 0, params.get("positive_weight", 1.0), params.get("negative_weight", 1.0))
    assert out.metrics["eur"] == pytest.approx(psi.mean().item(), abs=1e-12)
    (grad,) = torch.autograd.grad(out.loss, logits)
    # psi = 1 on-policy: the gradient is the plain policy gradient -A (onehot - p) / N.
    onehot = torch.nn.functional.one_hot(target, V).double()
    expected = -(psi * adv)[:, None, None] * (onehot - logits.detach().softmax(-1)) / (B * T)
    # geo_mean's mean divides by |o_i| + 1e-8, as verl's: a relative 1e-8 / |o_i| off the plain gradient
    rtol = 1e-8 if name == "geo_mean" else 1e-10
    torch.testing.assert_close(grad, expected, rtol=rtol, atol=1e-12)


def test_vespo_weight_beyond_float32_is_trls_zero():
    """k = 10, lambda = 0 (floored at 1e-4) and a summed log-ratio of 10: the gamma weight e^97.8 = 3e42 overflows
    float32; TRL's get_gamma_weights maps it to 0 (nan_to_num(posinf=0)), so does the table (not inf, and a NaN
    loss). Each sign's parameters, and a log-ratio whose weight stays finite beside them."""
    GRPOTrainer = pytest.importorskip("trl").GRPOTrainer  # noqa: N806

    cfg = dgpo_ops.method_config("vespo", k_pos=10.0, lambda_pos=0.0, k_neg=10.0, lambda_neg=0.0)
    log_ratio = torch.tensor([10.0, 10.0, 5.0, 5.0])
    adv = torch.tensor([1.3, -0.7, 1.3, -0.7])
    old_logp = torch.full_like(log_ratio, math.log(0.3))
    trl_phi = GRPOTrainer.get_gamma_weights(adv[:, None], log_ratio[:, None], torch.ones(4, 1), None, k_pos=10.0,
                                            lambda_pos=0.0, k_neg=10.0, lambda_neg=0.0)[:, 0]
    assert torch.equal(trl_phi[:2], torch.zeros(2)) and trl_phi[2:].isfinite().all() and (trl_phi[2:] > 1e20).all()
    want = token_terms(cfg, log_ratio, adv, old_logp)
    torch.testing.assert_close(want.psi, trl_phi, rtol=2e-6, atol=0)
    torch.testing.assert_close(want.loss, -adv * trl_phi * (log_ratio + old_logp), rtol=2e-6, atol=0)
