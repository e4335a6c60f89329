"""Packed (padding-free) sequences: ``(total_tokens, V)`` logits or ``(total_tokens, H)`` hidden states with
``cu_seqlens`` give exactly what the padded ``(B, max_seqlen)`` layout gives, for a method of every route
(helpers.ROUTE_VARIANTS: the layout reaches a method's math only through its route) under each aggregation,
per-response and per-token advantages, KL, entropy bonus, temperature and GSPO, on both kernel sets (the Triton
kernels in the interpreter, and their torch twins); bad input under deferred validation gives what it gives on the
padded layout: a NaN loss and gradient, then an error naming the argument."""

from __future__ import annotations

import pytest
import torch
from helpers import ROUTE_VARIANTS, for_method, logits_batch, variant_id

import dgpo_ops

LENGTHS = [5, 1, 7, 3]  # the padded layout is (4, 7)


def pack(batch: dict, lengths=LENGTHS):
    """The padded batch's real tokens back to back, and cu_seqlens."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = {}
    for name, value in batch.items():
        if torch.is_tensor(value) and value.dim() >= 2:
            packed[name] = torch.cat([value[b, :length] for b, length in enumerate(lengths)])
        else:
            packed[name] = value  # per-response advantages
    return packed, cu


def padded_batch(seed=0, per_token_adv=False, dtype=torch.float32):
    batch = logits_batch(len(LENGTHS), max(LENGTHS), 50, seed=seed, per_token_adv=per_token_adv, dtype=dtype,
                         ref_logps=True)
    for b, length in enumerate(LENGTHS):  # beyond each sequence's length there is no token
        batch["target_ids"][b, length:] = -100
    return batch


def unpack_rows(padded: torch.Tensor, lengths=LENGTHS) -> torch.Tensor:
    return torch.cat([padded[b, :length] for b, length in enumerate(lengths)])


OPTION_SETS = {
    "token_mean": dict(),
    "seq_mean_token_mean+kl+entropy+temperature+nll": dict(aggregation="seq_mean_token_mean", beta=0.05,
                                                           entropy_coef=0.01, temperature=0.7, positive_nll_coef=0.1),
    "seq_mean_token_sum_norm": dict(aggregation="seq_mean_token_sum_norm"),
    "seq_sum_token_mean+normalizer": dict(aggregation="seq_sum_token_mean", loss_normalizer=3.0),
    "gspo": dict(importance_sampling_level="sequence", aggregation="seq_mean_token_mean"),
}


def compare(got, want, got_grad, want_grad, rtol=1e-5, atol=1e-6, grad_tolerance=None):
    torch.testing.assert_close(got.loss, want.loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(got.logps, unpack_rows(want.logps), rtol=rtol, atol=atol)
    torch.testing.assert_close(got.entropy, unpack_rows(want.entropy), rtol=rtol, atol=atol)
    # the metrics are fp32 on every route (float64 twins too): fp32's rounding of a mean at least
    torch.testing.assert_close(got.metrics.as_tensor(), want.metrics.as_tensor(), rtol=max(rtol, 1e-6),
                               atol=max(atol, 1e-6))
    torch.testing.assert_close(got_grad, unpack_rows(want_grad), **(grad_tolerance or dict(rtol=rtol, atol=atol)))


@pytest.mark.parametrize("options", list(OPTION_SETS), ids=list(OPTION_SETS))
@pytest.mark.parametrize("variant", ROUTE_VARIANTS, ids=variant_id)
@pytest.mark.parametrize("loss_fn", ["fused-torch", "fused-triton", "reference"])
def test_packed_logits_equal_the_padded_layout(variant, options, loss_fn):
    name, params = variant
    keywords = dict(method=name, **params, **for_method(name, OPTION_SETS[options], responses=len(LENGTHS)))
    batch = padded_batch(per_token_adv=options == "token_mean")
    if not keywords.get("beta"):
        batch.pop("ref_logps", None)
    padded_logits = batch.pop("logits").requires_grad_(True)
    want = dgpo_ops.reference_loss(padded_logits, **batch, **keywords)
    want.loss.backward()
    packed, cu = pack({"logits": padded_logits.detach(), **batch})
    logits = packed.pop("logits").clone().requires_grad_(True)
    if loss_fn == "reference":
        got = dgpo_ops.reference_loss(logits, **packed, **keywords, cu_seqlens=cu)
    else:
        got = dgpo_ops.fused_dgpo_loss(logits, **packed, **keywords, cu_seqlens=cu, backend=loss_fn.split("-")[1])
    got.loss.backward()
    compare(got, want, logits.grad, padded_logits.grad)


@pytest.mark.parametrize("options", ["token_mean", "seq_mean_token_mean+kl+entropy+temperature+nll", "gspo"])
@pytest.mark.parametrize("projection", [dict(), dict(softcap=5.0, logit_scale=0.8)], ids=["plain", "softcap"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_hidden_states_equal_the_padded_layout(options, projection, backend):
    keywords = dict(method="dgpo", **for_method("dgpo", OPTION_SETS[options], responses=len(LENGTHS)), **projection,
                    backend=backend)
    # The twins in float64, so that the two paths' different summation orders leave nothing to tolerate;
    # the Triton kernels take float32 (the padded layout's own tile path is the comparison, also Triton).
    dtype, tolerance = (torch.float64, 1e-9) if backend == "torch" else (torch.float32, 2e-5)
    batch = padded_batch(seed=3)
    if not keywords.get("beta"):
        batch.pop("ref_logps", None)
    batch.pop("logits")
    generator = torch.Generator().manual_seed(5)
    float64 = dict(generator=generator, dtype=dtype)
    hidden = torch.randn(len(LENGTHS), max(LENGTHS), 16, **float64).requires_grad_(True)
    weight = torch.randn(50, 16, **float64).requires_grad_(True)
    bias = torch.randn(50, **float64).requires_grad_(True)
    want = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **batch, bias=bias, **keywords)
    want.loss.backward()
    want_grads = [t.grad.clone() for t in (weight, bias)]
    weight.grad = bias.grad = None
    packed, cu = pack({"hidden": hidden.detach(), **batch})
    packed_hidden = packed.pop("hidden").clone().requires_grad_(True)
    got = dgpo_ops.fused_linear_dgpo_loss(packed_hidden, weight, **packed, bias=bias, **keywords, cu_seqlens=cu,
                                          max_seqlen=max(LENGTHS))
    got.loss.backward()
    compare(got, want, packed_hidden.grad, hidden.grad, rtol=tolerance, atol=tolerance)
    for grad, want_grad in zip((weight.grad, bias.grad), want_grads):
        torch.testing.assert_close(grad, want_grad, rtol=tolerance, atol=tolerance)


def test_packed_bf16_logits_and_old_logprobs():
    batch = padded_batch(seed=4, dtype=torch.bfloat16)
    batch.pop("ref_logps", None)
    padded_logits = batch.pop("logits").requires_grad_(True)
    want = dgpo_ops.reference_loss(padded_logits, **batch, aggregation="seq_mean_token_mean")
    want.loss.backward()
    packed, cu = pack({"logits": padded_logits.detach(), **batch})
    logits = packed.pop("logits").clone().requires_grad_(True)
    got = dgpo_ops.fused_dgpo_loss(logits, **packed, aggregation="seq_mean_token_mean", cu_seqlens=cu.int())
    got.loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    compare(got, want, logits.grad.float(), padded_logits.grad.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("change, match", [
    (dict(cu_seqlens=torch.tensor([0, 5, 6, 13, 15])), "end at the number of packed tokens"),
    (dict(cu_seqlens=torch.tensor([0, 5, 4, 13, 16])), "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0.0, 16.0])), "int32 or int64"),
    (dict(cu_seqlens=torch.tensor([0, 5, 6, 13, 16]), max_seqlen=6), "max_seqlen"),
    (dict(cu_seqlens=None, max_seqlen=7), "max_seqlen goes with cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 5, 6, 13, 16]), old_logps=torch.zeros(15)), "old_logps must have shape"),
])
def test_packed_bad_input_names_the_argument(change, match):
    batch = padded_batch()
    batch.pop("ref_logps", None)
    packed, cu = pack(batch)
    arguments = {**packed, "cu_seqlens": cu, **change}
    if arguments["cu_seqlens"] is None:
        del arguments["cu_seqlens"]
    with pytest.raises(ValueError, match=match):
        dgpo_ops.fused_dgpo_loss(**arguments)


BAD_VALUES = {  # name -> (how to spoil the packed inputs, the argument the error names)
    "mask_half": (lambda packed: packed["mask"].__setitem__(2, 0.5), "mask must hold only 0 and 1"),
    "mask_two": (lambda packed: packed["mask"].__setitem__(2, 2.0), "mask must hold only 0 and 1"),
    "target": (lambda packed: packed["target_ids"].__setitem__(3, 50), "target_ids must be in"),
    "advantages": (lambda packed: packed["advantages"].__setitem__(1, float("inf")), "advantages has non-finite"),
    "cu_seqlens": (lambda packed: packed.__setitem__("cu_seqlens", torch.tensor([0, 5, 4, 13, 16])),
                   "cu_seqlens must start at 0, be non-decreasing"),
}


@pytest.mark.parametrize("op", ["logits", "linear"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", list(BAD_VALUES))
def test_packed_bad_values_under_deferred_validation_give_nan_then_the_error(bad, backend, op):
    """As on the padded layout: the loss and every gradient NaN (nothing quietly wrong), and the error that names
    the argument raised by ``raise_deferred_errors()``."""
    spoil, message = BAD_VALUES[bad]
    batch = padded_batch(seed=2, per_token_adv=True)
    batch.pop("ref_logps", None)
    batch["mask"] = batch["mask"].float()
    packed, cu = pack(batch)
    packed["cu_seqlens"] = cu
    spoil(packed)
    logits = packed.pop("logits").clone().requires_grad_(True)
    keywords = dict(aggregation="seq_mean_token_mean", validation="deferred", backend=backend, max_seqlen=7)
    dgpo_ops.raise_deferred_errors()  # nothing left over from other tests
    if op == "logits":
        out = dgpo_ops.fused_dgpo_loss(logits, **packed, **keywords)
        leaves = [logits]
    else:
        generator = torch.Generator().manual_seed(1)
        hidden = torch.randn(logits.shape[0], 8, generator=generator).requires_grad_(True)
        weight = torch.randn(50, 8, generator=generator).requires_grad_(True)
        out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **packed, **keywords)
        leaves = [hidden, weight]
    grads = torch.autograd.grad(out.loss, leaves)
    assert out.loss.isnan()
    for grad in grads:
        assert grad.isnan().any() and not grad.isfinite().all()
    with pytest.raises(ValueError, match=message):
        dgpo_ops.raise_deferred_errors()


def test_padded_logits_with_cu_seqlens_are_refused():
    batch = padded_batch()
    with pytest.raises(ValueError, match="total_tokens"):
        dgpo_ops.fused_dgpo_loss(**batch, cu_seqlens=torch.tensor([0, 5, 6, 13, 16]))


def test_advantages_whose_shape_fits_sequences_and_tokens_alike_are_an_error_that_says_what_to_pass():
    # cu_seqlens = [0, 0, 2, 3]: an empty sequence, so B == total_tokens == 3 with lengths 0, 2, 1: one advantage
    # per sequence and one per token read differently. (B,) is refused; (B, 1) is per sequence, (1, N) per token.
    lengths = [0, 2, 1]
    batch = logits_batch(3, 2, 50, seed=8)
    batch["target_ids"][0] = -100
    batch["target_ids"][2, 1] = -100
    batch.pop("ref_logps", None)
    padded_logits = batch.pop("logits")
    packed, cu = pack({"logits": padded_logits, **batch}, lengths)
    logits = packed.pop("logits")
    per_sequence = packed.pop("advantages")
    assert per_sequence.shape == (3,) and logits.shape[0] == 3
    with pytest.raises(ValueError, match=r"advantages of shape \(3,\) are ambiguous.*advantages\[:, None\].*"
                                         r"advantages\[None\]"):
        dgpo_ops.fused_dgpo_loss(logits, **packed, advantages=per_sequence, cu_seqlens=cu)
    with pytest.raises(ValueError, match="ambiguous"):  # the reference reads them as the op does
        dgpo_ops.reference_loss(logits, **packed, advantages=per_sequence, cu_seqlens=cu)

    def both_readings(advantages, padded_advantages):
        want_logits = padded_logits.clone().requires_grad_(True)
        want = dgpo_ops.reference_loss(want_logits, **batch | {"advantages": padded_advantages},
                                       aggregation="seq_mean_token_mean")
        want.loss.backward()
        leaf = logits.clone().requires_grad_(True)
        got = dgpo_ops.fused_dgpo_loss(leaf, **packed, advantages=advantages, aggregation="seq_mean_token_mean",
                                       cu_seqlens=cu)
        got.loss.backward()
        assert got.loss.abs() > 0
        torch.testing.assert_close(got.loss, want.loss)
        torch.testing.assert_close(leaf.grad, unpack_rows(want_logits.grad, lengths))
        return got.loss

    sequence_reading = both_readings(per_sequence[:, None], per_sequence)
    per_token = torch.tensor([0.7, -1.3, 0.4])
    token_reading = both_readings(per_token[None], pack_values(per_token, lengths, width=2))
    assert not torch.isclose(sequence_reading, token_reading)


def pack_values(values, lengths, width):
    """Per-token values in packed order laid on the padded (B, width) grid (0 where there is no token)."""
    grid = torch.zeros(len(lengths), width)
    start = 0
    for b, length in enumerate(lengths):
        grid[b, :length] = values[start:start + length]
        start += length
    return grid


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_packed_hidden_states_under_autocast_match_the_tile_path(softcap):
    # bf16 autocast over fp32 parameters: both paths round the operands to bf16 and accumulate in fp32, so
    # the loss and per-token values agree to fp32 rounding; both round the gradient tile to bf16 before their GEMMs
    # (as cuBLAS-fed paths do): gradients to bf16's 2^-8. (Before autocast was turned off inside, the softcap case's log-probs were 1e-2 off.)
    batch = padded_batch(seed=6)
    batch.pop("ref_logps", None)
    batch.pop("logits")
    generator = torch.Generator().manual_seed(9)
    hidden = torch.randn(len(LENGTHS), max(LENGTHS), 16, generator=generator).requires_grad_(True)
    weight = torch.randn(50, 16, generator=generator).requires_grad_(True)
    keywords = dict(method="dgpo", softcap=softcap, entropy_coef=0.01, aggregation="seq_mean_token_mean")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **batch, **keywords)
    want.loss.backward()
    want_weight_grad, weight.grad = weight.grad, None
    packed, cu = pack({"hidden": hidden.detach(), **batch})
    packed_hidden = packed.pop("hidden").clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dgpo_ops.fused_linear_dgpo_loss(packed_hidden, weight, **packed, **keywords, cu_seqlens=cu)
    got.loss.backward()
    bf16_rounding = dict(rtol=2**-7, atol=2**-7 * float(want_weight_grad.abs().max()))
    compare(got, want, packed_hidden.grad, hidden.grad, rtol=1e-4, atol=1e-5, grad_tolerance=bf16_rounding)
    torch.testing.assert_close(weight.grad, want_weight_grad, **bf16_rounding)


def test_the_linear_op_refuses_max_seqlen_without_cu_seqlens():
    hidden, weight = torch.randn(6, 8), torch.randn(20, 8)
    with pytest.raises(ValueError, match="max_seqlen goes with cu_seqlens"):
        dgpo_ops.fused_linear_dgpo_loss(hidden, weight, torch.zeros(6, dtype=torch.long), torch.ones(6), max_seqlen=6)


def test_the_loss_module_takes_packed_batches():
    batch = padded_batch(seed=2)
    batch.pop("ref_logps", None)
    packed, cu = pack(batch)
    logits = packed.pop("logits")
    module = dgpo_ops.DGPOLoss("dgpo", aggregation="seq_mean_token_mean")
    want = dgpo_ops.fused_dgpo_loss(logits, **packed, aggregation="seq_mean_token_mean", cu_seqlens=cu)
    torch.testing.assert_close(module(logits, **packed, cu_seqlens=cu).loss, want.loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="flat"):  # without cu_seqlens the module sees flat tokens
        module(logits, **packed)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_logits_take_inplace_like_the_others(backend):
    """The packed layout runs the same autograd Function: inplace=True writes the same gradient into the logits."""
    batch = padded_batch(seed=2)
    batch.pop("ref_logps", None)
    packed, cu = pack(batch)
    logits = packed.pop("logits")
    leaf = logits.clone().requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(leaf, **packed, cu_seqlens=cu, backend=backend)
    out.loss.backward()
    inplace_leaf = logits.clone().requires_grad_(True)
    overwritten = inplace_leaf * 1.0  # a non-leaf the op may overwrite with its gradient
    inplace_out = dgpo_ops.fused_dgpo_loss(overwritten, **packed, cu_seqlens=cu, backend=backend, inplace=True)
    inplace_out.loss.backward()
    torch.testing.assert_close(inplace_out.loss, out.loss)
    torch.testing.assert_close(inplace_leaf.grad, leaf.grad)
    torch.testing.assert_close(overwritten.detach(), leaf.grad)  # the logits' storage holds the gradient
