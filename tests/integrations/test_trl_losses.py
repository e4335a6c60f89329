"""TRL's own loss code as the oracle for the losses TRL ships: the loss and the logits' gradient of
``reference_loss`` and ``fused_dgpo_loss`` (both kernel sets) against ``GRPOTrainer._compute_loss`` itself (TRL
1.16), called on a stand-in ``self`` with the config fields it reads, on the same log-probs: vespo (its gamma
weights, with and without vLLM's importance ratio), luspo (its aggregation) and delta (its cap)."""

from __future__ import annotations

import collections
import types

import pytest
import torch

import dgpo_ops

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

B, T, V = 5, 7, 11
VESPO_PARAMS = [dict(), dict(k_pos=1.0, lambda_pos=0.5, k_neg=4.0, lambda_neg=1.0)]


def batch(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (B, T), generator=g)
    logp = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    old = logp + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)  # sequence ratios around 1 and away
    advantages = torch.tensor([0.0, 1.3, -0.8, 0.4, -1.6], dtype=torch.float64)
    lengths = torch.tensor([7, 3, 5, 1, 6])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    is_ratio = torch.where(mask, torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5, 1.0)  # padding: 1
    return logits.to(dtype), targets, old, advantages, mask, is_ratio


# GRPOConfig's defaults for the fields _compute_loss reads (TRL 1.16).
TRL_ARGS = dict(loss_type="dapo", epsilon=0.2, epsilon_high=None, delta=None, beta=0.0, importance_sampling_level="token",
                sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                vespo_k_neg=3.0, vespo_lambda_neg=2.0, use_bias_correction_kl=True, max_completion_length=512,
                steps_per_generation=1)


def trl_compute_loss(logits, targets, old, advantages, mask, is_ratio=None, ref=None, dtype=torch.float64, **args):
    """TRL's loss and d loss / d logits: ``GRPOTrainer._compute_loss`` itself, on a stand-in ``self`` that holds the
    config fields it reads (one process, one accumulation step, training) and returns our log-probs as the model's;
    ``ref``: the reference log-probs its KL term reads (with ``beta`` > 0); ``dtype``: what it computes in."""
    args = {**TRL_ARGS, **args}
    logits = logits.detach().to(dtype).requires_grad_(True)
    old, advantages = old.to(dtype), advantages.to(dtype)
    logp = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    accelerator = types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                        reduce=lambda x, reduction="sum": x, sync_gradients=True)
    trainer = types.SimpleNamespace(
        args=types.SimpleNamespace(**args), loss_type=args["loss_type"], beta=args["beta"],
        importance_sampling_level=args["importance_sampling_level"], epsilon_low=args["epsilon"],
        epsilon_high=args["epsilon_high"] if args["epsilon_high"] is not None else args["epsilon"],
        max_completion_length=args["max_completion_length"], top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=True,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=accelerator,
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        get_gamma_weights=GRPOTrainer.get_gamma_weights)
    trainer._get_per_token_logps_and_entropies = lambda *_, **__: (logp, torch.zeros_like(logp), None)
    mask_long = mask.long()
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask_long,
              "advantages": advantages, "old_per_token_logps": old,
              "num_items_in_batch": mask_long.sum().to(dtype)}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), logits.grad


def ours(path, logits, targets, old, advantages, mask, **keywords):
    dtype = torch.float32 if path == "fused-triton" else torch.float64
    leaf = logits.to(dtype).clone().requires_grad_(True)
    args = (leaf, targets, advantages.to(dtype), mask, old.to(dtype))
    if keywords.get("ref_logps") is not None:
        keywords = {**keywords, "ref_logps": keywords["ref_logps"].to(dtype)}
    if path == "reference":
        out = dgpo_ops.reference_loss(*args, **keywords)
    else:
        out = dgpo_ops.fused_dgpo_loss(*args, **keywords, backend=path.split("-")[1])
    out.loss.backward()
    return out.loss.double(), leaf.grad.double(), dtype


def assert_same(got, want):
    loss, grad, dtype = got
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss, want[0], **tolerance)
    torch.testing.assert_close(grad, want[1], **tolerance)
    assert want[1].abs().sum() > 0


