"""fused_linear_dgpo_loss against reference_loss on the materialised logits: a method of every route
(helpers.ROUTE_VARIANTS: the projection reaches a method's math only through its route), token and sequence level,
bias, logit_scale, softcap, temperature, KL, entropy and entropy weights; both backends."""

from __future__ import annotations

import pytest
import torch
from helpers import (ROUTE_VARIANTS, for_method, largest_allocations, linear_case, logits_batch, make_logits,
                     variant_id)
from worlds import XDIST_GROUP, start_world

import dgpo_ops


def run_linear(variant, backend, options, dtype=torch.float32, seed=0, logits_on_chip=False, **case):
    name, params = variant
    (hidden, weight, bias), inputs = linear_case(seed=seed, dtype=dtype, ref_logps=bool(options.get("beta")),
                                                 **case)
    options = dict(options)
    if options.pop("entropy_weights", False):  # a second entropy term with weights of its own
        inputs["entropy_weights"] = torch.rand(inputs["target_ids"].shape, generator=torch.Generator().manual_seed(seed))
    projection = dict(logit_scale=case.get("logit_scale", 1.0), softcap=case.get("softcap"))
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    ref_leaves = [t.detach().double().clone().requires_grad_(True) if t is not None else None for t in leaves]
    logits = make_logits(*ref_leaves, **projection)
    ref = dgpo_ops.reference_loss(logits, **inputs, method=name, **params, **options)
    out = dgpo_ops.fused_linear_dgpo_loss(leaves[0], leaves[1], **inputs, bias=leaves[2], method=name, **params,
                                          **projection, **options, backend=backend, logits_on_chip=logits_on_chip,
                                          memory_budget=2 * 70 * 4 * 2)  # two-token tiles: many chunks
    wanted = [t for t in ref_leaves if t is not None]
    ref_grads = torch.autograd.grad(ref.loss, wanted)
    grads = torch.autograd.grad(out.loss, [t for t in leaves if t is not None])
    return ref, out, ref_grads, grads


OPTION_SETS = {
    "plain": dict(),
    "kl_entropy_temperature_nll": dict(beta=0.05, entropy_coef=0.02, temperature=0.8, kl_ratio_correction=True,
                                       positive_nll_coef=0.1),
    "kl_entropy_temperature": dict(beta=0.05, entropy_coef=0.02, temperature=0.8, kl_ratio_correction=True,
                                   entropy_weights=True),
    "gspo": dict(importance_sampling_level="sequence", aggregation="seq_mean_token_mean", entropy_coef=0.01),
}


# "on_chip": the Triton kernels that keep the logits in registers (logits_on_chip=True).
PATHS = ["triton", "torch", "on_chip"]


