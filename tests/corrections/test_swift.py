"""ms-swift's rollout importance sampling as the correction stage equals its ``_apply_rollout_importance_sampling``
(with ``_compute_sequence_level_ratios``), re-derived below from SWIFT_TRAINER at SWIFT_COMMIT (ms-swift does
not install beside this package's TRL), on every route, with ragged and fully masked responses and drifts of
several nats; and it differs from TRL's modes of the same names where their math does."""

from __future__ import annotations

import pytest
import torch
from rollout_cases import CORRECTION_ROUTES, assert_same_as_weights, mismatch_batch

import dgpo_ops
from dgpo_ops.corrections import SwiftCorrection, TrlCorrection

SWIFT_TRAINER = "swift/rlhf_trainers/grpo_trainer.py"  # _apply_rollout_importance_sampling, L2311-2418
SWIFT_COMMIT = "3602360a562313afbf2ef6065fdf61f271a2c5b9"


def swift_weights(rollout_log_ratio, completion_mask, mode, threshold):
    is_ratio = torch.exp(torch.clamp(rollout_log_ratio, min=-20.0, max=20.0))

    def sequence_level_ratios():
        log_ratio = torch.log(is_ratio.clamp(min=1e-10))
        return torch.exp((log_ratio * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0))

    if mode == "token_truncate":
        return torch.clamp(is_ratio, max=threshold)
    if mode == "token_mask":
        return torch.where(is_ratio <= threshold, is_ratio, torch.zeros_like(is_ratio))
    if mode == "sequence_truncate":
        return torch.clamp(sequence_level_ratios(), max=threshold).unsqueeze(-1).expand_as(is_ratio)
    return is_ratio * (sequence_level_ratios() <= threshold).float().unsqueeze(-1)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("threshold", [1.2, 2.0])
@pytest.mark.parametrize("drift", [0.2, 3.0])
def test_swift_equals_swift(mode, threshold, drift):
    batch = mismatch_batch(drift, seed=31)
    mask = batch["mask"]
    weights = swift_weights(batch["old_logps"] - batch["rollout_logps"], mask.float(), mode, threshold)
    routes = CORRECTION_ROUTES if drift == 0.2 and threshold == 2.0 else ("reference", "torch", "packed")
    assert_same_as_weights(SwiftCorrection(mode, threshold), batch, weights, mask, routes, method="grpo")


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_swift_sequence_modes_are_not_trls(mode):
    """ms-swift's sequence ratio is the geometric mean, TRL's the product: not an alias."""
    batch = mismatch_batch(1.0, seed=32)
    swift = dgpo_ops.reference_loss(**batch, method="grpo", rollout_correction=SwiftCorrection(mode, 2.0))
    trl = dgpo_ops.reference_loss(**batch, method="grpo", rollout_correction=TrlCorrection(mode, None, 2.0))
    assert not torch.allclose(swift.loss, trl.loss)


@pytest.mark.parametrize("fields,message", [
    (dict(rollout_importance_sampling_mode="token"), "rollout_importance_sampling_mode must be one of"),
    (dict(rollout_importance_sampling_threshold=0.0), "rollout_importance_sampling_threshold must be > 0"),
    (dict(rollout_importance_sampling_threshold=-2.0), "rollout_importance_sampling_threshold must be > 0"),
    (dict(rollout_importance_sampling_threshold="2.0"), "rollout_importance_sampling_threshold must be a finite"),
])
def test_fields_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        SwiftCorrection(**fields)


def test_swift_refuses_a_kl_term_it_would_weight_differently():
    """At SWIFT_COMMIT ms-swift weights ``policy + beta * KL`` (its _compute_loss, L1078-1081); the stage weights the
    policy term only, so a call with beta > 0 would not be ms-swift's loss: refused, with the reason."""
    batch = mismatch_batch(0.5, seed=31)
    with pytest.raises(ValueError, match="ms-swift multiplies the KL term"):
        dgpo_ops.reference_loss(**batch, method="grpo", beta=0.04, ref_logps=batch["old_logps"] - 0.1,
                                rollout_correction=SwiftCorrection())
    dgpo_ops.reference_loss(**batch, method="grpo", rollout_correction=SwiftCorrection())  # beta = 0: fine


def test_the_dispatch_refuses_a_mode_it_does_not_know():
    """Every mode is one branch of the dispatch, which ends in a refusal: a mode that got past the fields' check
    (a frozen dataclass changed by hand) is not computed as another mode."""
    correction = SwiftCorrection("sequence_mask")
    object.__setattr__(correction, "rollout_importance_sampling_mode", "sequence_geometric")
    with pytest.raises(ValueError, match="rollout_importance_sampling_mode must be one of"):
        dgpo_ops.reference_loss(**mismatch_batch(0.5, seed=31), method="grpo", rollout_correction=correction)
