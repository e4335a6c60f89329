"""Scalar options that are finite Python floats but leave float32's range (the kernels' runtime arguments)
are refused where they are read, naming the option, on every entry point (as float32 they would reach the
kernels as inf or 0); a value just inside the range works."""

from __future__ import annotations

import pytest
import torch
from helpers import logits_batch, value_error_message

import dgpo_ops

# One value for each check (the normaliser's, LossOptions' three, a method parameter's), on every entry point:
# a check tests its option's range in one condition, so the other side of the range takes the same branch (but
# temperature's, whose inverse has a condition of its own).
OUT_OF_RANGE = [
    (dict(loss_normalizer=1e-45), "loss_normalizer must be a finite number > 0"),  # 0 in float32: NaN before
    (dict(temperature=1e-39), "temperature"),  # its inverse is inf in float32
    (dict(temperature=1e39), "temperature"),
    (dict(beta=1e39), "beta"),
    (dict(entropy_coef=-1e39), "entropy_coef"),
    (dict(method="dgpo", n=1e39), "dgpo: n"),
]


def call(entry, kwargs):
    batch = logits_batch(2, 5, 11, seed=0, ref_logps=True)
    logits = batch.pop("logits")
    if "ref_logps" in batch and not kwargs.get("beta"):
        batch.pop("ref_logps", None)
    if entry == "reference":
        return dgpo_ops.reference_loss(logits, **batch, **kwargs)
    if entry in ("torch", "triton"):
        return dgpo_ops.fused_dgpo_loss(logits, **batch, **kwargs, backend=entry)
    if entry == "module":
        normalizer = kwargs.pop("loss_normalizer", None)
        return dgpo_ops.DGPOLoss(**kwargs)(logits, **batch, loss_normalizer=normalizer)
    hidden = torch.eye(11)[None, None, :, :].expand(2, 1, 11, 11)[:, 0, :5].contiguous()  # hidden @ I.T: rows of I
    return dgpo_ops.fused_linear_dgpo_loss(hidden, torch.eye(11), **batch, **kwargs)


ENTRIES = ["reference", "torch", "triton", "module", "linear"]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(("kwargs", "match"), OUT_OF_RANGE, ids=[str(k) for k, _ in OUT_OF_RANGE])
def test_out_of_float32_range_is_refused(entry, kwargs, match):
    message = value_error_message(lambda: call(entry, dict(kwargs)))
    assert message is not None and match in message, message


@pytest.mark.parametrize("entry", ENTRIES)
def test_inside_the_range_works(entry):
    kwargs = dict(loss_normalizer=1e-30, temperature=3e-38, entropy_coef=1e-30)
    out = call(entry, kwargs)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize(("kwargs", "match"), [(dict(logit_scale=1e-45), "logit_scale"),
                                                (dict(softcap=1e39), "softcap")])
def test_projection_scalars(kwargs, match):
    assert match in value_error_message(lambda: call("linear", kwargs))