@pytest.mark.parametrize("options", list(OPTION_SETS), ids=list(OPTION_SETS))
@pytest.mark.parametrize("variant", ROUTE_VARIANTS, ids=variant_id)
@pytest.mark.parametrize("backend", PATHS)
def test_linear_matches_reference(backend, variant, options):
    case = dict(logit_scale=1.3, softcap=4.0) if options == "kl_entropy_temperature_nll" else {}
    on_chip = backend == "on_chip"
    ref, out, ref_grads, grads = run_linear(variant, "triton" if on_chip else backend,
                                            for_method(variant[0], OPTION_SETS[options], responses=3),
                                            logits_on_chip=on_chip, **case)
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logps.double(), ref.logps.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ref.entropy.double(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    for key in ref.metrics:
        torch.testing.assert_close(out.metrics[key].double(), ref.metrics[key].double(), rtol=1e-5, atol=1e-6,
                                   msg=key)


def rounded_like_the_model(logits: torch.Tensor, dtype) -> torch.Tensor:
    """The product rounded once to ``dtype`` (what the model's lm_head returns), with the gradient of
    the exact product: rounding is a straight-through step for the reference."""
    return logits + (logits.to(dtype).double() - logits).detach()


@pytest.mark.parametrize("vocab", [70, 300])  # 300: the weight cast in three vocabulary blocks (vocab_block_rows)
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16_weights", "autocast_fp32_weights"])
@pytest.mark.parametrize("backend", PATHS)
def test_low_precision_products_equal_the_models_logits(backend, autocast, vocab):
    # The tile is the model's own bf16 logits (the product accumulated in fp32, rounded once), under
    # autocast or with bf16 weights alike; the loss then keeps fp32 accuracy against an fp64
    # reference on those logits. Gradients are fp32-accumulated from bf16 operands and come back in
    # each input's dtype. On chip the operands are rounded to bf16 as they are loaded (no copy of fp32
    # master weights) and the fp32 product is rounded to bf16 in registers: the same logits as the tiles
    # (an fp32 product kept on chip gives log-probs up to 1e-2 away from the tiles').
    on_chip = backend == "on_chip"
    (hidden, weight, bias), inputs = linear_case(V=vocab, dtype=torch.float32 if autocast else torch.bfloat16,
                                                 ref_logps=True)
    operands = [t.to(torch.bfloat16) for t in (hidden, weight, bias)]
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref_leaves = [t.detach().double().requires_grad_(True) for t in operands]
    ref_logits = rounded_like_the_model(make_logits(*ref_leaves), torch.bfloat16)
    ref = dgpo_ops.reference_loss(ref_logits, **inputs, beta=0.02)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = dgpo_ops.fused_linear_dgpo_loss(leaves[0], leaves[1], **inputs, bias=leaves[2], beta=0.02,
                                              backend="triton" if on_chip else backend, logits_on_chip=on_chip,
                                              memory_budget=2 * 70 * 4 * 2)
    ref_grads = torch.autograd.grad(ref.loss, ref_leaves)
    grads = torch.autograd.grad(out.loss, leaves)
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logps.double(), ref.logps.double(), rtol=1e-5, atol=1e-5)
    for got, want, leaf in zip(grads, ref_grads, leaves):
        assert got.dtype == leaf.dtype
        # the gradient tile is rounded to bf16 before the fp32-accumulated GEMMs: 2^-8 relative per
        # element, averaging out over the V (or N) terms of each product
        torch.testing.assert_close(got.double(), want, rtol=2.0**-6, atol=2e-3 * want.abs().max().item())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_a_call_without_tokens_hands_back_zero_gradients(autocast):
    # the accumulators are written by the first tile's products, not zero-filled: a call that has no tile
    # zeroes them itself (memory just freed, full of NaN, is what an unwritten one would hold)
    H, V = 16, 300
    dirty = torch.full((V, H), float("nan"))
    del dirty
    hidden = torch.randn(2, 0, H, requires_grad=True)
    weight, bias = torch.randn(V, H, requires_grad=True), torch.randn(V, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2),
                                              bias=bias)
    out.loss.backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))
    assert hidden.grad.shape == hidden.shape


def test_tied_embeddings_accumulate_both_gradients():
    torch.manual_seed(0)
    V, H, B, T = 40, 12, 2, 5
    embedding = torch.randn(V, H, requires_grad=True)
    tokens = torch.randint(0, V, (B, T))
    inputs = logits_batch(B, T, V, seed=1)
    inputs.pop("logits")
    inputs["old_logps"] = None

    def hidden_of(weight):
        return torch.tanh(weight[tokens] * 1.5)

    out = dgpo_ops.fused_linear_dgpo_loss(hidden_of(embedding), embedding, **inputs)
    (grad,) = torch.autograd.grad(out.loss, embedding)
    ref_weight = embedding.detach().clone().requires_grad_(True)
    ref = dgpo_ops.reference_loss(hidden_of(ref_weight) @ ref_weight.T, **inputs)
    (ref_grad,) = torch.autograd.grad(ref.loss, ref_weight)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_incoming_gradient_scales_every_parameter():
    (hidden, weight, bias), inputs = linear_case()
    leaves = [t.requires_grad_(True) for t in (hidden, weight, bias)]
    out = dgpo_ops.fused_linear_dgpo_loss(leaves[0], leaves[1], **inputs, bias=leaves[2])
    once = torch.autograd.grad(out.loss, leaves, retain_graph=True)
    thrice = torch.autograd.grad(3.0 * out.loss, leaves)
    for a, b in zip(once, thrice):
        torch.testing.assert_close(b, 3.0 * a)


