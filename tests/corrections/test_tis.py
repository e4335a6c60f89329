"""OpenRLHF's and NeMo-RL's tis / icepop / seq-mask-tis as the correction stage equal their code, re-derived
below from the cited sources (neither installs on a CPU): OpenRLHF's ``PolicyLoss.forward`` IS block
(OPENRLHF_LOSS at OPENRLHF_COMMIT) and NeMo-RL's ``ClippedPGLossFn.__call__`` IS block (NEMO_RL_LOSS at
NEMO_RL_COMMIT), on every route, with ragged and fully masked responses, drifts of several nats, and (NeMo-RL)
NaN inference log-probs."""

from __future__ import annotations

import pytest
import torch
from rollout_cases import CORRECTION_ROUTES, assert_same_as_weights, mismatch_batch

from dgpo_ops.corrections import NemoRLCorrection, OpenRLHFCorrection

OPENRLHF_LOSS = "openrlhf/models/loss.py"  # PolicyLoss.forward, the vllm_is block; utils.masked_mean = sum / sum
OPENRLHF_COMMIT = "3c3be6234e0cb353e76bb8019947db9dfe99fca7"
NEMO_RL_LOSS = "nemo_rl/algorithms/loss/loss_functions.py"  # ClippedPGLossFn.__call__, importance-sampling block
NEMO_RL_COMMIT = "006907a9570734f3e5d484c08ada84b0b89224c9"


def openrlhf_weights(old_log_probs, rollout_log_probs, action_mask, kind, low_threshold, high_threshold):
    """The factor OpenRLHF multiplies its per-token PPO loss by."""
    def masked_mean(tensor, mask, dim):
        return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)

    rollout_log_ratio = old_log_probs - rollout_log_probs
    if kind == "icepop":
        vllm_is = torch.exp(rollout_log_ratio).detach()
        return vllm_is * ((vllm_is >= low_threshold) & (vllm_is <= high_threshold))
    if kind == "seq-mask-tis":
        seq_is = torch.exp(masked_mean(rollout_log_ratio, action_mask, dim=-1))
        seq_mask = (seq_is >= low_threshold) & (seq_is <= high_threshold)
        return seq_mask.unsqueeze(-1) * torch.exp(rollout_log_ratio).detach()
    return torch.exp(rollout_log_ratio).clamp(min=low_threshold, max=high_threshold).detach()


def nemo_rl_weights(prev_logprobs, generation_logprobs, prev_mask, kind, ratio, ratio_min, sequence_level):
    """The importance weights NeMo-RL multiplies its clipped loss by (use_importance_sampling_correction=True),
    and its is_oob_ratio (with every sample valid: sample_mask 1)."""
    def masked_mean(values, mask, dim=None):
        return (values * mask).sum(dim=dim) / (mask.sum(dim=dim) + 1e-8)

    metrics = {}
    if sequence_level:
        seq_lp_diff = ((prev_logprobs - generation_logprobs) * prev_mask).sum(dim=-1)
        weights = torch.nan_to_num(torch.exp(seq_lp_diff), nan=0.0, posinf=0.0, neginf=0.0).unsqueeze(-1)
    else:
        weights = torch.nan_to_num(torch.exp(prev_logprobs - generation_logprobs), nan=0.0, posinf=0.0, neginf=0.0)
    if ratio is not None:
        if kind == "tis":
            tis_min = 0.0 if ratio_min is None else ratio_min
            oob = (weights > ratio) | (weights < tis_min)
            metrics["is_oob_ratio"] = masked_mean(oob.expand_as(prev_mask).float(), prev_mask)
            weights = torch.clamp(weights, min=tis_min, max=ratio)
        elif kind == "icepop":
            kept = (weights >= ratio_min) & (weights <= ratio)
            metrics["is_oob_ratio"] = masked_mean((~kept).expand_as(prev_mask).float(), prev_mask)
            weights = torch.where(kept, weights, torch.zeros_like(weights))
        else:
            log_is_ratio = torch.nan_to_num(prev_logprobs - generation_logprobs, nan=0.0, posinf=0.0, neginf=0.0)
            geo = torch.exp(masked_mean(log_is_ratio, prev_mask, dim=-1))
            kept = ((geo >= ratio_min) & (geo <= ratio)).float()
            metrics["is_oob_ratio"] = masked_mean(1.0 - kept, torch.ones_like(kept))
            weights = weights * kept.unsqueeze(-1)
    return weights.expand_as(prev_mask), metrics


