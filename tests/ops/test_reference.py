"""The reference loss: aggregations against explicit loops, the added terms, GSPO, input validation."""

from __future__ import annotations

import pytest
import torch
from helpers import logits_batch

import dgpo_ops
from dgpo_ops import method_config, reference_loss, token_scales, token_terms


def ragged_mask():
    mask = torch.zeros(4, 6, dtype=torch.bool)
    for row, length in enumerate([6, 1, 3, 0]):
        mask[row, :length] = True
    return mask


def loop_scales(mask, aggregation, normalizer=None, dtype=torch.float32):
    B, T = mask.shape
    lengths = [int(mask[b].sum()) for b in range(B)]
    total = sum(lengths)
    scales = torch.zeros(B, T, dtype=dtype)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            if aggregation == "token_mean":
                scales[b, t] = 1.0 / (normalizer or total)
            elif aggregation == "seq_mean_token_mean":
                scales[b, t] = 1.0 / ((normalizer or B) * lengths[b])
            elif aggregation == "seq_mean_token_sum_norm":
                scales[b, t] = 1.0 / (normalizer or B * T)
            elif aggregation == "seq_sum_token_mean":
                scales[b, t] = 1.0 / ((normalizer or 1) * lengths[b])
            elif aggregation == "seq_mean_token_sum":  # TRL's luspo: each response's token sum, mean over responses
                scales[b, t] = 1.0 / (normalizer or B)
            elif aggregation == "token_sum":  # verl's token-sum: the plain sum
                scales[b, t] = 1.0 / (normalizer or 1)
            else:
                raise AssertionError(f"no loop for aggregation {aggregation!r}")
    return scales


@pytest.mark.parametrize("aggregation", list(dgpo_ops.AGGREGATIONS))
@pytest.mark.parametrize("normalizer", [None, 7.0])
def test_token_scales_match_explicit_loops(aggregation, normalizer):
    mask = ragged_mask()
    torch.testing.assert_close(token_scales(mask, aggregation, normalizer), loop_scales(mask, aggregation, normalizer))


@pytest.mark.parametrize("aggregation", list(dgpo_ops.AGGREGATIONS))
def test_reference_loss_aggregates_like_a_loop(aggregation):
    torch.manual_seed(1)
    B, T, V = 4, 6, 9
    logits = torch.randn(B, T, V, dtype=torch.float64)
    target = torch.randint(0, V, (B, T))
    adv = torch.randn(B, dtype=torch.float64)
    old = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0] + torch.randn(B, T, dtype=torch.float64)
    mask = ragged_mask()
    out = reference_loss(logits, target, adv, mask, old.float(), method="dgpo", aggregation=aggregation)
    cfg = method_config("dgpo")
    scales = loop_scales(mask, aggregation, dtype=torch.float64)
    expected = 0.0
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                logp = torch.log_softmax(logits[b, t], -1)[target[b, t]]
                old_bt = old[b, t].float().double()
                L = token_terms(cfg, (logp - old_bt)[None], adv[b][None], old_bt[None]).loss
                expected += scales[b, t].item() * L.item()
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)