def test_double_backward_is_refused():
    # Its gradients are made in the forward, with no graph: create_graph=True would hand them back
    # without the second-order terms of hidden and weight. It fails instead.
    (hidden, weight, bias), inputs = linear_case()
    leaves = [t.requires_grad_(True) for t in (hidden, weight, bias)]
    out = dgpo_ops.fused_linear_dgpo_loss(leaves[0], leaves[1], **inputs, bias=leaves[2])
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(out.loss, leaves, create_graph=True)


def test_masked_tokens_get_zero_hidden_gradient():
    (hidden, weight, _), inputs = linear_case(bias=False)
    hidden.requires_grad_(True)
    out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, entropy_coef=0.1)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    masked = ~inputs["mask"] | (inputs["target_ids"] == -100)
    assert masked.any() and grad[masked].abs().max() == 0 and grad[~masked].abs().max() > 0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_forward_only_logprobs(backend):
    (hidden, weight, bias), inputs = linear_case(softcap=5.0)
    logps, entropy = dgpo_ops.fused_linear_logprobs(hidden, weight, inputs["target_ids"], inputs["mask"], bias=bias,
                                                    softcap=5.0, temperature=0.7, backend=backend)
    ref = dgpo_ops.reference_loss(make_logits(hidden, weight, bias, softcap=5.0), inputs["target_ids"],
                                  inputs["advantages"], inputs["mask"], temperature=0.7)
    torch.testing.assert_close(logps, ref.logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref.entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [dict(method="sapo", gate="erf", entropy_coef=0.1, beta=0.1),
     dict(method="grpo", eps_low=1.0, eps_high=50.0, importance_sampling_level="sequence",
          aggregation="seq_mean_token_mean", softcap=3.0, logit_scale=0.7)],
)
def test_cpu_path_gradcheck_fp64(kwargs):
    # Methods and regions whose gradient is the derivative of their value (see test_fused_parity).
    (hidden, weight, bias), inputs = linear_case(B=2, T=3, H=4, V=6, seed=2, dtype=torch.float64,
                                                 ref_logps=bool(kwargs.get("beta")))
    leaves = tuple(t.requires_grad_(True) for t in (hidden, weight, bias))

    def loss(h, w, b):
        return dgpo_ops.fused_linear_dgpo_loss(h, w, **inputs, bias=b, backend="torch", **kwargs).loss

    assert torch.autograd.gradcheck(loss, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_no_allocation_of_n_by_v_elements():
    N, H, V = 512, 32, 4096
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    target = torch.randint(0, V, (1, N), generator=g)
    advantages = torch.ones(1)

    def step():
        out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, target, advantages, memory_budget=V * 4 * 64)
        out.loss.backward()

    sizes = largest_allocations(step)
    assert sizes[0] < N * V * 4, sizes[:3]
    assert weight.grad is not None and torch.isfinite(weight.grad).all()


@pytest.mark.parametrize(
    "change, match",
    [(dict(weight=torch.randn(70, 15)), "weight"), (dict(weight=torch.randn(70, 16).double()), "dtype"),
     (dict(bias=torch.randn(69)), "bias"), (dict(inplace=True), "inplace"), (dict(softcap=-1.0), "softcap"),
     # as torch.nn.functional.linear: outside autocast the bias is in the weight's dtype
     (dict(bias=torch.randn(70).bfloat16()), r"bias \(torch.bfloat16\) and weight \(torch.float32\) must have the same"),
     (dict(logit_scale=0.0), "logit_scale"), (dict(target_ids=torch.full((3, 6), 70)), "target_ids")],
)
def test_bad_inputs_raise(change, match):
    (hidden, weight, bias), inputs = linear_case()
    args = dict(hidden=hidden, weight=weight, bias=bias, **inputs)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        dgpo_ops.fused_linear_dgpo_loss(**args)


