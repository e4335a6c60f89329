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


def trl_compute_loss(logits, targets, old, advantages, mask, is_ratio=None, **args):
    """TRL's loss and d loss / d logits: ``GRPOTrainer._compute_loss`` itself, on a stand-in ``self`` that holds the
    config fields it reads (one process, one accumulation step, training) and returns our log-probs as the model's."""
    args = {**TRL_ARGS, **args}
    logits = logits.detach().double().requires_grad_(True)
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
              "num_items_in_batch": mask_long.sum().double()}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), logits.grad


def ours(path, logits, targets, old, advantages, mask, **keywords):
    dtype = torch.float32 if path == "fused-triton" else torch.float64
    leaf = logits.to(dtype).clone().requires_grad_(True)
    args = (leaf, targets, advantages.to(dtype), mask, old.to(dtype))
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
