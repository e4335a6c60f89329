"""Every per-token float of ``LossInputs`` (a field marked ``TokenFloat``) is checked, laid out and carried by its
mark alone: these tests run over ``TOKEN_FLOATS``, so a new field is tested on every route without an edit here,
once ``READS_ALL`` names an option that reads it."""

from __future__ import annotations

import pytest
import torch
from helpers import logits_batch

import dgpo_ops
from dgpo_ops.core.inputs import OBJECTIVE_FLOATS, OP_TENSORS, TOKEN_FLOATS, LossInputs

B, T, V, H = 3, 5, 17, 8
LENGTHS = (5, 3, 4)
# A call that reads every per-token float: the KL its reference log-probs, the positive-example NLL the scores.
READS_ALL = dict(method="dgpo", beta=0.1, positive_nll_coef=0.2)


def inputs(seed=0) -> dict:
    batch = logits_batch(B, T, V, seed=seed, per_token_adv=True)
    g = torch.Generator().manual_seed(seed + 1)
    for name in TOKEN_FLOATS:
        batch.setdefault(name, torch.rand(B, T, generator=g) * 2 - 0.5)
    for b, length in enumerate(LENGTHS):  # nothing beyond each response's length (the packed layout drops it)
        batch["target_ids"][b, length:] = -100
    return batch


def projection(seed=0):
    g = torch.Generator().manual_seed(seed + 2)
    return torch.randn(B, T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)


ROUTES = {
    "fused": lambda batch: dgpo_ops.fused_dgpo_loss(**batch, **READS_ALL).loss,
    "reference": lambda batch: dgpo_ops.reference_loss(**batch, **READS_ALL).loss,
    "linear": lambda batch: dgpo_ops.fused_linear_dgpo_loss(
        *projection(), **{k: v for k, v in batch.items() if k != "logits"}, **READS_ALL).loss,
}


def per_response(value: torch.Tensor) -> torch.Tensor:
    """One value per response (its first token's), and the same spread over its tokens."""
    return value[:, 0].clone()


def test_the_marks_derive_the_tensors_of_every_route():
    assert set(TOKEN_FLOATS) <= set(LossInputs._fields)
    assert OP_TENSORS == tuple(name for name in LossInputs._fields if name in ("target_ids", "mask", *TOKEN_FLOATS))
    assert "scores" in OBJECTIVE_FLOATS and "advantages" not in OBJECTIVE_FLOATS


@pytest.mark.parametrize("name", TOKEN_FLOATS)
@pytest.mark.parametrize("route", ROUTES)
def test_each_is_read_and_checked_on_every_route(route, name):
    batch = inputs()
    loss = ROUTES[route](batch)
    changed = dict(batch, **{name: batch[name] + 0.25})
    assert not torch.allclose(ROUTES[route](changed), loss), f"{name} is not read by READS_ALL on {route}"
    with pytest.raises(ValueError, match=f"{name} must have shape"):
        ROUTES[route](dict(batch, **{name: batch[name][:, :-1]}))
    with pytest.raises(ValueError, match=f"{name} must be a floating-point tensor"):
        ROUTES[route](dict(batch, **{name: batch[name].to(torch.int64)}))
    bad = batch[name].clone()
    bad[1, 1] = float("inf")
    with pytest.raises(ValueError, match=f"^{name} .*non-finite values on unmasked tokens"):
        ROUTES[route](dict(batch, **{name: bad}))


@pytest.mark.parametrize("name", TOKEN_FLOATS)
@pytest.mark.parametrize("route", ROUTES)
def test_a_per_response_value_equals_it_spread_over_the_tokens(route, name):
    batch = inputs(seed=3)
    one = per_response(batch[name])
    if TOKEN_FLOATS[name].per_response:
        spread = ROUTES[route](dict(batch, **{name: one[:, None].expand(B, T)}))
        torch.testing.assert_close(ROUTES[route](dict(batch, **{name: one})), spread)
    else:
        with pytest.raises(ValueError, match=rf"{name} must have shape \({B}, {T}\), got \({B},\)"):
            ROUTES[route](dict(batch, **{name: one}))


def packed(batch: dict) -> tuple[dict, torch.Tensor]:
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return {name: torch.cat([value[b, :n] for b, n in enumerate(LENGTHS)]) if value.dim() >= 2 else value
            for name, value in batch.items()}, cu


@pytest.mark.parametrize("name", TOKEN_FLOATS)
def test_packed_sequences_pad_each_as_the_padded_grid_reads_it(name):
    batch = inputs(seed=5)
    want = dgpo_ops.fused_dgpo_loss(**batch, **READS_ALL, aggregation="seq_mean_token_mean").loss
    flat, cu = packed(batch)
    got = dgpo_ops.fused_dgpo_loss(**flat, cu_seqlens=cu, **READS_ALL, aggregation="seq_mean_token_mean").loss
    torch.testing.assert_close(got, want)
    one = per_response(batch[name])
    flat_one = dict(flat, **{name: one})
    if TOKEN_FLOATS[name].per_response:
        want = dgpo_ops.fused_dgpo_loss(**dict(batch, **{name: one}), **READS_ALL).loss
        torch.testing.assert_close(dgpo_ops.fused_dgpo_loss(**flat_one, cu_seqlens=cu, **READS_ALL).loss, want)
    else:
        with pytest.raises(ValueError, match=f"{name} must have shape .* for packed tokens"):
            dgpo_ops.fused_dgpo_loss(**flat_one, cu_seqlens=cu, **READS_ALL)
