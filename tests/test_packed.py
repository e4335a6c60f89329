"""Packed (padding-free) sequences: ``(total_tokens, V)`` logits or ``(total_tokens, H)`` hidden states with
``cu_seqlens`` give exactly what the padded ``(B, max_seqlen)`` layout gives, for every method variant,
aggregation, per-response and per-token advantages, KL, entropy bonus, temperature and GSPO."""

from __future__ import annotations

import pytest
import torch
from helpers import METHOD_VARIANTS, logits_batch, variant_id

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
    batch = logits_batch(len(LENGTHS), max(LENGTHS), 50, seed=seed, per_token_adv=per_token_adv, dtype=dtype)
    for b, length in enumerate(LENGTHS):  # beyond each sequence's length there is no token
        batch["target_ids"][b, length:] = -100
    return batch


def unpack_rows(padded: torch.Tensor, lengths=LENGTHS) -> torch.Tensor:
    return torch.cat([padded[b, :length] for b, length in enumerate(lengths)])


OPTION_SETS = {
    "token_mean": dict(),
    "seq_mean_token_mean+kl+entropy+temperature": dict(aggregation="seq_mean_token_mean", beta=0.05,
                                                       entropy_coef=0.01, temperature=0.7),
    "seq_mean_token_sum_norm": dict(aggregation="seq_mean_token_sum_norm"),
    "seq_sum_token_mean+normalizer": dict(aggregation="seq_sum_token_mean", loss_normalizer=3.0),
    "gspo": dict(importance_sampling_level="sequence", aggregation="seq_mean_token_mean"),
}


def compare(got, want, got_grad, want_grad, rtol=1e-5, atol=1e-6, grad_tolerance=None):
    torch.testing.assert_close(got.loss, want.loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(got.logps, unpack_rows(want.logps), rtol=rtol, atol=atol)
    torch.testing.assert_close(got.entropy, unpack_rows(want.entropy), rtol=rtol, atol=atol)
    torch.testing.assert_close(got.metrics.as_tensor(), want.metrics.as_tensor(), rtol=rtol, atol=atol)
    torch.testing.assert_close(got_grad, unpack_rows(want_grad), **(grad_tolerance or dict(rtol=rtol, atol=atol)))


@pytest.mark.parametrize("options", list(OPTION_SETS), ids=list(OPTION_SETS))
@pytest.mark.parametrize("variant", METHOD_VARIANTS, ids=[variant_id(v) for v in METHOD_VARIANTS])
@pytest.mark.parametrize("loss_fn", ["fused", "reference"])
def test_packed_logits_equal_the_padded_layout(variant, options, loss_fn):
    name, params = variant
    keywords = dict(method=name, **params, **OPTION_SETS[options])
    batch = padded_batch(per_token_adv=options == "token_mean")
    if not keywords.get("beta"):
        batch.pop("ref_logps")
    padded_logits = batch.pop("logits").requires_grad_(True)
    want = dgpo_ops.reference_loss(padded_logits, **batch, **keywords)
    want.loss.backward()
    packed, cu = pack({"logits": padded_logits.detach(), **batch})
    logits = packed.pop("logits").clone().requires_grad_(True)
    fn = dgpo_ops.fused_dgpo_loss if loss_fn == "fused" else dgpo_ops.reference_loss
    got = fn(logits, **packed, **keywords, cu_seqlens=cu)
    got.loss.backward()
    compare(got, want, logits.grad, padded_logits.grad)


@pytest.mark.parametrize("options", ["token_mean", "seq_mean_token_mean+kl+entropy+temperature", "gspo"])
@pytest.mark.parametrize("projection", [dict(), dict(softcap=5.0, logit_scale=0.8)], ids=["plain", "softcap"])
def test_packed_hidden_states_equal_the_padded_layout(options, projection):
    keywords = dict(method="dgpo", **OPTION_SETS[options], **projection)
    batch = padded_batch(seed=3)
    if not keywords.get("beta"):
        batch.pop("ref_logps")
    batch.pop("logits")
    generator = torch.Generator().manual_seed(5)
    # float64, so that the two paths' different summation orders leave nothing to tolerate
    float64 = dict(generator=generator, dtype=torch.float64)
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
    compare(got, want, packed_hidden.grad, hidden.grad, rtol=1e-9, atol=1e-9)
    for grad, want_grad in zip((weight.grad, bias.grad), want_grads):
        torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-9)


def test_packed_bf16_logits_and_old_logprobs():
    batch = padded_batch(seed=4, dtype=torch.bfloat16)
    batch.pop("ref_logps")
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
    batch.pop("ref_logps")
    packed, cu = pack(batch)
    arguments = {**packed, "cu_seqlens": cu, **change}
    if arguments["cu_seqlens"] is None:
        del arguments["cu_seqlens"]
    with pytest.raises(ValueError, match=match):
        dgpo_ops.fused_dgpo_loss(**arguments)


def test_padded_logits_with_cu_seqlens_are_refused():
    batch = padded_batch()
    with pytest.raises(ValueError, match="total_tokens"):
        dgpo_ops.fused_dgpo_loss(**batch, cu_seqlens=torch.tensor([0, 5, 6, 13, 16]))


def test_an_empty_sequence_and_per_sequence_advantages_when_B_equals_the_token_count():
    # cu_seqlens = [0, 0, 2]: an empty sequence, and B == total_tokens, where (B,) advantages are per sequence.
    lengths = [0, 2]
    batch = logits_batch(2, 2, 50, seed=8)
    batch["target_ids"][0] = -100
    batch.pop("ref_logps")
    padded_logits = batch.pop("logits").requires_grad_(True)
    want = dgpo_ops.reference_loss(padded_logits, **batch, aggregation="seq_mean_token_mean")
    want.loss.backward()
    packed, cu = pack({"logits": padded_logits.detach(), **batch}, lengths)
    logits = packed.pop("logits").clone().requires_grad_(True)
    got = dgpo_ops.fused_dgpo_loss(logits, **packed, aggregation="seq_mean_token_mean", cu_seqlens=cu)
    got.loss.backward()
    assert got.loss.abs() > 0
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(logits.grad, unpack_rows(padded_logits.grad, lengths))


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_packed_hidden_states_under_autocast_match_the_tile_path(softcap):
    # bf16 autocast over fp32 parameters: both paths round the operands to bf16 and accumulate in fp32, so
    # the loss and per-token values agree to fp32 rounding; the tile path also rounds the gradient tile to
    # bf16 before its GEMMs (as cuBLAS-fed paths do), the chunked path keeps it fp32: gradients to bf16's
    # 2^-8. (Before autocast was turned off inside, the softcap case's log-probs were 1e-2 off.)
    batch = padded_batch(seed=6)
    batch.pop("ref_logps")
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
    batch.pop("ref_logps")
    packed, cu = pack(batch)
    logits = packed.pop("logits")
    module = dgpo_ops.DGPOLoss("dgpo", aggregation="seq_mean_token_mean")
    want = dgpo_ops.fused_dgpo_loss(logits, **packed, aggregation="seq_mean_token_mean", cu_seqlens=cu)
    torch.testing.assert_close(module(logits, **packed, cu_seqlens=cu).loss, want.loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="flat"):  # without cu_seqlens the module sees flat tokens
        module(logits, **packed)