def test_all_masked_batch_gives_zero_loss_and_zero_grad():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    out = reference_loss(logits, torch.zeros(2, 3, dtype=torch.long), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    out.loss.backward()
    assert out.loss.item() == 0.0 and logits.grad.abs().max() == 0.0


def test_kl_and_entropy_terms_and_their_gradients():
    batch = logits_batch(2, 5, 11, dtype=torch.float64, seed=3, ref_logps=True)
    logits = batch.pop("logits").requires_grad_(True)
    ref_logps = batch.pop("ref_logps")
    base = reference_loss(logits, **batch, method="grpo")
    full = reference_loss(logits, **batch, ref_logps=ref_logps, method="grpo", beta=0.04, entropy_coef=0.01)
    mask = batch["mask"] & (batch["target_ids"] != -100)
    logp, ref = full.logps, ref_logps.double()
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    p = torch.softmax(logits.detach(), -1)
    entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(full.entropy[mask].double(), entropy[mask].float().double(), rtol=1e-6, atol=1e-6)
    assert (full.entropy[~mask] == 0).all()
    extra = ((0.04 * kl - 0.01 * entropy) * mask).sum() / mask.sum()
    assert (full.loss - base.loss).item() == pytest.approx(extra.item(), rel=1e-5)
    assert full.metrics["kl_mean"].item() == pytest.approx((kl * mask).sum().item() / mask.sum().item(), rel=1e-5)


def test_sequence_level_ratio_is_the_response_mean():
    batch = logits_batch(3, 6, 10, dtype=torch.float64, seed=4)
    out = reference_loss(**batch, method="grpo", importance_sampling_level="sequence",
                         aggregation="seq_mean_token_mean")
    mask = batch["mask"] & (batch["target_ids"] != -100)
    log_ratio = (out.logps.double() - batch["old_logps"].double()) * mask
    seq = log_ratio.sum(1) / mask.sum(1)
    expected = (seq.exp()[:, None] * mask).sum() / mask.sum()
    assert out.metrics["ratio_mean"].item() == pytest.approx(expected.item(), rel=1e-6)


def test_sequence_level_gradient_flows_through_the_mean():
    # One response, grpo in the trust region: d loss / d l_t = sum_t s_t (-A r_seq) / |o|.
    logits = torch.randn(1, 4, 6, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[1, 2, 3, 4]])
    logp = torch.log_softmax(logits.detach(), -1).gather(-1, target[..., None])[..., 0]
    old = logp - torch.tensor([[0.05, -0.05, 0.1, 0.02]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    out = reference_loss(logits, target, adv, old_logps=old, method="grpo", importance_sampling_level="sequence",
                         aggregation="seq_mean_token_mean")
    (grad,) = torch.autograd.grad(out.loss, logits)
    r_seq = torch.exp(torch.tensor(0.03, dtype=torch.float64))
    coef = -r_seq / 4  # four tokens, each with s_t = 1/4 and d(mean)/d l_t = 1/4
    onehot = torch.nn.functional.one_hot(target, 6).double()
    torch.testing.assert_close(grad, coef * (onehot - logits.detach().softmax(-1)), rtol=1e-10, atol=1e-12)


def test_flat_logits_equal_batched_token_mean():
    batch = logits_batch(2, 5, 8, dtype=torch.float64, seed=5, per_token_adv=True)
    out = reference_loss(**batch, method="dgpo")
    flat = {k: v.reshape(10, *v.shape[2:]) for k, v in batch.items()}
    out_flat = reference_loss(**flat, method="dgpo")
    assert out_flat.loss.item() == pytest.approx(out.loss.item(), rel=1e-12)
    assert out_flat.logps.shape == (10,)
    torch.testing.assert_close(out_flat.logps, out.logps.reshape(10))


def test_rollout_weights_multiply_the_policy_term():
    batch = logits_batch(2, 4, 8, dtype=torch.float64, seed=6)
    weights = torch.full((2, 4), 0.5, dtype=torch.float64)
    plain = reference_loss(**batch, method="cispo")
    weighted = reference_loss(**batch, method="cispo", rollout_weights=weights)
    assert weighted.loss.item() == pytest.approx(0.5 * plain.loss.item(), rel=1e-12)


def test_temperature_divides_the_logits():
    batch = logits_batch(2, 4, 8, dtype=torch.float64, seed=7)
    hot = reference_loss(**batch, temperature=0.7)
    batch["logits"] = batch["logits"] / 0.7
    assert hot.loss.item() == pytest.approx(reference_loss(**batch).loss.item(), rel=1e-12)


# ----------------------------------------------------------------------------- input validation


def valid_inputs():
    return dict(
        logits=torch.randn(2, 3, 5),
        target_ids=torch.zeros(2, 3, dtype=torch.long),
        advantages=torch.ones(2),
        mask=torch.ones(2, 3, dtype=torch.bool),
        old_logps=torch.zeros(2, 3) - 1.0,
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(logits=torch.randn(5)), "logits"),
        (dict(logits=torch.randn(2, 3, 5).to(torch.int32)), "dtype"),
        (dict(target_ids=torch.zeros(2, 4, dtype=torch.long)), "target_ids"),
        (dict(target_ids=torch.zeros(2, 3)), "target_ids"),
        (dict(target_ids=torch.full((2, 3), 5)), r"target_ids must be in \[0, 5\)"),
        (dict(target_ids=torch.full((2, 3), -3)), "target_ids"),
        (dict(advantages=torch.ones(3)), "advantages"),
        (dict(advantages=torch.tensor([1.0, float("nan")])), "advantages"),
        (dict(mask=torch.ones(2, 4)), "mask"),
        (dict(mask=torch.full((2, 3), 0.5)), "mask"),
        (dict(old_logps=torch.zeros(2, 4)), "old_logps"),
        (dict(old_logps=torch.full((2, 3), float("inf"))), "old_logps"),
        (dict(ref_logps=torch.zeros(3, 3)), "ref_logps"),
    ],
)
def test_bad_inputs_raise_value_errors_naming_the_argument(change, match):
    inputs = {**valid_inputs(), **change}
    with pytest.raises(ValueError, match=match):
        reference_loss(**inputs)