# OpenRLHF 0.11.2's named schemes as its (is_correction_level, is_correction_mode)
OPENRLHF_SCHEMES = {"tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("seq", "mask")}
OPENRLHF_CASES = [("tis", (0.5, 5.0)), ("tis", (0.8, 1.2)), ("icepop", (0.5, 2.0)), ("seq-mask-tis", (0.7, 1.3)),
                  ("seq-mask-tis", (0.2, 5.0))]


@pytest.mark.parametrize("kind,threshold", OPENRLHF_CASES)
@pytest.mark.parametrize("drift", [0.1, 3.0])
def test_openrlhf_equals_openrlhf(kind, threshold, drift):
    batch = mismatch_batch(drift, seed=21)
    mask = batch["mask"]
    weights = openrlhf_weights(batch["old_logps"], batch["rollout_logps"], mask.float(), kind, *threshold)
    weights = torch.where(mask, weights, 0.0)  # an empty response's NaN lies outside the mask
    routes = CORRECTION_ROUTES if drift == 0.1 else ("reference", "torch", "packed")
    assert_same_as_weights(OpenRLHFCorrection(*OPENRLHF_SCHEMES[kind], is_correction_threshold=threshold), batch,
                           weights, mask, routes, method="grpo",
                           aggregation="seq_mean_token_mean")


NEMO_CASES = [(None, None, None, False), (None, None, None, True), ("tis", 2.0, None, False),
              ("tis", 1.5, 0.5, True), ("icepop", 5.0, 0.5, False), ("icepop", 3.0, 0.3, True),
              ("seq-mask-tis", 1.2, 0.8, False), ("seq-mask-tis", 1.002, 0.999, False)]


@pytest.mark.parametrize("kind,ratio,ratio_min,sequence_level", NEMO_CASES)
@pytest.mark.parametrize("drift,nan_tokens", [(0.1, False), (0.5, True), (3.0, False)])
def test_nemo_rl_equals_nemo_rl(kind, ratio, ratio_min, sequence_level, drift, nan_tokens):
    batch = mismatch_batch(drift, seed=22, nan_tokens=nan_tokens)
    if nan_tokens:  # NeMo-RL's padding holds finite log-probs (NaN there would zero a sequence weight)
        batch["rollout_logps"] = torch.where(batch["mask"], batch["rollout_logps"], batch["old_logps"])
    mask = batch["mask"]
    weights, metrics = nemo_rl_weights(batch["old_logps"], batch["rollout_logps"], mask.float(), kind, ratio,
                                       ratio_min, sequence_level)
    correction = NemoRLCorrection(kind, ratio, ratio_min, sequence_level)
    routes = CORRECTION_ROUTES if drift == 0.5 else ("reference", "torch", "packed")
    ours = assert_same_as_weights(correction, batch, weights, mask, routes, method="cispo")
    for name, want in metrics.items():
        torch.testing.assert_close(ours[name], want.float())


def test_the_two_differ_where_values_are_not_finite():
    """NeMo-RL zeroes a NaN token's weight, and so does OpenRLHF's mask mode (the NaN ratio is outside every
    band); OpenRLHF's clip mode keeps the NaN (the call refuses it, naming the correction, where OpenRLHF's loss
    would be NaN)."""
    batch = mismatch_batch(0.5, seed=23, nan_tokens=True)
    import dgpo_ops

    out = dgpo_ops.reference_loss(**batch, method="grpo", rollout_correction=NemoRLCorrection("icepop", 5.0, 0.2))
    assert torch.isfinite(out.loss)
    masked = dgpo_ops.reference_loss(**batch, method="grpo", rollout_correction=OpenRLHFCorrection("token", "mask"))
    assert torch.isfinite(masked.loss)
    with pytest.raises(ValueError, match="rollout_correction OpenRLHFCorrection.* non-finite weights from rollout_logps"):
        dgpo_ops.reference_loss(**batch, method="grpo", rollout_correction=OpenRLHFCorrection("token", "clip"))


@pytest.mark.parametrize("cls,fields", [
    (OpenRLHFCorrection, dict(is_correction_level="off")), (OpenRLHFCorrection, dict(is_correction_mode="mis")),
    (OpenRLHFCorrection, dict(is_correction_gating="kl")), (OpenRLHFCorrection, dict(is_correction_threshold=(1, 2, 3))),
    (OpenRLHFCorrection, dict(is_correction_level="seq", is_correction_mode="clip")),
    (OpenRLHFCorrection, dict(is_correction_gating="tv", is_correction_threshold=(0.5, 5.0))),
    (NemoRLCorrection, dict(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=2.0)),
    (NemoRLCorrection, dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=0.0)),
    (NemoRLCorrection, dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.0,
                            truncated_importance_sampling_ratio_min=2.0)),
    (NemoRLCorrection, dict(truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=2.0,
                            truncated_importance_sampling_ratio_min=0.5, sequence_level_importance_ratios=True)),
    (NemoRLCorrection, dict(truncated_importance_sampling_ratio=2.0)),
    (OpenRLHFCorrection, dict(is_correction_threshold=(3.0, 2.0))),
    (OpenRLHFCorrection, dict(is_correction_threshold=("0.5", 5.0))),
    (NemoRLCorrection, dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio="2.0")),
])
def test_fields_are_checked(cls, fields):
    with pytest.raises(ValueError, match="is_correction|truncated_importance_sampling|sequence_level"):
        cls(**fields)