def _dtensor_weight_worker(rank, world_size, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        # the same inputs on every process
        (hidden, weight, bias), inputs = linear_case(seed=7, ref_logps=True)
        leaf = hidden.detach().clone().requires_grad_(True)
        replicated = distribute_tensor(weight.detach().clone(), mesh, [Replicate()]).requires_grad_(True)
        replicated_bias = distribute_tensor(bias.detach().clone(), mesh, [Replicate()]).requires_grad_(True)
        out = dgpo_ops.fused_linear_dgpo_loss(leaf, replicated, **inputs, bias=replicated_bias, beta=0.02)
        out.loss.backward()
        assert isinstance(replicated.grad, DTensor) and tuple(replicated.grad.placements) == (Replicate(),)
        sharded = distribute_tensor(weight.detach().clone(), mesh, [Shard(0)]).requires_grad_(True)
        try:
            dgpo_ops.fused_linear_dgpo_loss(leaf, sharded, **inputs)
            refused = None
        except ValueError as error:
            refused = str(error)
        torch.save({"loss": out.loss.detach(), "hidden": leaf.grad, "weight": replicated.grad.to_local(),
                    "bias": replicated_bias.grad.to_local(), "refused": refused}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.xdist_group(XDIST_GROUP)  # its world forks from the worker that starts the others (worlds.py)
def test_dtensor_weights_replicated_are_used_sharded_are_refused(tmp_path):
    # A replicated DTensor is the whole weight on every process: used as it is, its gradient a
    # replicated DTensor equal to the plain op's. A Shard(0) DTensor may be FSDP's storage sharding
    # or a tensor-parallel vocabulary split; the op does not guess (tests/distributed/test_fsdp.py has FSDP2).
    start_world(_dtensor_weight_worker, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    (hidden, weight, bias), inputs = linear_case(seed=7, ref_logps=True)
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    out = dgpo_ops.fused_linear_dgpo_loss(leaves[0], leaves[1], **inputs, bias=leaves[2], beta=0.02)
    out.loss.backward()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], out.loss.detach())
        for name, leaf in zip(("hidden", "weight", "bias"), leaves):
            torch.testing.assert_close(got[name], leaf.grad, msg=name)
        assert got["refused"] is not None and "weight is a DTensor placed as (Shard(dim=0),)" in got["refused"]


@pytest.mark.parametrize("path", ["triton", "torch", "on_chip", "chunked"])
def test_non_finite_hidden_on_masked_tokens_is_ignored(path):
    """A padded position's hidden state may hold anything (NaN, inf): as the logits op ignores non-finite
    logits on masked tokens, the linear op gives the answer of the same call with those rows zeroed, and
    finite gradients. ``chunked``: the packed path (``cu_seqlens``)."""
    (hidden, weight, bias), inputs = linear_case()
    masked = ~inputs["mask"] | (inputs["target_ids"] == -100)
    assert masked.any()
    dirty = hidden.clone()
    dirty[masked] = float("nan")
    b, t = masked.nonzero()[0].tolist()
    dirty[b, t] = float("inf")
    clean = torch.where(masked[..., None], 0.0, hidden)
    kwargs = dict(entropy_coef=0.01, bias=bias)
    if path == "chunked":
        B, T = masked.shape
        kwargs.update(cu_seqlens=torch.arange(0, B * T + 1, T, dtype=torch.int32), max_seqlen=T)
        flat = {k: v.reshape(-1) if torch.is_tensor(v) and v.dim() == 2 else v for k, v in inputs.items()}
        inputs = flat
        dirty, clean = dirty.reshape(B * T, -1), clean.reshape(B * T, -1)
    else:
        kwargs.update(backend="triton" if path == "on_chip" else path, logits_on_chip=path == "on_chip")
    results = []
    for h in (dirty, clean):
        leaves = [h.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        out = dgpo_ops.fused_linear_dgpo_loss(leaves[0], leaves[1], **inputs, **kwargs)
        results.append((out.loss, *torch.autograd.grad(out.loss, leaves)))
    for got, expected in zip(*results):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected)


def test_on_chip_and_tiles_score_the_same_logits_under_autocast():
    """Under bf16 autocast over fp32 weights both paths round the product to bf16 as the model's lm_head
    does, so their log-probs agree to fp32 rounding (old log-probs from one path give ratios of 1 on the
    other); with the fp32 product on chip they would differ by about 1e-2 nats."""
    (hidden, weight, bias), inputs = linear_case(dtype=torch.float32)
    hidden = hidden * 4  # logits of a few units, where bf16's rounding shows
    outs = []
    for on_chip in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, bias=bias, backend="triton",
                                                        logits_on_chip=on_chip))
    torch.testing.assert_close(outs[1].logps, outs[0].logps, rtol=0, atol=2e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(hidden, weight, bias)
    assert logits.dtype == torch.bfloat16
    model = torch.log_softmax(logits.float(), -1).gather(-1, inputs["target_ids"].clamp(min=0)[..., None])[..., 0]
    scored = inputs["mask"] & (inputs["target_ids"] != -100)
    torch.testing.assert_close(outs[1].logps[scored], model[scored], rtol=0, atol=2e-5)


def _masked_by_current(batch, logps, entropies):
    """A trainer's use of ``complete_batch``: advantages masked where the current entropy is low (TRL's entropy
    mask) and the current log-prob far from the old one (its off-policy mask), an entropy bonus on the kept tokens."""
    keep = (entropies > entropies[batch.mask].median()) & ((logps - batch.old_logps).abs() < 1.0)
    advantages = batch.advantages[:, None] * keep
    tokens = batch.mask & keep
    return batch._replace(advantages=advantages, entropy_weights=tokens * (0.3 / tokens.sum().clamp(min=1)))


@pytest.mark.parametrize("method", ["grpo", "gspo", "clip_cov"])
@pytest.mark.parametrize("backend", PATHS)
def test_a_batch_completed_from_the_first_sweep_equals_it_given_upfront(backend, method):
    """``complete_batch`` (dgpo_ops.ops.linear.CompleteBatch) sees the log-probs and entropies of the call's own
    first sweep, exactly those ``fused_linear_logprobs`` returns: the loss, gradients, per-token values and metrics
    are those of the completed batch passed to a call of its own."""
    from dgpo_ops.core.inputs import LossInputs
    from dgpo_ops.ops.linear import linear_loss

    method, params = ("grpo", dict(importance_sampling_level="sequence")) if method == "gspo" else (method, {})
    (hidden, weight, bias), inputs = linear_case(seed=5, ref_logps=True)
    on_chip = backend == "on_chip"
    options = dgpo_ops.LossOptions.build(method, backend="triton" if on_chip else backend, beta=0.02,
                                         memory_budget=2 * 70 * 4 * 2, logits_on_chip=on_chip, **params)
    batch = LossInputs(inputs["target_ids"], inputs["advantages"], inputs["mask"], inputs["old_logps"],
                      inputs["ref_logps"], generator=torch.Generator().manual_seed(0))
    seen = []

    def complete(logps, entropies):
        seen.append((logps, entropies))
        return _masked_by_current(batch, logps, entropies)

    def run(batch, complete_batch=None):
        leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
        if batch.generator is not None:
            batch.generator.manual_seed(0)
        out = linear_loss(leaves[0], leaves[1], leaves[2], batch, options, complete_batch=complete_batch)
        return out, torch.autograd.grad(out.loss, leaves)

    out, grads = run(batch, complete)
    (logps, entropies), = seen
    upfront = dgpo_ops.fused_linear_logprobs(hidden, weight, inputs["target_ids"], inputs["mask"], bias=bias,
                                             memory_budget=options.memory_budget, logits_on_chip=on_chip,
                                             backend=options.backend)
    assert torch.equal(logps, upfront[0]) and torch.equal(entropies, upfront[1])
    completed = _masked_by_current(batch, *upfront)
    assert 0 < completed.entropy_weights.count_nonzero() < batch.mask.sum()  # the masks cut some scored tokens
    want, want_grads = run(completed)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-6, atol=1e-7)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(out.logps, want.logps) and torch.equal(out.entropy, want.entropy)
    for key in want.metrics:
        torch.testing.assert_close(out.metrics[key], want.metrics[key], msg=key)


