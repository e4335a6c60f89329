"""Mistakes in how a loss call is made get an error that names the argument that is wrong and what to pass:
an input that only an option reads is refused without that option."""

from __future__ import annotations

import pytest
import torch

import dgpo_ops
from dgpo_ops import LossInputs, LossOptions, policy_loss

B, T, V, H = 2, 8, 100, 16


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g), torch.tensor([1.0, -0.5])


def test_reference_log_probs_without_beta_are_refused():
    """Only the KL reads ref_logps: with beta 0 they were dropped without a word."""
    logits, target_ids, advantages = batch()
    ref_logps = torch.log_softmax(logits, -1).gather(-1, target_ids[..., None])[..., 0]
    message = r"^ref_logps are read only by the KL term, which beta=0 turns off: pass beta > 0"
    for loss in (dgpo_ops.fused_dgpo_loss, dgpo_ops.reference_loss):
        with pytest.raises(ValueError, match=message):
            loss(logits, target_ids, advantages, ref_logps=ref_logps)
    with pytest.raises(ValueError, match=message):
        policy_loss(LossInputs(None, advantages, ref_logps=ref_logps), LossOptions.build("grpo"),
                    logps=ref_logps.clone())
    assert torch.isfinite(dgpo_ops.fused_dgpo_loss(logits, target_ids, advantages, ref_logps=ref_logps,
                                                   beta=0.04).loss)