PATHS = ["reference", "fused-torch", "fused-triton"]


@pytest.mark.parametrize("params", VESPO_PARAMS, ids=["defaults", "other-gamma"])
@pytest.mark.parametrize("with_is_ratio", [False, True], ids=["no-is", "vllm-is-ratio"])
@pytest.mark.parametrize("path", PATHS)
def test_vespo_equals_trl(path, with_is_ratio, params):
    logits, targets, old, advantages, mask, is_ratio = batch(3)
    is_ratio = is_ratio if with_is_ratio else None
    want = trl_compute_loss(logits, targets, old, advantages, mask, is_ratio, loss_type="vespo",
                            **{f"vespo_{name}": value for name, value in params.items()})
    got = ours(path, logits, targets, old, advantages, mask, method="vespo", aggregation="token_mean", **params,
               rollout_weights=None if is_ratio is None else is_ratio.to(torch.float32 if path == "fused-triton"
                                                                         else torch.float64))
    assert_same(got, want)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("level", ["sequence", "token"])
def test_luspo_equals_trl(path, level):
    """TRL's luspo: GSPO times the response length, mean over responses (a fully masked one counts); ours is grpo
    with aggregation seq_mean_token_sum, at either importance-sampling level."""
    logits, targets, old, advantages, mask, _ = batch(4)
    want = trl_compute_loss(logits, targets, old, advantages, mask, loss_type="luspo", importance_sampling_level=level)
    got = ours(path, logits, targets, old, advantages, mask, method="grpo", aggregation="seq_mean_token_sum",
               importance_sampling_level=level)
    assert_same(got, want)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("loss_type, aggregation, delta, level", [
    ("dapo", "token_mean", 1.1, "token"),  # below 1 + epsilon_high: the cap bites inside the trust region
    ("dapo", "token_mean", 1.4, "token"),  # above: for A < 0 it is the dual clip at delta
    ("grpo", "seq_mean_token_mean", 1.1, "token"),
    ("luspo", "seq_mean_token_sum", 1.05, "sequence"),
])
def test_delta_equals_trl(path, loss_type, aggregation, delta, level):
    logits, targets, old, advantages, mask, _ = batch(5)
    old = old - 0.5 * torch.randn(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # wider
    want = trl_compute_loss(logits, targets, old, advantages, mask, loss_type=loss_type, delta=delta,
                            importance_sampling_level=level)
    got = ours(path, logits, targets, old, advantages, mask, method="grpo", aggregation=aggregation, delta=delta,
               importance_sampling_level=level)
    assert_same(got, want)
    without = ours("reference", logits, targets, old, advantages, mask, method="grpo", aggregation=aggregation,
                   importance_sampling_level=level)
    assert not torch.isclose(without[0], want[0])  # delta changes this batch's loss: the check is not vacuous


def test_vespo_weights_differ_from_one_and_between_the_signs():
    """The comparison above is not vacuous: phi spreads away from 1 here, and differs between A >= 0 and A < 0."""
    logits, targets, old, advantages, mask, is_ratio = batch(3)
    logp = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    phi = GRPOTrainer.get_gamma_weights(advantages[:, None], logp - old, mask.double(), is_ratio)[:, 0]
    assert (phi - 1).abs().max() > 0.05 and phi.min() < phi.max()


def test_vespo_refuses_a_second_sequence_statistic():
    logits, targets, old, advantages, mask, _ = batch(3)
    with pytest.raises(ValueError, match="importance_sampling_level at 'token'"):
        dgpo_ops.reference_loss(logits, targets, advantages, mask, old, method="vespo",
                                importance_sampling_level="sequence")


def reference_logps(logits, targets, seed: int):
    """Reference log-probs a few tenths of a nat from the policy's: the k3 KL and its gradient are not small."""
    logp = logits.double().log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    return logp + 0.4 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# TRL's KL term: beta k3, times the importance ratio TRL's loss type is evaluated at (its coef_1: the token's, or
# GSPO's sequence mean) with its gradient when use_bias_correction_kl is on -- never vespo's summed sequence weight
@pytest.mark.parametrize("correction", [True, False], ids=["bias-correction", "no-correction"])
@pytest.mark.parametrize("loss_type, method, level", [
    ("vespo", "vespo", "token"), ("dapo", "grpo", "token"), ("grpo", "grpo", "sequence"), ("sapo", "sapo", "token")])
@pytest.mark.parametrize("path", PATHS)
def test_kl_term_equals_trl(path, loss_type, method, level, correction):
    logits, targets, old, advantages, mask, _ = batch(6)
    ref = reference_logps(logits, targets, 7)
    aggregation = "seq_mean_token_mean" if loss_type in ("grpo", "sapo") else "token_mean"
    # (sapo's temperatures exact in float32: TRL's torch.where makes a float32 tensor of them)
    gates = dict(sapo_temperature_pos=1.25, sapo_temperature_neg=1.5)
    want = trl_compute_loss(logits, targets, old, advantages, mask, ref=ref, loss_type=loss_type, beta=0.1,
                            use_bias_correction_kl=correction, importance_sampling_level=level, **gates)
    extra = {"tau_pos": 1.25, "tau_neg": 1.5} if method == "sapo" else {}
    got = ours(path, logits, targets, old, advantages, mask, method=method, aggregation=aggregation, beta=0.1,
               ref_logps=ref, kl_ratio_correction=correction, **extra,
               **({"importance_sampling_level": level} if level != "token" else {}))
    assert_same(got, want)


@pytest.mark.parametrize("correction", [True, False], ids=["bias-correction", "no-correction"])
@pytest.mark.parametrize("method", sorted(dgpo_ops.METHODS))
def test_every_methods_kl_term_is_trls(method, correction):
    """Methods TRL does not ship get TRL's KL term too: with a loss type of TRL's as the oracle, the change beta > 0
    makes to TRL's loss and gradient (the KL term alone) is the change it makes to ours, whatever the method."""
    from helpers import by_name

    logits, targets, old, advantages, mask, _ = batch(8)
    ref = reference_logps(logits, targets, 9)
    with_kl, without_kl = (trl_compute_loss(logits, targets, old, advantages, mask, ref=ref, beta=beta,
                                            use_bias_correction_kl=correction) for beta in (0.1, 0.0))
    ours_with, ours_without = (ours("reference", logits, targets, old, advantages, mask, method=method,
                                    aggregation="token_mean", beta=beta, ref_logps=ref if beta else None,
                                    kl_ratio_correction=correction, **by_name(method)) for beta in (0.1, 0.0))
    torch.testing.assert_close(ours_with[0] - ours_without[0], with_kl[0] - without_kl[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours_with[1] - ours_without[1], with_kl[1] - without_kl[1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_vespo_weight_beyond_float32_is_trls_zero(path):
    """k = 10, lambda = 0 and one response's summed log-ratio 10: its gamma weight (3e42) overflows the float32 TRL
    and the kernels compute in. TRL's get_gamma_weights maps it to 0, so that response adds nothing; ours gave a
    NaN loss and gradient, with no error. In float32 on every path, against TRL's _compute_loss in float32."""
    logits, targets, old, advantages, mask, _ = batch(3)
    logp = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    old[1] = logp[1] - 10.0 / 3  # response 1: 3 tokens, A = 1.3, summed log-ratio 10
    gamma = dict(k_pos=10.0, lambda_pos=0.0, k_neg=10.0, lambda_neg=0.0)
    want = trl_compute_loss(logits, targets, old, advantages, mask, loss_type="vespo", dtype=torch.float32,
                            **{f"vespo_{name}": value for name, value in gamma.items()})
    assert want[0].isfinite() and want[1].isfinite().all() and (want[1][1] == 0).all()  # TRL drops response 1
    leaf = logits.float().clone().requires_grad_(True)
    args = (leaf, targets, advantages.float(), mask, old.float())
    keywords = dict(method="vespo", aggregation="token_mean", **gamma)
    if path == "reference":
        out = dgpo_ops.reference_loss(*args, **keywords)
    else:
        out = dgpo_ops.fused_dgpo_loss(*args, **keywords, backend=path.split("-")[1])
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad, want[1], rtol=1e-5, atol=1e-6)