def test_non_finite_values_on_masked_tokens_are_ignored():
    inputs = valid_inputs()
    inputs["mask"][1, 2] = False
    inputs["old_logps"][1, 2] = float("nan")
    assert torch.isfinite(reference_loss(**inputs).loss)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="ppo"), "known methods"),
        (dict(aggregation="sum"), "aggregation"),
        (dict(temperature=0.0), "temperature"),
        (dict(beta=-1.0), "beta"),
        (dict(beta=0.1, ref_logps=None), "ref_logps"),
        (dict(importance_sampling_level="seq"), "importance_sampling_level"),
        (dict(loss_normalizer=0.0), "loss_normalizer"),
        (dict(method="grpo", n=2), "does not take"),
    ],
)
def test_bad_options_raise_value_errors(kwargs, match):
    inputs = valid_inputs()
    inputs.update({k: kwargs.pop(k) for k in list(kwargs) if k in inputs})
    with pytest.raises(ValueError, match=match):
        reference_loss(**inputs, **kwargs)


def test_flat_logits_reject_sequence_aggregation():
    with pytest.raises(ValueError, match="flat"):
        reference_loss(torch.randn(6, 5), torch.zeros(6, dtype=torch.long), torch.ones(6),
                       aggregation="seq_mean_token_mean")


def test_non_finite_logits_give_non_finite_loss():
    inputs = valid_inputs()
    inputs["logits"][0, 1, 2] = float("nan")
    assert not torch.isfinite(reference_loss(**inputs).loss)


def test_config_instance_with_overrides_is_validated():
    cfg = dgpo_ops.method_config(dgpo_ops.GrpoConfig(), eps_high=0.28)
    assert cfg.eps_high == 0.28
    with pytest.raises(ValueError, match="does not take"):
        dgpo_ops.method_config(dgpo_ops.GrpoConfig(), n=2)
    with pytest.raises(ValueError, match="temperature"):
        reference_loss(**valid_inputs(), temperature=True)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_kl_ratio_correction_multiplies_the_kl_by_the_ratio(level):
    # TRL's use_bias_correction_kl: per_token_kl * coef_1, gradient through both factors.
    batch = logits_batch(2, 5, 9, dtype=torch.float64, seed=8, ref_logps=True)
    logits = batch.pop("logits").requires_grad_(True)
    out = reference_loss(logits, **batch, method="grpo", beta=0.3, kl_ratio_correction=True,
                         importance_sampling_level=level, aggregation="seq_mean_token_mean")
    mask = batch["mask"] & (batch["target_ids"] != -100)
    logp = torch.log_softmax(logits, -1).gather(-1, batch["target_ids"].clamp(min=0)[..., None])[..., 0]
    logp = torch.where(mask, logp, 0.0)
    log_ratio = torch.where(mask, logp - batch["old_logps"].double(), 0.0)
    if level == "sequence":
        log_ratio = (log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True)).expand_as(logp)
    coef_1 = log_ratio.exp()
    adv = batch["advantages"].double()[:, None]
    policy = -torch.min(coef_1 * adv, coef_1.clamp(0.8, 1.2) * adv)
    ref = batch["ref_logps"].double()
    kl = (torch.exp(ref - logp) - (ref - logp) - 1) * coef_1
    per_token = torch.where(mask, policy + 0.3 * kl, 0.0)
    expected = ((per_token.sum(1) / mask.sum(1)).mean())
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-10)
    (grad,) = torch.autograd.grad(out.loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_token_sum_needs_no_response_structure(backend):
    """token_sum (verl's token-sum) is a token-level aggregation: flat (N, V) logits take it, with the same loss
    and gradient as the (B, T, V) call, where a per-response aggregation is refused."""
    inputs = logits_batch(3, 5, 11, seed=4)
    logits = inputs.pop("logits")
    logits = logits if backend == "triton" else logits.double()  # the Triton kernels take no float64
    inputs.pop("ref_logps", None)
    inputs["advantages"] = inputs["advantages"][:, None].expand(3, 5).contiguous()

    def call(leaf, **kwargs):
        if backend == "reference":
            return reference_loss(leaf, aggregation="token_sum", **kwargs)
        return dgpo_ops.fused_dgpo_loss(leaf, aggregation="token_sum", backend=backend, **kwargs)

    grid = logits.clone().requires_grad_(True)
    out = call(grid, **inputs)
    out.loss.backward()
    flat = logits.reshape(15, 11).clone().requires_grad_(True)
    flat_out = call(flat, **{k: v.reshape(15) for k, v in inputs.items()})
    flat_out.loss.backward()
    torch.testing.assert_close(flat_out.loss, out.loss)
    torch.testing.assert_close(flat.grad, grid.grad.reshape(15, 11))
    with pytest.raises(ValueError, match="flat"):
        reference_loss(flat, aggregation="seq_mean_token_mean", **{k: v.reshape(15) for k, v in inputs.items()})