def test_complete_batch_must_keep_the_tokens():
    from dgpo_ops.core.inputs import LossInputs
    from dgpo_ops.ops.linear import linear_loss

    (hidden, weight, bias), inputs = linear_case()
    batch = LossInputs(inputs["target_ids"], inputs["advantages"], inputs["mask"])
    options = dgpo_ops.LossOptions.build("grpo")
    with pytest.raises(ValueError, match="must keep the batch's target_ids, mask and loss_normalizer"):
        linear_loss(hidden, weight, bias, batch, options,
                    complete_batch=lambda logps, entropies: batch._replace(mask=batch.mask.clone()))


@pytest.mark.parametrize("layout", ["cu_seqlens", "compile"])
def test_entropy_weights_refused_where_not_supported(layout):
    (hidden, weight, bias), inputs = linear_case()
    inputs["entropy_weights"] = torch.ones(inputs["target_ids"].shape)
    if layout == "cu_seqlens":
        flat = {k: v.reshape(-1) if torch.is_tensor(v) and v.shape == inputs["target_ids"].shape else v
                for k, v in inputs.items()}
        flat["advantages"] = inputs["advantages"][:, None].expand(inputs["target_ids"].shape).reshape(-1)
        cu_seqlens = torch.arange(0, hidden.shape[0] * hidden.shape[1] + 1, hidden.shape[1])
        with pytest.raises(ValueError, match="entropy_weights are not supported with"):
            dgpo_ops.fused_linear_dgpo_loss(hidden.reshape(-1, hidden.shape[-1]), weight, **flat, bias=bias,
                                            cu_seqlens=cu_seqlens)
    else:
        compiled = torch.compile(dgpo_ops.fused_linear_dgpo_loss, fullgraph=True, backend="eager")
        with pytest.raises(Exception, match="entropy_weights are not supported under torch.compile"):
            compiled(hidden, weight, **inputs, bias=bias)


