"""TRL's four ``vllm_importance_sampling_mode``s as a correction stage equal TRL's own ratio block on the same
inputs, on every route: the block is inline in ``GRPOTrainer._generate_and_score_completions``, so it is
re-implemented below from the installed trl's lines (TRL_VERSION), as are its logged ratio statistics."""

from __future__ import annotations

import dataclasses

import importlib.metadata
import math

import pytest
import torch
from rollout_cases import CORRECTION_ROUTES, assert_same_as_weights, mismatch_batch

import dgpo_ops
from dgpo_ops.corrections import TrlCorrection

TRL_VERSION = "1.16.0"  # trl/trainer/grpo_trainer.py L2659-2707 (ratio) and L2860-2896 (metrics)


def trl_importance_sampling_ratio(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, clip_min,
                                  clip_max):
    """TRL's block, as it reads (tool_mask None)."""
    mask = completion_mask
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


def trl_ratio_metrics(ratio, completion_mask, mode):
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[completion_mask.bool()]
    return flat.min(), flat.mean(), flat.max()


def test_installed_trl_is_the_version_re_derived():
    assert importlib.metadata.version("trl") == TRL_VERSION


CASES = [("token_truncate", None, 3.0), ("token_truncate", 0.5, 2.0), ("token_mask", 0.5, 2.0),
         ("token_mask", None, 3.0), ("sequence_truncate", 0.2, 3.0), ("sequence_mask", None, 3.0),
         ("sequence_mask", 0.5, 50.0)]


@pytest.mark.parametrize("mode,clip_min,clip_max", CASES)
@pytest.mark.parametrize("drift,nan_tokens", [(0.05, False), (0.4, True), (3.0, False)])
def test_trl_modes_equal_trl(mode, clip_min, clip_max, drift, nan_tokens):
    batch = mismatch_batch(drift, seed=3, nan_tokens=nan_tokens)
    mask = batch["mask"]
    ratio = trl_importance_sampling_ratio(batch["old_logps"], batch["rollout_logps"], mask.float(), mode, clip_min,
                                          clip_max)
    weights = ratio.expand_as(mask)
    routes = CORRECTION_ROUTES if drift == 0.4 else ("reference", "torch", "packed")
    correction = TrlCorrection(mode, clip_min, clip_max)
    metrics = assert_same_as_weights(correction, batch, weights, mask, routes, method="grpo",
                                     aggregation="seq_mean_token_mean")
    for name, want in zip(("min", "mean", "max"), trl_ratio_metrics(ratio, mask, mode)):
        torch.testing.assert_close(metrics[f"importance_sampling_ratio_{name}"], want)


def test_mask_modes_keep_the_normaliser():
    """TRL's mask modes zero the weight of a token out of bounds; the token still counts in token_mean's
    normaliser (unlike verl's rejection)."""
    batch = mismatch_batch(3.0, seed=3)
    out = dgpo_ops.reference_loss(**batch, method="grpo", rollout_correction=TrlCorrection("token_mask", 0.5, 2.0))
    assert 0 < float(out.metrics["rollout_masked_fraction"]) < 1
    ratio = trl_importance_sampling_ratio(batch["old_logps"], batch["rollout_logps"], batch["mask"].float(),
                                          "token_mask", 0.5, 2.0)
    per_token = dgpo_ops.reference_loss(**{k: v for k, v in batch.items() if k != "rollout_logps"}, method="grpo",
                                        rollout_weights=ratio, loss_normalizer=float(batch["mask"].sum()))
    torch.testing.assert_close(out.loss, per_token.loss)


@pytest.mark.parametrize("kwargs,message", [
    (dict(vllm_importance_sampling_mode="token"), "vllm_importance_sampling_mode must be one of"),
    (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=None,
          vllm_importance_sampling_clip_max=None), "needs vllm_importance_sampling_clip_min or _clip_max"),
    (dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=3.0,
          vllm_importance_sampling_clip_max=2.0), "must be less than"),
])
def test_trl_fields_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrlCorrection(**kwargs)


