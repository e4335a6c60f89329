"""The public loss functions' docstrings come from one source (dgpo_ops.core.docstrings)."""

import inspect

import pytest

import dgpo_ops
from dgpo_ops.core.docstrings import ARGUMENTS, documented

PUBLIC = [dgpo_ops.reference_loss, dgpo_ops.fused_dgpo_loss, dgpo_ops.fused_linear_dgpo_loss]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda fn: fn.__name__)
def test_every_argument_is_described_with_the_shared_text(fn):
    for name in inspect.signature(fn).parameters:
        assert f"* ``{name}``: {ARGUMENTS[name]}" in fn.__doc__


def test_an_undescribed_argument_fails_at_definition():
    with pytest.raises(AssertionError, match="no description of 'colour'"):
        @documented("x")
        def loss(logits, colour):  # noqa: ARG001
            pass