def test_d_hidden_reads_the_whole_weight_in_its_own_dtype_where_no_gemm_writes_fp32():
    # A GPU with torch < 2.8 has no fp32-output GEMM of bf16 operands: d hidden then multiplies the whole bf16
    # weight as it is and widens only the product (the tile's rows), never a weight-sized fp32 copy. Stood in for
    # on the CPU by a projection whose GEMMs take bf16 operands.
    from dgpo_ops.ops.linear import Precision, TileProjection

    V, H, rows = 600, 48, 4
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g).to(torch.bfloat16)
    projection = TileProjection(weight, None, Precision.resolve(weight, None, None), memory_budget=2**20)
    projection.gemm_dtype = torch.bfloat16
    grad_tile = torch.randn(rows, V, generator=g).to(torch.bfloat16)
    grad_hidden = torch.empty(rows, H)

    sizes = largest_allocations(lambda: projection.accumulate_grads(grad_tile, torch.zeros(rows, H), grad_hidden,
                                                                    None, None, first=True))
    assert sizes[0] < V * H * 4, sizes[:3]
    torch.testing.assert_close(grad_hidden, (grad_tile @ weight).float())


class RecordingProjection:
    """Stands in for TileProjection in sweep_tiles: records each logits product."""

    def __init__(self, log):
        self.log = log

    def logits(self, hidden, out):
        self.log.append(("logits", hidden[0, 0].item(), out.data_ptr()))


