"""fused_dgpo_loss against reference_loss: every method under an aggregation, a method of every route under every
aggregation and dtype, with and without old/ref log-probs, entropy bonus and entropy weights, temperature, rollout
weights and GSPO, on both backends."""

from __future__ import annotations

import pytest
import torch
from helpers import METHOD_VARIANTS, ROUTE_VARIANTS, for_method, logits_batch, requires_cuda, variant_id

import dgpo_ops

AGGREGATIONS = list(dgpo_ops.AGGREGATIONS)

# Option bundles: each case of the grid runs all of them.
FEATURE_BUNDLES = {
    "on_policy": dict(old_logps=None),
    "kl_entropy_nll": dict(beta=0.05, entropy_coef=0.01, positive_nll_coef=0.1),
    "kl_entropy": dict(beta=0.05, entropy_coef=0.01, entropy_weights=True),  # a second entropy term, weighted
    "temperature_weights": dict(temperature=0.7, rollout_weights=True, ref_logps=None),
    "kl_times_ratio": dict(beta=0.1, kl_ratio_correction=True),
    "gspo_entropy": dict(importance_sampling_level="sequence", entropy_coef=0.02, beta=0.02),
}

# Low precision: the kernels accumulate in fp32 and round only the stored gradient, so the loss and
# per-token outputs keep fp32 accuracy against an fp32 reference on the same (exactly upcast)
# logits, and the gradient is off by its final rounding alone. bf16 keeps 8 significant bits:
# one ulp is at most 2^-7 relative. Round-to-nearest (the GPU's cvt.rn, and torch) stays within
# half of it, but the Triton interpreter truncates fp32 -> bf16, so a full ulp is allowed.
# fp16 (11 bits, rounded to nearest everywhere) stays within 2^-11.
TOLERANCES = {
    torch.float32: dict(loss=1e-5, grad_rtol=1e-5, grad_atol=1e-7),
    torch.bfloat16: dict(loss=1e-5, grad_rtol=2.0**-7, grad_atol=1e-7),
    torch.float16: dict(loss=1e-5, grad_rtol=2.0**-11, grad_atol=1e-7),
}


def run_case(variant, aggregation, dtype, bundle, backend, seed=0, B=3, T=6, V=300, device="cpu"):
    name, params = variant
    options = for_method(name, dict(FEATURE_BUNDLES[bundle]), responses=B)
    inputs = logits_batch(B, T, V, seed=seed, dtype=dtype, ref_logps=bool(options.get("beta")))
    if options.pop("rollout_weights", False):
        inputs["rollout_weights"] = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) + 0.5
    if options.pop("entropy_weights", False):
        inputs["entropy_weights"] = torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 1)) * 0.1
    for key in ("old_logps", "ref_logps"):
        if key in options:
            inputs[key] = options.pop(key)
    logits = inputs.pop("logits")
    # The reference runs in fp64: the fused fp32 result must be within fp32 accuracy of the truth.
    ref_logits = logits.detach().double().clone().requires_grad_(True)
    fused_logits = logits.clone().requires_grad_(True)
    common = dict(method=name, aggregation=aggregation, **params, **options)
    ref = dgpo_ops.reference_loss(ref_logits, **inputs, **common)
    if device != "cpu":
        # every tensor travels, the method's own ones (dgpo's scores) among them
        fused_logits = fused_logits.detach().to(device).requires_grad_(True)
        inputs, common = ({k: v.to(device) if torch.is_tensor(v) else v for k, v in d.items()} for d in (inputs, common))
    out = dgpo_ops.fused_dgpo_loss(fused_logits, **inputs, **common, backend=backend)
    ref.loss.backward()
    out.loss.backward()
    if device != "cpu":
        out = dgpo_ops.PolicyLossOutput(out.loss.cpu(), out.logps.cpu(), out.entropy.cpu(),
                                        {k: v.cpu() for k, v in out.metrics.items()})
    return ref, out, ref_logits.grad, fused_logits.grad.cpu()


