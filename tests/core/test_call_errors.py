"""Mistakes in how a loss call is made get an error that names the argument that is wrong and what to pass:
a source with an axis missing is named before the target ids its shape would ask for, the call objects'
constructors and ``policy_loss`` say what they take and point to ``LossOptions.build``, an input that only an
option reads is refused without that option, and a missing extra is named."""

from __future__ import annotations

import sys

import pytest
import torch

import dgpo_ops
from dgpo_ops import LossInputs, LossOptions, policy_loss

B, T, V, H = 2, 8, 100, 16


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g), torch.tensor([1.0, -0.5])


def test_logits_without_the_vocabulary_axis_are_named():
    _, target_ids, advantages = batch()
    with pytest.raises(ValueError, match=r"^logits must have shape \(B, T, V\) for target_ids of shape \(B, T\) = "
                                         r"\(2, 8\), got \(2, 8\) \(per-token values, not logits"):
        dgpo_ops.fused_dgpo_loss(torch.randn(B, T), target_ids, advantages)


def test_logits_passed_as_hidden_are_named():
    logits, target_ids, advantages = batch()
    with pytest.raises(ValueError, match=r"^hidden must have shape \(B, T, H\) or \(N, H\) with H = 16.*whose last "
                                         r"axis is the vocabulary: for logits use fused_dgpo_loss"):
        dgpo_ops.fused_linear_dgpo_loss(logits, torch.randn(V, H), target_ids, advantages)


def test_a_transposed_weight_is_named():
    _, target_ids, advantages = batch()
    with pytest.raises(ValueError, match=r"^weight must have shape \(V, H\) = \(V, 16\).*its transpose: pass "
                                         r"lm_head.weight"):
        dgpo_ops.fused_linear_dgpo_loss(torch.randn(B, T, H), torch.randn(H, V), target_ids, advantages)


def test_flat_hidden_states_beside_a_token_grid_are_named():
    _, target_ids, advantages = batch()
    with pytest.raises(ValueError, match=r"^hidden must have shape \(B, T, H\) for target_ids of shape \(B, T\)"):
        dgpo_ops.fused_linear_dgpo_loss(torch.randn(B * T, H), torch.randn(V, H), target_ids, advantages)


@pytest.mark.parametrize("mistake", ["swapped", "options_dict", "inputs_dict"])
def test_policy_loss_names_the_object_it_was_handed(mistake):
    logits, target_ids, advantages = batch()
    inputs, options = LossInputs(target_ids, advantages), LossOptions.build("grpo")
    calls = {
        "swapped": ((options, inputs), r"^policy_loss got options then inputs: pass the LossInputs first"),
        "options_dict": ((inputs, {"method": "grpo"}), (r"^policy_loss's options must be a LossOptions, got dict "
                                                        r"\(a dict of options: LossOptions.build\(\*\*that_dict\)\)")),
        "inputs_dict": (({"target_ids": target_ids}, options), (r"^policy_loss's inputs must be a LossInputs, got "
                                                                r"dict \(a dict of tensors: LossInputs\(")),
    }
    args, message = calls[mistake]
    with pytest.raises(TypeError, match=message) as error:
        policy_loss(*args, logits=logits)
    assert "LossOptions.build(method_name" in str(error.value)


def test_policy_loss_takes_its_source_by_keyword():
    logits, target_ids, advantages = batch()
    with pytest.raises(TypeError, match=r"^policy_loss takes its source by keyword, got 3 positional arguments: "
                                        r"policy_loss\(inputs, options, \*, logits=\.\.\."):
        policy_loss(LossInputs(target_ids, advantages), LossOptions.build("grpo"), logits)


def test_the_options_constructor_points_to_build():
    with pytest.raises(ValueError, match=r"^method must be a MethodConfig .*got str 'dgpo': "
                                         r"LossOptions.build\(method_name"):
        LossOptions("dgpo")
    with pytest.raises(TypeError, match=r"^LossOptions takes its fields \(method, temperature, .*\), got "
                                        r"unexpected keyword argument\(s\) n: LossOptions.build\(method_name"):
        LossOptions(method="dgpo", n=1.0)
    assert LossOptions(beta=0.1).beta == 0.1  # its fields, by keyword, as before


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


def test_the_trainer_without_trl_names_the_extra(monkeypatch):
    for name in list(sys.modules):
        if name == "trl" or name.startswith(("trl.", "dgpo_ops.trainer.")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl: ModuleNotFoundError, as where it is missing
    with pytest.raises(ImportError, match=r'^dgpo_ops.trainer.DGPOTrainer needs the trl extra \(trl is not '
                                          r'installed\): pip install "dgpo-ops\[trl\]"'):
        from dgpo_ops.trainer import DGPOTrainer  # noqa: F401