@pytest.mark.parametrize("tokens", [1, 7, 8])
def test_a_pipelined_sweep_runs_each_tiles_products_after_the_next_tiles_logits(tokens):
    # Two tile buffers: tile c's gradient GEMMs wait until tile c + 1's logits are made, so that on CUDA tile c + 1's
    # row kernels run on the side stream beside them; a buffer is written again only after its products ran.
    from dgpo_ops.ops.linear import Tiles, sweep_tiles

    options = dgpo_ops.LossOptions.build("grpo", memory_budget=10 * 4 * 4)  # 4 rows of 10 fp32 columns
    precision = linear_precision(torch.float32)
    tiles = Tiles(tokens, 10, precision, torch.device("cpu"), options, pipelined=True)
    assert len(tiles.slots) == (2 if tokens > 4 else 1) and tiles.rows == (2 if tokens > 4 else min(tokens, 4))
    log = []
    hidden = torch.arange(tokens, dtype=torch.float32)[:, None].expand(tokens, 3)
    sweep_tiles(hidden, RecordingProjection(log), tiles,
                lambda start, stop, slot: log.append(("rows", start, slot.logits.data_ptr())),
                lambda start, stop, slot: log.append(("products", start, slot.logits.data_ptr())))
    starts = list(range(0, tokens, tiles.rows))
    expected = []
    for index, start in enumerate(starts):
        slot = tiles.slots[index % len(tiles.slots)].logits.data_ptr()
        expected += [("logits", float(start), slot), ("rows", start, slot)]
        if len(tiles.slots) == 1:
            expected.append(("products", start, slot))
        elif index > 0:
            expected.append(("products", starts[index - 1], tiles.slots[(index - 1) % 2].logits.data_ptr()))
    if len(tiles.slots) == 2:
        expected.append(("products", starts[-1], tiles.slots[(len(starts) - 1) % 2].logits.data_ptr()))
    assert log == expected


def linear_precision(dtype):
    from dgpo_ops.ops.linear import Precision

    return Precision.resolve(torch.empty(1, 1, dtype=dtype), None, None)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_pipelined_sweep_equals_the_serial_one(monkeypatch, level):
    # Same loss and gradients with two half-size tile buffers (PIPELINE_TILES) as with one: only the chunks'
    # boundaries move, so the fp32 sums of the weight gradient regroup.
    from dgpo_ops.ops import linear as linear_module

    (hidden, weight, bias), inputs = linear_case(seed=3, ref_logps=False)
    made = []
    original = linear_module.Tiles.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(len(self.slots))

    monkeypatch.setattr(linear_module.Tiles, "__init__", recording)
    results = {}
    for pipelined in (True, False):
        monkeypatch.setattr(linear_module, "PIPELINE_TILES", pipelined)
        leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
        out = dgpo_ops.fused_linear_dgpo_loss(leaves[0], leaves[1], **inputs, bias=leaves[2], method="grpo",
                                              importance_sampling_level=level, memory_budget=70 * 4 * 4,
                                              backend="triton")
        results[pipelined] = (out.loss, *torch.autograd.grad(out.loss, leaves))
    assert made[0] == 2 and made[-1] == 1
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_overlapped_weight_casts_hand_out_each_block_cast_one_ahead_in_two_buffers(monkeypatch):
    # OVERLAP_WEIGHT_CASTS: block i + 1's cast is launched (on CUDA: on the side stream) before block i is handed to
    # its GEMM, so that it runs beside it; the blocks alternate between two buffers, so a buffer is written again
    # only after the GEMM of the block it held was queued.
    from dgpo_ops.ops import linear as linear_module
    from dgpo_ops.ops.linear import Precision, TileProjection, TileSchedule

    monkeypatch.setattr(linear_module, "OVERLAP_WEIGHT_CASTS", True)
    log = []
    on_side = TileSchedule.on_side

    def recording(self, launch):
        log.append("cast")
        return on_side(self, launch)

    monkeypatch.setattr(TileSchedule, "on_side", recording)
    weight = torch.randn(600, 48).to(torch.bfloat16)  # the CPU multiplies bf16 in fp32: cast per block
    projection = TileProjection(weight, None, Precision.resolve(weight, None, None), memory_budget=2**16)
    rows = projection.block_rows
    assert rows < 600 and 600 % rows != 0  # several blocks, the last one short
    ranges, buffers = [], []
    for start, stop, block in projection.weight_blocks():
        log.append("gemm")
        ranges.append((start, stop))
        buffers.append(block.data_ptr())
        torch.testing.assert_close(block, weight[start:stop].float(), rtol=0, atol=0)
    assert ranges == [(start, min(start + rows, 600)) for start in range(0, 600, rows)]
    assert log == ["cast"] + ["cast", "gemm"] * (len(ranges) - 1) + ["gemm"]
    assert len(set(buffers)) == 2 and all(a != b for a, b in zip(buffers, buffers[1:]))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("setting", ["bf16", "autocast"])
