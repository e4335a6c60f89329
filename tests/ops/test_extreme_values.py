"""Extreme log-ratios give finite losses and gradients on every path, so one bad token
cannot turn a training step's gradient into NaN.

Defined behaviour (README, "What bad input gets"): every log-ratio is clamped to [-20, 20]
straight-through before its exponential (the policy ratio, the k3 KL's l_ref - l and the KL's ratio
correction), and the token's log-prob enters the objective floored at ``LOGP_FLOOR`` (straight-
through), so a target logit of -inf (probability 0) gives finite values. Per-token ``logps`` still
report -inf there. Each case runs the reference, the fused op on the torch backend and (for each route's
representative) the Triton kernels (interpreter), in fp32 and bf16, and checks that they agree.
"""

from __future__ import annotations

import math

import pytest
import torch
from dgpo_ops.kernels.interface import LOG_RATIO_CLAMP
from helpers import METHOD_VARIANTS, ROUTE_VARIANTS, TOKEN_LEVEL_VARIANTS, config, variant_id
from method_terms import mirror, table_terms

import dgpo_ops

B, T, V = 2, 3, 16
BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16]


def base_inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=gen) * 2).to(dtype)
    target_ids = torch.randint(0, V, (B, T), generator=gen)
    advantages = torch.tensor([1.3, -0.8])
    mask = torch.ones(B, T)
    return logits, target_ids, advantages, mask


def true_logps(logits, target_ids):
    return torch.log_softmax(logits.double(), -1).gather(-1, target_ids[..., None])[..., 0]


def lowered_targets(logits, target_ids, where):
    """The logits with the target's logit -40 at the tokens ``where``, and their targets' log-probs."""
    target = torch.arange(V) == target_ids[..., None]
    far = torch.where(where[..., None] & target, -40.0, logits).to(logits.dtype)
    return far, true_logps(far, target_ids)


def cases(dtype):
    """(name, logits, target_ids, advantages, mask, extra kwargs) with an extreme log-ratio in each."""
    logits, target_ids, advantages, mask = base_inputs(dtype)
    logp = true_logps(logits, target_ids)
    out = []
    # A target of probability 0: log p = -inf, so l - l_old = -inf (and l - l = -inf - -inf on policy).
    minus_inf = logits.clone()
    minus_inf[0, 1, target_ids[0, 1]] = float("-inf")
    minus_inf[1, 2, target_ids[1, 2]] = float("-inf")
    out.append(("target_logit_-inf_on_policy", minus_inf, {}))
    out.append(("target_logit_-inf_with_old", minus_inf, dict(old_logps=(logp - 0.3).float())))
    out.append(("target_logit_-inf_kl", minus_inf, dict(old_logps=(logp - 0.3).float(), beta=0.04,
                                                        ref_logps=(logp + 0.2).float(), kl_ratio_correction=True)))
    # Log-ratios of 1e4 and -30 to the old policy, with the KL ratio correction (exp(1e4) would be inf),
    # beyond the clamp either way. Where the old log-prob is above the policy's, the target's logit is -40, so
    # that it is a log-prob (<= 0) too (elsewhere the logits stay: fp32 resolves log-probs near -3 finer).
    shift = torch.tensor([[1e4, -30.0, 0.5], [-30.0, 1e4, 100.0]], dtype=torch.float64)
    far, logp = lowered_targets(logits, target_ids, shift < 0)
    out.append(("old_logps_far", far, dict(old_logps=(logp - shift).float(), beta=0.04,
                                           ref_logps=(logp + 0.1).float(), kl_ratio_correction=True)))
    # The reference 100 and 1e4 nats below the policy, and 30 and 35 above (k3 = exp(l_ref - l) - ...).
    ref_shift = torch.tensor([[30.0, -100.0, 35.0], [-1e4, 0.0, 30.0]], dtype=torch.float64)
    far, logp = lowered_targets(logits, target_ids, ref_shift > 0)
    out.append(("ref_logps_far", far, dict(old_logps=(logp - 0.1).float(), beta=0.04,
                                           ref_logps=(logp + ref_shift).float())))
    return [(name, x, target_ids, advantages, mask, extra) for name, x, extra in out]


CASE_NAMES = [name for name, *_ in cases(torch.float32)]
# One variant of each method (the interpreter is slow); the mirror test below takes every variant.
ONE_PER_METHOD = list({name: (name, params) for name, params in reversed(METHOD_VARIANTS)}.values())


def backends(variant) -> list[str]:
    """The torch twins for every method; the Triton kernels for each route's representative. The kernels clamp
    the log-ratios before a method's epilogue branch, the same for every method; the branches themselves meet
    infinite and huge log-ratios in test_mirror_and_table_agree_at_infinite_and_huge_log_ratios below."""
    return BACKENDS if variant in ROUTE_VARIANTS else ["torch"]


