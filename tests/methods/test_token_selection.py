"""The methods the table evaluates beyond a token's own terms, against their definitions written out here:
the batch-level selections of clip_cov (a random few candidates cut) and kl_cov (the top covariances
penalised), geo_mean's clipped geometric mean, and dro's quadratic penalty. verl's own implementations are
the oracle in tests/integrations/test_verl.py; these pin the definitions on every path of the package."""

from __future__ import annotations

import pytest
import torch
from helpers import logits_batch, requires_cuda

import dgpo_ops

B, T, V = 4, 9, 23


def batch(seed=0, spread=0.6):
    inputs = logits_batch(B, T, V, seed=seed, dtype=torch.float64, ratio_spread=spread, per_token_adv=True)
    logits = inputs.pop("logits")
    return logits, inputs


def current_logps(logits, inputs):
    return logits.log_softmax(-1).gather(-1, inputs["target_ids"].clamp(min=0)[..., None])[..., 0]


def scored_mask(inputs):
    return inputs["mask"] & (inputs["target_ids"] != -100)


def logp_gradient(method, logits, inputs, **options):
    """The loss and d loss / d log-prob per token: the reference's gradient of the target logit is g (1 - p)."""
    logits = logits.detach().requires_grad_(True)
    out = dgpo_ops.reference_loss(logits, **inputs, method=method, **options)
    (grad,) = torch.autograd.grad(out.loss, logits)
    target_grad = grad.gather(-1, inputs["target_ids"].clamp(min=0)[..., None])[..., 0]
    return out.loss.detach(), target_grad / (1 - current_logps(logits.detach(), inputs).exp())


def covariance(adv, logp, scored, eps):
    n = scored.sum()
    mean_a = (adv * scored).sum() / (n + eps if eps else n)
    mean_l = (logp * scored).sum() / (n + eps if eps else n)
    return (adv - mean_a) * (logp - mean_l)


# ---- clip_cov


CLIP_COV = dict(clip_cov_ratio=0.2, clip_cov_lb=-0.3, clip_cov_ub=0.3)  # a band with more candidates than cuts


def clip_cov_candidates(logits, inputs):
    logp = current_logps(logits, inputs)
    r = (logp - inputs["old_logps"]).exp()
    adv = inputs["advantages"]
    scored = scored_mask(inputs)
    ppo_clipped = ((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))
    cov = covariance(adv, logp, scored, 1e-8)
    candidates = scored & ~ppo_clipped & (cov > CLIP_COV["clip_cov_lb"]) & (cov < CLIP_COV["clip_cov_ub"])
    return candidates, max(int(CLIP_COV["clip_cov_ratio"] * int(scored.sum())), 1)


def test_clip_cov_cuts_its_count_of_candidates_at_random():
    logits, inputs = batch()
    candidates, count = clip_cov_candidates(logits, inputs)
    assert int(candidates.sum()) > count >= 2  # the draw has a choice
    _, plain = logp_gradient("clip_cov", logits, inputs, clip_cov_lb=1e9, clip_cov_ub=2e9)  # nothing cut
    cut_sets = []
    for seed in range(6):
        loss, grad = logp_gradient("clip_cov", logits, inputs, generator=torch.Generator().manual_seed(seed), **CLIP_COV)
        cut = (grad == 0) & (plain != 0)
        assert int(cut.sum()) == count and not (cut & ~candidates).any()
        torch.testing.assert_close(grad[~cut], plain[~cut])  # the others keep PPO's single-clip gradient
        cut_sets.append(cut)
        again = logp_gradient("clip_cov", logits, inputs, generator=torch.Generator().manual_seed(seed), **CLIP_COV)
        assert torch.equal(again[1], grad) and torch.equal(again[0], loss)  # a seed repeats its draw
    assert len({tuple(c.flatten().tolist()) for c in cut_sets}) > 1  # and other seeds draw other tokens