def test_overlapped_weight_casts_give_the_serial_numbers(monkeypatch, level, setting):
    # The same products of the same blocks, only cast into two buffers one block ahead: bit for bit the serial
    # casts' loss and gradients. The CPU casts per vocabulary block to multiply in fp32: bf16 weights, and fp32
    # weights under bf16 autocast, rounded to bf16 first.
    import contextlib

    from dgpo_ops.ops import linear as linear_module

    dtype = torch.bfloat16 if setting == "bf16" else torch.float32
    (hidden, weight, bias), inputs = linear_case(V=300, seed=5, dtype=dtype)  # three blocks of 128 rows
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if setting == "autocast" else contextlib.nullcontext()
    used = []
    overlapped_casts = linear_module.TileProjection.overlapped_casts
    monkeypatch.setattr(linear_module.TileProjection, "overlapped_casts",
                        lambda self, ranges: used.append(len(ranges)) or overlapped_casts(self, ranges))
    results = {}
    for overlapped in (True, False):
        monkeypatch.setattr(linear_module, "OVERLAP_WEIGHT_CASTS", overlapped)
        leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
        with autocast:
            out = dgpo_ops.fused_linear_dgpo_loss(leaves[0], leaves[1], **inputs, bias=leaves[2], method="grpo",
                                                  importance_sampling_level=level, memory_budget=16 * 8 * 16 * 4)
        results[overlapped] = (out.loss, *torch.autograd.grad(out.loss, leaves))
        assert bool(used) == overlapped and all(blocks == 3 for blocks in used)
        used.clear()
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_weight_cast_per_vocabulary_block_is_not_pipelined(monkeypatch):
    # Twice the chunks would cast every weight block twice as often (autocast over fp32 weights on CUDA; bf16
    # weights multiplied in fp32 on the CPU).
    from dgpo_ops.ops import linear as linear_module
    from dgpo_ops.ops.linear import Precision, TileProjection, pipelined

    monkeypatch.setattr(linear_module, "PIPELINE_TILES", True)

    weight = torch.randn(600, 48).to(torch.bfloat16)
    cast = TileProjection(weight, None, Precision.resolve(weight, None, None), memory_budget=2**16)
    whole = TileProjection(weight.float(), None, Precision.resolve(weight.float(), None, None), memory_budget=2**16)
    assert cast.block_rows < 600 and not pipelined(cast)
    assert pipelined(whole)


def test_a_bias_in_another_dtype_runs_under_autocast_as_the_models_head():
    # F.linear under autocast casts hidden, weight and bias alike: so does the op
    (hidden, weight, bias), inputs = linear_case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, bias=bias.bfloat16()).loss
        want = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, bias=bias).loss
    torch.testing.assert_close(got, want)