def test_trls_config_fields_copy_over():
    """A GRPOConfig's vllm_importance_sampling_* values build the correction under TRL's own names; TRL's
    GRPOConfig has no field ``mode`` or ``clip_max``, and neither has the correction."""
    from trl import GRPOConfig

    config = GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, vllm_importance_sampling_mode="token_mask",
                        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
    names = [field.name for field in dataclasses.fields(TrlCorrection)]
    correction = TrlCorrection(**{name: getattr(config, name) for name in names})
    assert correction == TrlCorrection("token_mask", 0.5, 2.0)
    assert correction.bounds() == ("token_mask", 0.5, 2.0)
    with pytest.raises(TypeError, match="unexpected keyword argument .mode."):
        TrlCorrection(mode="token_mask", clip_max=2.0)


def test_a_correction_needs_both_log_probs_and_no_rollout_weights():
    batch = mismatch_batch(0.5)
    correction = TrlCorrection("token_truncate")
    with pytest.raises(ValueError, match="needs rollout_logps"):
        dgpo_ops.fused_dgpo_loss(**{k: v for k, v in batch.items() if k != "rollout_logps"},
                                 rollout_correction=correction)
    with pytest.raises(ValueError, match="rollout_logps need old_logps"):
        dgpo_ops.fused_dgpo_loss(**{**batch, "old_logps": None}, rollout_correction=correction)
    with pytest.raises(ValueError, match="not both"):
        dgpo_ops.fused_dgpo_loss(**batch, rollout_weights=torch.ones_like(batch["old_logps"]),
                                 rollout_correction=correction)
    with pytest.raises(ValueError, match="rollout_correction must be a dgpo_ops.corrections.RolloutCorrection"):
        dgpo_ops.fused_dgpo_loss(**batch, rollout_correction="token_truncate")


def test_sequence_modes_need_responses():
    batch = mismatch_batch(0.5)
    flat = {k: (v.reshape(-1, *v.shape[2:]) if torch.is_tensor(v) and v.dim() >= 2 else v) for k, v in batch.items()}
    flat["advantages"] = torch.ones(flat["target_ids"].shape)
    with pytest.raises(ValueError, match="flat \\(N, V\\) logits carry no response structure"):
        dgpo_ops.fused_dgpo_loss(**flat, rollout_correction=TrlCorrection("sequence_mask"))
    dgpo_ops.fused_dgpo_loss(**flat, rollout_correction=TrlCorrection("token_mask"))  # token level: fine


@pytest.mark.parametrize("aggregation", sorted(dgpo_ops.AGGREGATIONS))
def test_every_aggregation(aggregation):
    batch = mismatch_batch(1.0, seed=4)
    ratio = trl_importance_sampling_ratio(batch["old_logps"], batch["rollout_logps"], batch["mask"].float(),
                                          "token_truncate", 0.5, 2.0)
    assert_same_as_weights(TrlCorrection("token_truncate", 0.5, 2.0), batch, ratio, batch["mask"],
                           ("reference", "torch", "triton", "packed"), method="cispo", aggregation=aggregation)


def test_vespo_takes_the_token_modes_only_as_trl():
    batch = mismatch_batch(0.5)
    with pytest.raises(ValueError, match="vespo folds the rollout weights .* needs a token_"):
        dgpo_ops.reference_loss(**batch, method="vespo", rollout_correction=TrlCorrection("sequence_mask"))
    ratio = trl_importance_sampling_ratio(batch["old_logps"], batch["rollout_logps"], batch["mask"].float(),
                                          "token_mask", None, 3.0)
    assert_same_as_weights(TrlCorrection("token_mask"), batch, ratio, batch["mask"], ("reference", "torch", "packed"),
                           method="vespo")