def assert_parity(ref, out, ref_grad, grad, dtype, aggregation="token_mean"):
    tol = TOLERANCES[dtype]
    # The loss is a signed sum of O(1) per-token terms: fp32 summation order alone moves it by ~1e-7,
    # which is a large relative error when the terms cancel, hence the absolute floor. token_sum does not
    # normalise the sum, so each token's rounding (up to ~3e-7 with a KL term) stays whole: 1e-6 per token.
    loss_atol = 1e-6 * (out.logps.numel() if aggregation == "token_sum" else 1)
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=tol["loss"], atol=loss_atol)
    torch.testing.assert_close(out.logps, ref.logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref.entropy, rtol=1e-5, atol=1e-5)
    assert grad.dtype == dtype and out.logps.dtype == torch.float32
    # Against the fp64 truth, an fp32 run is limited by its log-probs' own rounding (ulp(-5) ~ 5e-7),
    # which the per-token coefficient can amplify (ratios up to e^3, a policy and a KL term of
    # opposite sign). So besides rtol, an element may be off by 1e-6 of the gradient's largest entry.
    atol = max(tol["grad_atol"], 1e-6 * ref_grad.abs().max().item())
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol["grad_rtol"], atol=atol)
    assert ref.metrics.keys() == out.metrics.keys()
    for key in ref.metrics:
        torch.testing.assert_close(out.metrics[key].double(), ref.metrics[key].double(), rtol=1e-5, atol=1e-6,
                                   msg=key)


DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def parity_cases(dtypes) -> list:
    """(variant, aggregation, dtype) of the parity grid. Every method variant runs every option bundle in fp32, under
    one aggregation (the aggregations in turn, each with several methods): the per-method math. An aggregation only
    weighs the tokens' terms once a route has evaluated them (the token-local epilogue, a sequence statistic, a
    token selection, the scores), so each route's representative (helpers.ROUTE_VARIANTS) runs every aggregation.
    Low precision differs from fp32 only where the kernels (and their twins) load the logits and store the gradient,
    both computed in fp32 in between: the representatives run it, again with the aggregations in turn. On the
    Triton kernels a case runs the bundles that reach what it varies (``TRITON_BUNDLES`` says which)."""
    def turn(index):
        return AGGREGATIONS[index % len(AGGREGATIONS)]

    cases = [(variant, turn(index), torch.float32) for index, variant in enumerate(METHOD_VARIANTS)]
    cases += [(variant, aggregation, torch.float32) for variant in ROUTE_VARIANTS for aggregation in AGGREGATIONS]
    cases += [(variant, turn(index), dtype) for dtype in dtypes if dtype != torch.float32
              for index, variant in enumerate(ROUTE_VARIANTS)]
    unique = {(variant_id(variant), aggregation, dtype): (variant, aggregation, dtype)
              for variant, aggregation, dtype in cases}
    return [pytest.param(*case, id=f"{key[0]}-{key[1]}-{DTYPE_IDS[key[2]]}") for key, case in unique.items()]


PARITY_CASES = parity_cases([torch.float32, torch.bfloat16])


# What the Triton kernels (in the interpreter, the costliest part of the grid) run of each case: every bundle
# in a route's representative's own case (its turn's aggregation, fp32), and in the others the bundles that
# reach what the case varies:
# * another method: the kernels see a method only in the epilogue's branch for it (its MethodId and
#   parameters, compared with the table row by row in tests/kernels/test_method_mirror.py), which returns the
#   same terms whatever the bundle; two bundles evaluate the branch at ratios other than 1, with a KL and an
#   entropy term, a temperature and rollout weights;
# * a representative under another aggregation: the bundles whose terms an aggregation weighs otherwise (the
#   positive-example normaliser, the entropy term, rollout weights, the sequence level); the other two (ratio
#   1, the KL times the ratio) change per-token terms alone;
# * low precision, which changes only the logits' load and the gradient's store: two bundles, token- and
#   sequence-level.
TRITON_BUNDLES = {"method": ("kl_entropy", "temperature_weights"),
                  "aggregation": ("kl_entropy_nll", "kl_entropy", "temperature_weights", "gspo_entropy"),
                  "precision": ("kl_entropy", "gspo_entropy")}


def bundles(backend, variant, aggregation, dtype) -> list[tuple[int, str]]:
    """(seed, bundle) of a case: every bundle on the torch twins; on the Triton kernels, TRITON_BUNDLES'."""
    every = list(enumerate(FEATURE_BUNDLES))
    if backend != "triton":
        return every
    if variant not in ROUTE_VARIANTS:
        kept = TRITON_BUNDLES["method"]
    elif dtype != torch.float32:
        kept = TRITON_BUNDLES["precision"]
    elif aggregation != AGGREGATIONS[METHOD_VARIANTS.index(variant) % len(AGGREGATIONS)]:
        kept = TRITON_BUNDLES["aggregation"]
    else:
        return every
    return [(seed, bundle) for seed, bundle in every if bundle in kept]