def run(fn, logits, target_ids, advantages, mask, extra, variant, **kwargs):
    name, params = variant
    x = logits.clone().requires_grad_(True)
    out = fn(x, target_ids, advantages, mask, method=name, **params, **extra, **kwargs)
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("variant", ONE_PER_METHOD, ids=variant_id)
def test_extreme_log_ratios_are_finite_and_agree(variant, case, dtype):
    _, logits, target_ids, advantages, mask, extra = next(c for c in cases(dtype) if c[0] == case)
    ref, ref_grad = run(dgpo_ops.reference_loss, logits.double(), target_ids, advantages, mask, extra, variant)
    assert torch.isfinite(ref.loss), f"reference loss {ref.loss}"
    assert torch.isfinite(ref_grad).all(), "reference gradient is not finite"
    for backend in backends(variant):
        out, grad = run(dgpo_ops.fused_dgpo_loss, logits, target_ids, advantages, mask, extra, variant,
                        backend=backend)
        assert torch.isfinite(out.loss), f"{backend}: loss {out.loss}"
        assert torch.isfinite(grad.float()).all(), f"{backend}: gradient is not finite"
        for metric, value in out.metrics.items():
            assert torch.isfinite(value), f"{backend}: metric {metric} = {value}"
        # Terms near e^20 (the clamped KL ratio correction) partly cancel in the sum: fp32 rounding of
        # each term, not an error of the path, sets the tolerance.
        scale = max(1.0, ref.loss.abs().item())
        assert abs(out.loss.double().item() - ref.loss.item()) <= 1e-4 * scale, (backend, out.loss, ref.loss)
        rtol = 1e-5 if dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(grad.double(), ref_grad.to(grad.dtype).double(), rtol=rtol, atol=1e-6)


def test_a_target_of_probability_zero_reports_minus_inf_and_floors_only_in_the_objective():
    _, logits, target_ids, advantages, mask, extra = cases(torch.float32)[0]
    out, grad = run(dgpo_ops.fused_dgpo_loss, logits, target_ids, advantages, mask, extra, ("cispo", {}))
    assert out.logps[0, 1] == float("-inf") and out.logps[1, 2] == float("-inf")
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    # The impossible token still pushes its own logit: d loss / d x_t = coef * (1 - p_t) = coef.
    assert grad[0, 1, target_ids[0, 1]] != 0


def test_k3_kl_far_from_the_reference_is_the_clamped_value():
    logits, target_ids, _, mask = base_inputs(torch.float64)
    logits = logits.scatter(-1, target_ids[..., None], -200.0)  # log p < -100: the reference's is a log-prob
    logp = true_logps(logits, target_ids)
    zero = torch.zeros(B)
    out = dgpo_ops.reference_loss(logits, target_ids, zero, mask, old_logps=logp, ref_logps=logp + 100.0, beta=1.0,
                                  method="grpo")
    clamped = LOG_RATIO_CLAMP
    expected = math.exp(clamped) - clamped - 1.0  # the token mean of equal terms
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("variant", TOKEN_LEVEL_VARIANTS, ids=variant_id)
def test_mirror_and_table_agree_at_infinite_and_huge_log_ratios(variant):
    """Through the ops a log-ratio is at most about 1e6 (the floored log-prob); the table and its
    Triton mirror also agree at +-inf, where psi stays finite (the loss of the methods whose value
    is A w log p is then infinite by definition: log p itself is)."""
    cfg = config(variant)
    huge = [1e4, -1e4, 1e6, -1e6]
    log_ratio = torch.tensor((huge + [float("inf"), float("-inf")]) * 2)
    adv = torch.tensor([1.0] * 6 + [-1.0] * 6)
    old_logp = torch.full((12,), -1.5)
    loss, psi, region, ratio = mirror(cfg, log_ratio, adv, old_logp)
    table = table_terms(cfg, log_ratio, adv, old_logp)
    finite = torch.tensor(([True] * 4 + [False] * 2) * 2)
    assert torch.isfinite(loss[finite]).all() and torch.isfinite(psi).all()
    # dro's -A l + (beta / 2) (l - l_old)^2 is inf - inf = nan at an infinite log-prob, in both
    torch.testing.assert_close(loss, table.loss.float(), rtol=1e-6, atol=0, equal_nan=cfg.name == "dro")
    torch.testing.assert_close(psi, table.psi.float(), rtol=1e-6, atol=0)
    assert torch.equal(region, table.region)
    torch.testing.assert_close(ratio, torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), rtol=1e-6, atol=0)
