"""Every loss option is a keyword of the public functions' own signatures, described in their docstrings; none
travels in ``**method_params``, whose docstring says it holds the method's parameters."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import dgpo_ops
from dgpo_ops.core.options import LossOptions

# options a function takes in another form: method (its first keyword), the ops' own switches
NOT_KEYWORDS = {"reference_loss": {"inplace", "backend", "validation"}, "fused_linear_dgpo_loss": {"inplace"}}


@pytest.mark.parametrize("function", ["fused_dgpo_loss", "fused_linear_dgpo_loss", "reference_loss"])
def test_every_loss_option_is_a_named_keyword(function):
    parameters = inspect.signature(getattr(dgpo_ops, function)).parameters
    options = {field.name for field in dataclasses.fields(LossOptions)}
    missing = options - set(parameters) - NOT_KEYWORDS.get(function, set())
    assert not missing, f"{function} takes {sorted(missing)} only through **method_params"
    doc = getattr(dgpo_ops, function).__doc__
    for name in options & set(parameters):
        assert f"``{name}``" in doc


def test_kl_ratio_correction_is_a_bool():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="kl_ratio_correction must be a bool"):
        dgpo_ops.reference_loss(logits, torch.zeros(2, 3, dtype=torch.long), torch.ones(2), kl_ratio_correction="no")