@pytest.mark.parametrize("variant, aggregation, dtype", PARITY_CASES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fused_matches_reference(backend, variant, aggregation, dtype):
    for seed, bundle in bundles(backend, variant, aggregation, dtype):
        ref, out, ref_grad, grad = run_case(variant, aggregation, dtype, bundle, backend, seed=seed)
        assert_parity(ref, out, ref_grad, grad, dtype, aggregation)


@pytest.mark.parametrize("variant, aggregation, dtype", parity_cases([torch.float32, torch.bfloat16, torch.float16]))
@requires_cuda
def test_fused_matches_reference_on_cuda(variant, aggregation, dtype):
    # The Triton kernels compiled for the GPU (not the interpreter), bf16 rounded to nearest there; the grid of
    # the CPU's, with fp16 besides.
    for index, bundle in enumerate(FEATURE_BUNDLES):
        ref, out, ref_grad, grad = run_case(variant, aggregation, dtype, bundle, "triton", seed=index, device="cuda")
        assert_parity(ref, out, ref_grad, grad, dtype, aggregation)


@pytest.mark.parametrize("layout", ["sliced_time", "vocab_strided", "flat", "inplace"])
@requires_cuda
def test_layouts_on_cuda(layout):
    inputs = logits_batch(2, 6, 5000, seed=31, ref_logps=True)
    logits = inputs.pop("logits")
    ref_logits = logits.double().requires_grad_(True)
    cuda = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}
    ref = dgpo_ops.reference_loss(ref_logits, **inputs, beta=0.03, entropy_coef=0.01)
    ref.loss.backward()
    if layout == "sliced_time":
        base = torch.cat([logits, torch.randn(2, 1, 5000)], dim=1).cuda().requires_grad_(True)
        out = dgpo_ops.fused_dgpo_loss(base[:, :-1], **cuda, beta=0.03, entropy_coef=0.01)
        out.loss.backward()
        grad = base.grad[:, :-1]
    elif layout == "vocab_strided":
        leaf = logits.cuda().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
        out = dgpo_ops.fused_dgpo_loss(leaf, **cuda, beta=0.03, entropy_coef=0.01)
        out.loss.backward()
        grad = leaf.grad
    elif layout == "flat":
        leaf = logits.cuda().reshape(12, 5000).requires_grad_(True)
        flat = {k: v.reshape(12) if torch.is_tensor(v) and v.dim() == 2 else v for k, v in cuda.items()}
        flat["advantages"] = cuda["advantages"][:, None].expand(2, 6).reshape(12)
        out = dgpo_ops.fused_dgpo_loss(leaf, **flat, beta=0.03, entropy_coef=0.01)
        out.loss.backward()
        grad = leaf.grad.reshape(2, 6, 5000)
    else:
        leaf = logits.cuda().requires_grad_(True)
        produced = leaf * 1.0
        out = dgpo_ops.fused_dgpo_loss(produced, **cuda, beta=0.03, entropy_coef=0.01, inplace=True)
        (grad,) = torch.autograd.grad(out.loss, produced)
    torch.testing.assert_close(out.loss.double().cpu(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double().cpu(), ref_logits.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp16_logits(backend):
    ref, out, ref_grad, grad = run_case(("dgpo", {}), "token_mean", torch.float16, "kl_entropy_nll", backend)
    assert_parity(ref, out, ref_grad, grad, torch.float16)


def test_parity_inputs_reach_every_region():
    inputs = logits_batch(3, 6, 300, seed=0)
    out = dgpo_ops.reference_loss(**inputs, method="grpo", dual_clip=3.0)
    for name in ("ln_fraction", "hp_fraction", "lp_fraction", "hn_fraction", "dual_clip_fraction"):
        assert out.metrics[name] > 0, name


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_per_token_advantages_and_flat_logits(backend):
    inputs = logits_batch(2, 5, 130, seed=3, per_token_adv=True)
    flat = {k: v.reshape(10, *v.shape[2:]) for k, v in inputs.items()}
    ref = dgpo_ops.reference_loss(**flat, method="dispo")
    logits = flat.pop("logits").requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(logits, **flat, method="dispo", backend=backend)
    out.loss.backward()
    assert out.logps.shape == (10,) and logits.grad.shape == (10, 130)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("layout", ["sliced_time", "vocab_strided"])
def test_strided_logits_need_no_copy(backend, layout):
    B, T, V = 2, 5, 70
    inputs = logits_batch(B, T, V, seed=4)
    logits = inputs.pop("logits")
    if layout == "sliced_time":  # logits[:, :-1] as TRL slices them
        base = torch.cat([logits, torch.randn(B, 1, V)], dim=1)
        strided = base[:, :-1]
    else:  # vocabulary not the innermost axis
        strided = logits.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    ref = dgpo_ops.reference_loss(logits, **inputs)
    leaf = strided.detach().requires_grad_(True) if layout == "vocab_strided" else None
    source = leaf if leaf is not None else strided
    if leaf is None:
        base.requires_grad_(True)
        source = base[:, :-1]
    out = dgpo_ops.fused_dgpo_loss(source, **inputs, backend=backend)
    out.loss.backward()
    grad = leaf.grad if leaf is not None else base.grad[:, :-1]
    ref_logits = logits.clone().requires_grad_(True)
    dgpo_ops.reference_loss(ref_logits, **inputs).loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, ref_logits.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_inplace_writes_the_gradient_into_the_logits(backend):
    inputs = logits_batch(2, 4, 90, seed=5)
    logits = inputs.pop("logits")
    expected = logits.clone().requires_grad_(True)
    dgpo_ops.fused_dgpo_loss(expected, **inputs, backend=backend).loss.backward()

    leaf = logits.clone().requires_grad_(True)
    produced = leaf * 1.0  # what a model hands over: a non-leaf the caller will not read again
    out = dgpo_ops.fused_dgpo_loss(produced, **inputs, backend=backend, inplace=True)
    (grad,) = torch.autograd.grad(out.loss, produced)
    torch.testing.assert_close(grad, expected.grad)
    torch.testing.assert_close(produced.detach(), expected.grad)  # the logits' storage now holds it


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_masked_tokens_get_zero_gradient_and_zero_outputs(backend):
    inputs = logits_batch(2, 6, 40, seed=6, mask_fraction=0.5)
    logits = inputs.pop("logits").requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(logits, **inputs, backend=backend, entropy_coef=0.1)
    out.loss.backward()
    masked = ~inputs["mask"] | (inputs["target_ids"] == -100)
    assert masked.any()
    assert logits.grad[masked].abs().max() == 0
    assert out.logps[masked].abs().max() == 0 and out.entropy[masked].abs().max() == 0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_minus_inf_logits_off_target_are_exact(backend):
    inputs = logits_batch(2, 3, 50, seed=7)
    logits = inputs.pop("logits")
    banned = torch.zeros(50, dtype=torch.bool)
    banned[10:40] = True  # a whole tile of -inf with a small block
    inputs["target_ids"] = torch.where(inputs["target_ids"] == -100, -100, inputs["target_ids"] % 10)
    logits[..., banned] = float("-inf")
    fused_logits = logits.clone().requires_grad_(True)
    ref_logits = logits.clone().requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(fused_logits, **inputs, backend=backend, entropy_coef=0.1)
    ref = dgpo_ops.reference_loss(ref_logits, **inputs, entropy_coef=0.1)
    out.loss.backward()
    ref.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(fused_logits.grad).all()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fused_logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_give_non_finite_loss(backend, bad):
    inputs = logits_batch(2, 3, 20, seed=8)
    inputs["logits"][0, 0, 3] = bad
    out = dgpo_ops.fused_dgpo_loss(**inputs, backend=backend)
    assert not torch.isfinite(out.loss)


def test_fused_validates_like_the_reference():
    inputs = logits_batch(2, 3, 20, seed=9)
    inputs["target_ids"][0, 0] = 20
    with pytest.raises(ValueError, match="target_ids"):
        dgpo_ops.fused_dgpo_loss(**inputs)
    with pytest.raises(ValueError, match="backend"):
        dgpo_ops.fused_dgpo_loss(**logits_batch(2, 3, 20), backend="cuda")
    with pytest.raises(ValueError, match="float64"):
        dgpo_ops.fused_dgpo_loss(**logits_batch(2, 3, 20, dtype=torch.float64), backend="triton")


def test_dgpo_loss_module_holds_its_options():
    inputs = logits_batch(2, 4, 30, seed=10)
    module = dgpo_ops.DGPOLoss("dgpo", n=2.0, m=3.0, aggregation="seq_mean_token_mean")
    expected = dgpo_ops.reference_loss(**inputs, method="dgpo", n=2.0, m=3.0, aggregation="seq_mean_token_mean")
    torch.testing.assert_close(module(**inputs).loss, expected.loss, rtol=1e-5, atol=1e-7)
    assert "n=2.0" in repr(module)
    weights = torch.rand(2, 4, generator=torch.Generator().manual_seed(10))  # per call, as the other tensors
    expected = dgpo_ops.reference_loss(**inputs, method="dgpo", n=2.0, m=3.0, aggregation="seq_mean_token_mean",
                                       entropy_weights=weights)
    torch.testing.assert_close(module(**inputs, entropy_weights=weights).loss, expected.loss, rtol=1e-5, atol=1e-7)


# gradcheck compares the analytic gradient with finite differences of the loss VALUE. The
# stop-gradient surrogates (cispo's sg(w) l, gppo's r/sg(r), dgpo's boundary forms, aspo's flipped
# ratio) have by design a gradient that is not the derivative of their value, so they are checked
# where the two agree: sapo everywhere, the clip methods with every token inside the trust region;
# KL, entropy, temperature and GSPO's mean ride along. The clipped regions are covered by the
# psi-vs-autograd table tests and the parity tests against the reference.
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(method="dgpo", eps_low=1.0, eps_high=50.0, beta=0.1, ref=True),
        dict(method="grpo", eps_low=1.0, eps_high=50.0, importance_sampling_level="sequence"),
        dict(method="sapo", gate="erf", entropy_coef=0.1, beta=0.1, ref=True),
        dict(method="sapo", gate="softsign", temperature=0.8, entropy_coef=0.05),
        dict(method="sapo", gate="arctan", importance_sampling_level="sequence", entropy_coef=0.05),
    ],
)
def test_torch_path_gradcheck_fp64(kwargs):
    kwargs = dict(kwargs)
    inputs = logits_batch(2, 4, 7, seed=11, dtype=torch.float64, ref_logps=True)
    if not kwargs.pop("ref", False):
        inputs["ref_logps"] = None
    logits = inputs.pop("logits").requires_grad_(True)
    aggregation = "seq_mean_token_mean" if kwargs.get("importance_sampling_level") else "token_mean"

    def loss(x):
        return dgpo_ops.fused_dgpo_loss(x, **inputs, backend="torch", aggregation=aggregation, **kwargs).loss

    assert torch.autograd.gradcheck(loss, (logits,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_non_contiguous_per_token_inputs(backend):
    inputs = logits_batch(3, 5, 40, seed=12, per_token_adv=True)
    for key in ("target_ids", "advantages", "old_logps", "mask"):
        inputs[key] = inputs[key].t().contiguous().t()  # same values, transposed strides
        assert not inputs[key].is_contiguous()
    ref = dgpo_ops.reference_loss(**inputs)
    out = dgpo_ops.fused_dgpo_loss(**inputs, backend=backend)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logps, ref.logps, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_masked_rows_with_extreme_logits_get_zero_gradient(backend):
    inputs = logits_batch(2, 4, 30, seed=13, mask_fraction=0.5)
    masked = ~inputs["mask"] | (inputs["target_ids"] == -100)
    inputs["logits"][masked] = 100.0
    b, t = masked.nonzero()[0].tolist()
    inputs["logits"][b, t, 3] = float("nan")
    logits = inputs.pop("logits").requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(logits, **inputs, backend=backend, temperature=0.1)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logits.grad).all()
    assert logits.grad[masked].abs().max() == 0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_inplace_rejects_a_leaf_and_invalidates_other_users_of_the_logits(backend):
    inputs = logits_batch(2, 3, 20, seed=14)
    logits = inputs.pop("logits").requires_grad_(True)
    with pytest.raises(ValueError, match="inplace"):
        dgpo_ops.fused_dgpo_loss(logits, **inputs, backend=backend, inplace=True)
    produced = logits * 1.0
    z_loss = produced.logsumexp(-1).pow(2).mean()  # saves `produced` for its own backward
    out = dgpo_ops.fused_dgpo_loss(produced, **inputs, backend=backend, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.loss + z_loss).backward()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_double_backward_is_refused_where_it_is_asked_for(backend):
    # create_graph=True used to hand back a silently detached gradient; a gradient penalty built on
    # it was then quietly wrong. The request itself now fails, naming the way out.
    inputs = logits_batch(2, 3, 20, seed=15)
    logits = inputs.pop("logits").requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(logits, **inputs, backend=backend)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(out.loss, logits, create_graph=True)
    (grad,) = torch.autograd.grad(dgpo_ops.fused_dgpo_loss(logits, **inputs, backend=backend).loss, logits)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_inplace_refuses_a_view_of_a_leaf(backend):
    inputs = logits_batch(2, 3, 20, seed=17)
    leaf = inputs.pop("logits").requires_grad_(True)
    kept = leaf.detach().clone()
    with pytest.raises(ValueError, match="a view of a leaf"):
        dgpo_ops.fused_dgpo_loss(leaf[:, :], **inputs, backend=backend, inplace=True)
    assert torch.equal(leaf.detach(), kept)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_inplace_refuses_logits_whose_elements_share_memory(backend):
    inputs = logits_batch(2, 3, 20, seed=18)
    row = inputs.pop("logits")[:1, :1].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="share memory"):
        dgpo_ops.fused_dgpo_loss((row * 1.0).expand(2, 3, 20), **inputs, backend=backend, inplace=True)
    # Sliced and permuted views of the model's logits do not overlap and are taken.
    leaf = logits_batch(2, 3, 20, seed=18)["logits"].requires_grad_(True)
    reference = dgpo_ops.fused_dgpo_loss(leaf, **inputs, backend=backend)
    (expected,) = torch.autograd.grad(reference.loss, leaf)
    for make in (lambda x: torch.cat([x, x[:, :1]], dim=1)[:, :-1],
                 lambda x: x.transpose(0, 1).contiguous().transpose(0, 1)):
        out = dgpo_ops.fused_dgpo_loss(make(leaf * 1.0), **inputs, backend=backend, inplace=True)
        (grad,) = torch.autograd.grad(out.loss, leaf)
        torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_forward_only_under_no_grad(backend, mode, level):
    inputs = logits_batch(2, 4, 30, seed=16)
    kwargs = dict(importance_sampling_level=level, aggregation="seq_mean_token_mean")
    ref = dgpo_ops.reference_loss(**inputs, **kwargs)
    with mode():
        out = dgpo_ops.fused_dgpo_loss(**inputs, backend=backend, **kwargs)
    torch.testing.assert_close(out.loss, ref.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.metrics["ratio_mean"], ref.metrics["ratio_mean"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_entropy_of_peaked_rows_with_large_logits(backend):
    # One dominant logit far above the rest, shifted by a large constant: H ~ 1e-5 must keep its digits.
    logits = torch.full((1, 2, 300), -12.0)
    logits[..., 7] = 0.0
    logits = logits + torch.tensor([50.0, 500.0])[None, :, None]
    target = torch.full((1, 2), 7)
    exact = torch.distributions.Categorical(logits=logits.double()).entropy().float()
    out = dgpo_ops.fused_dgpo_loss(logits, target, torch.ones(1), backend=backend)
    torch.testing.assert_close(out.entropy, exact, rtol=1e-3, atol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_nan_logit_gives_nan_loss_for_every_method(backend):
    for name, params in METHOD_VARIANTS:
        inputs = logits_batch(3, 3, 20, seed=17)
        inputs["logits"][1, 0, 5] = float("nan")
        out = dgpo_ops.fused_dgpo_loss(**inputs, method=name, **params, backend=backend)
        assert torch.isnan(out.loss), name


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_target_far_below_the_max_keeps_its_gradient(backend):
    # log p of the target below -104: exp(log p) underflows to 0 in fp32 and 1 - p must be 1 there
    # (the kernel's expm1 formula once gave 0/0 -> 0, dropping the target's gradient silently).
    inputs = logits_batch(2, 3, 64, seed=40)
    inputs["target_ids"][:, 1] = 5
    logits = inputs.pop("logits")
    logits[:, 1, 5] = logits[:, 1].max(dim=-1).values - 130.0
    inputs["old_logps"] = None
    inputs["advantages"] = torch.tensor([1.0, -0.7])
    fused, ref = logits.clone().requires_grad_(True), logits.double().requires_grad_(True)
    dgpo_ops.fused_dgpo_loss(fused, **inputs, method="grpo", backend=backend).loss.backward()
    dgpo_ops.reference_loss(ref, **inputs, method="grpo").loss.backward()
    assert ref.grad[:, 1, 5].abs().min() > 0.05
    torch.testing.assert_close(fused.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("output", ["logps", "entropy"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_editing_the_per_token_outputs_in_place_fails_loudly(backend, output):
    # out.logps and out.entropy are views of what backward reads: an in-place edit must not change
    # the gradient silently.
    inputs = logits_batch(2, 3, 20, seed=41)
    logits = inputs.pop("logits").requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(logits, **inputs, backend=backend, entropy_coef=0.1)
    getattr(out, output).zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()