def test_clip_cov_cut_tokens_are_dual_and_without_loss():
    logits, inputs = batch()
    out = dgpo_ops.reference_loss(logits, **inputs, method="clip_cov", generator=torch.Generator().manual_seed(1),
                                  **CLIP_COV)
    _, grad = logp_gradient("clip_cov", logits, inputs, generator=torch.Generator().manual_seed(1), **CLIP_COV)
    plain_loss, plain = logp_gradient("clip_cov", logits, inputs, clip_cov_lb=1e9, clip_cov_ub=2e9)
    _, count = clip_cov_candidates(logits, inputs)
    scored = scored_mask(inputs)
    assert out.metrics["dual_clip_fraction"].item() == pytest.approx(count / int(scored.sum()))
    # a cut token (never one PPO clipped) loses its -A r from the token mean, nothing else changes
    cut = (grad == 0) & (plain != 0)
    ratio = (current_logps(logits, inputs) - inputs["old_logps"]).exp()
    removed = (-inputs["advantages"] * ratio)[cut].sum() / int(scored.sum())
    torch.testing.assert_close(out.loss.detach(), plain_loss - removed)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_clip_cov_draws_the_same_tokens_on_every_path(backend):
    logits, inputs = batch(seed=2)
    logits32 = logits.float()
    inputs32 = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}

    def seeded():
        return torch.Generator().manual_seed(5)

    expected = dgpo_ops.reference_loss(logits32, **inputs32, method="clip_cov", generator=seeded(), **CLIP_COV)
    fused = dgpo_ops.fused_dgpo_loss(logits32, **inputs32, method="clip_cov", generator=seeded(), backend=backend,
                                     **CLIP_COV)
    weight = torch.eye(V)
    linear = dgpo_ops.fused_linear_dgpo_loss(logits32, weight, **inputs32, method="clip_cov", generator=seeded(),
                                             backend=backend, **CLIP_COV)
    module = dgpo_ops.DGPOLoss("clip_cov", backend=backend, **CLIP_COV)(logits32, **inputs32, generator=seeded())
    for out in (fused, linear, module):  # (the loss tells draws apart: each token's -A r differs)
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.metrics["dual_clip_fraction"], expected.metrics["dual_clip_fraction"])
    # the gradient of the logits: the same tokens cut (a cut token's row is 0 there and nowhere else)
    grads = []
    for loss_fn, kwargs in ((dgpo_ops.reference_loss, {}), (dgpo_ops.fused_dgpo_loss, {"backend": backend})):
        leaf = logits32.clone().requires_grad_(True)
        loss_fn(leaf, **inputs32, method="clip_cov", generator=seeded(), **CLIP_COV, **kwargs).loss.backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_clip_cov_generator_must_be_a_generator():
    logits, inputs = batch()
    with pytest.raises(ValueError, match="generator must be a torch.Generator or None, got int"):
        dgpo_ops.fused_dgpo_loss(logits, **inputs, method="clip_cov", generator=3)


# ---- kl_cov


