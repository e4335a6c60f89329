"""Error messages name what the user passed and why it is refused, probed through
the public functions as a user calls them."""

from __future__ import annotations

import pytest
import torch

import dgpo_ops
from dgpo_ops.methods import catalog


@pytest.mark.parametrize("method", [name for name, spec in dgpo_ops.METHODS.items() if spec.sequence_statistic])
@pytest.mark.parametrize("fused", [True, False])
def test_flat_logits_for_a_sequence_method_name_the_method_not_the_aggregation(method, fused):
    loss = dgpo_ops.fused_dgpo_loss if fused else dgpo_ops.reference_loss
    with pytest.raises(ValueError, match=rf"flat \(N, V\) logits .* for method '{method}'") as error:
        loss(torch.randn(6, 11), torch.randint(0, 11, (6,)), torch.randn(6), method=method,
             **catalog.required_params(method))
    assert "aggregation" not in str(error.value)  # token_mean, the default, is fine for flat logits


def test_flat_logits_name_the_aggregation_or_the_sequence_ratio():
    args = (torch.randn(6, 11), torch.randint(0, 11, (6,)), torch.randn(6))
    with pytest.raises(ValueError, match="for aggregation 'seq_mean_token_sum_norm'$"):  # no method's own
        dgpo_ops.fused_dgpo_loss(*args, method="grpo", aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="for importance_sampling_level='sequence'$"):
        dgpo_ops.fused_dgpo_loss(*args, method="grpo", importance_sampling_level="sequence")


def test_a_method_without_parameters_says_so():
    with pytest.raises(ValueError, match="gpg does not take parameter.s. eps; it takes no parameters$"):
        dgpo_ops.method_config("gpg", eps=0.1)


def test_an_unknown_gspo_method_points_to_the_sequence_ratio():
    with pytest.raises(ValueError, match=r"unknown method 'gspo'; .*importance_sampling_level=\"sequence\""):
        dgpo_ops.fused_dgpo_loss(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.ones(2),
                                 method="gspo")
    with pytest.raises(ValueError) as error:  # other unknown names get no GSPO hint
        dgpo_ops.method_config("gsp")
    assert "importance_sampling_level" not in str(error.value)


@pytest.mark.parametrize(("route", "validation"), [  # reference_loss validates at the call only
    *((route, mode) for route in ("fused", "linear", "module") for mode in ("immediate", "deferred")),
    ("reference", "immediate")])
def test_log_probs_passed_as_the_fourth_positional_argument_say_it_is_the_mask(route, validation):
    """A common slip: old_logps passed right after advantages lands in ``mask``; the error names both slots."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 3, 4), torch.randn(5, 4)
    logits, target_ids, advantages = hidden @ weight.T, torch.zeros(2, 3, dtype=torch.long), torch.ones(2)
    old_logps = torch.log_softmax(logits, -1)[..., 0] - 0.1
    calls = {
        "fused": lambda: dgpo_ops.fused_dgpo_loss(logits, target_ids, advantages, old_logps, validation=validation),
        "reference": lambda: dgpo_ops.reference_loss(logits, target_ids, advantages, old_logps),
        "linear": lambda: dgpo_ops.fused_linear_dgpo_loss(hidden, weight, target_ids, advantages, old_logps,
                                                          validation=validation),
        "module": lambda: dgpo_ops.DGPOLoss(validation=validation)(logits, target_ids, advantages, old_logps),
    }
    hint = r"mask must hold only 0 and 1 .*the 4th of fused_dgpo_loss.* pass log-probs by keyword, old_logps="
    dgpo_ops.raise_deferred_errors()  # nothing left over from another test
    with pytest.raises(ValueError, match=hint):
        calls[route]()
        dgpo_ops.raise_deferred_errors()
