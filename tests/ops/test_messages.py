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