@pytest.mark.parametrize("ratio", [2e-4, 0.15])
def test_kl_cov_penalises_the_largest_covariances(ratio):
    logits, inputs = batch(seed=3)
    coef = 0.7
    _, plain = logp_gradient("kl_cov", logits, inputs, kl_cov_ratio=ratio, ppo_kl_coef=0.0)
    _, grad = logp_gradient("kl_cov", logits, inputs, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    logp = current_logps(logits, inputs)
    scored = scored_mask(inputs)
    cov = covariance(inputs["advantages"], logp, scored, 0.0)
    count = max(int(ratio * int(scored.sum())), 1)
    chosen = torch.zeros_like(scored)
    chosen.view(-1)[torch.where(scored, cov, -torch.inf).view(-1).topk(count).indices] = True
    scale = 1.0 / int(scored.sum())  # token_mean
    drift = logp - inputs["old_logps"]
    expected = plain + torch.where(chosen, coef * torch.sign(drift) * scale, 0.0)
    torch.testing.assert_close(grad, expected)
    assert (grad != plain).sum() == count
    # unchosen tokens: -A r, no clip at all (psi = r), also far outside a trust region
    r = drift.exp()
    torch.testing.assert_close(plain[scored], (-inputs["advantages"] * r * scale)[scored])


# ---- geo_mean


def test_geo_mean_is_the_clipped_geometric_mean_of_each_response():
    logits, inputs = batch(seed=4, spread=1.5)
    weights = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.5
    eps_low, eps_high = 0.3, 0.25
    out = dgpo_ops.reference_loss(logits, **inputs, method="geo_mean", eps_low=eps_low, eps_high=eps_high,
                                  aggregation="seq_mean_token_mean", rollout_weights=weights)
    logp = current_logps(logits, inputs)
    scored, adv = scored_mask(inputs), inputs["advantages"].double()  # the helper's are fp32
    expected = 0.0
    for i in range(B):
        m = scored[i]
        ratios = (logp[i] - inputs["old_logps"][i])[m].exp()
        a = adv[i][m]
        # A > 0: a ratio is capped at e^eps_high; A < 0: floored at e^-eps_low; A = 0: 1
        clipped = torch.where(a > 0, ratios.clamp(max=torch.e ** eps_high),
                              torch.where(a < 0, ratios.clamp(min=torch.e ** -eps_low), torch.ones_like(ratios)))
        geometric_mean = clipped.prod() ** (1 / len(a)) * weights[i][m].prod() ** (1 / len(a))
        expected += -a.mean() * geometric_mean / B
    torch.testing.assert_close(out.loss, torch.as_tensor(expected, dtype=torch.float64), rtol=1e-7, atol=1e-10)


def test_geo_mean_takes_no_other_sequence_level():
    logits, inputs = batch()
    with pytest.raises(ValueError, match="geo_mean is evaluated at its own sequence statistic"):
        dgpo_ops.reference_loss(logits, **inputs, method="geo_mean", importance_sampling_level="sequence")


# ---- dro


def test_dro_is_the_policy_gradient_with_a_quadratic_penalty():
    logits, inputs = batch(seed=5, spread=1.5)
    beta = 0.4
    out = dgpo_ops.reference_loss(logits, **inputs, method="dro", dro_beta=beta)
    logp = current_logps(logits, inputs)
    scored = scored_mask(inputs)
    drift = logp - inputs["old_logps"]
    per_token = -inputs["advantages"] * logp + 0.5 * beta * drift**2
    torch.testing.assert_close(out.loss, per_token[scored].mean())
    _, grad = logp_gradient("dro", logits, inputs, dro_beta=beta)
    torch.testing.assert_close(grad[scored], ((-inputs["advantages"] + beta * drift) / int(scored.sum()))[scored])


def test_dro_needs_its_beta():
    logits, inputs = batch()
    with pytest.raises(ValueError, match=r"dro: dro_beta must be in \(0, inf\), got None"):
        dgpo_ops.fused_dgpo_loss(logits, **inputs, method="dro")


@pytest.mark.parametrize("loss_fn", [dgpo_ops.fused_dgpo_loss, dgpo_ops.reference_loss], ids=["fused", "reference"])
def test_a_generator_is_refused_under_compile(loss_fn):
    """The compiled ops are custom ops whose schema takes no generator: refused, saying what to do instead."""
    logits, inputs = batch()
    torch._dynamo.reset()
    generator = torch.Generator()  # made outside the compiled region, as torch.compile wants
    compiled = torch.compile(lambda x: loss_fn(x, **inputs, method="clip_cov", generator=generator).loss,
                             fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="generator is not supported under torch.compile.*torch.manual_seed"):
        compiled(logits.float())


def test_the_default_grid_of_a_per_response_advantage():
    """token_terms called directly with a per-response advantage ``(B, 1)``: the selection counts every token of
    the grid the terms are on, as with the advantage broadcast."""
    cfg = dgpo_ops.method_config("kl_cov", kl_cov_ratio=0.5)
    g = torch.Generator().manual_seed(0)
    log_ratio, old = torch.randn(4, 10, generator=g, dtype=torch.float64), -torch.rand(4, 10, generator=g) - 0.5
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64)
    narrow = dgpo_ops.token_terms(cfg, log_ratio, adv, old.double())
    wide = dgpo_ops.token_terms(cfg, log_ratio, adv.expand(4, 10), old.double())
    assert int((narrow.penalty_slope != 0).sum()) == 20
    torch.testing.assert_close(narrow.loss, wide.loss)


@requires_cuda
def test_a_generator_on_another_device_is_refused():
    logits, inputs = batch()
    inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}
    with pytest.raises(ValueError, match="generator is on cpu but logits are on cuda"):
        dgpo_ops.fused_dgpo_loss(logits.float().cuda(), **inputs, method="clip_cov", generator=torch.Generator())
