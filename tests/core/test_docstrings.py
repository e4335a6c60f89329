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


def test_the_correction_argument_names_every_framework_family():
    # a family added to dgpo_ops.corrections without its line here would leave the public docstrings behind
    import dgpo_ops.corrections as corrections

    families = [name for name in corrections.__all__ if name.endswith("Correction") and name != "RolloutCorrection"]
    assert families and all(f"``{name}``" in ARGUMENTS["rollout_correction"] for name in families)
