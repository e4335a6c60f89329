"""On a GPU: no host synchronisation (CUDA's own sync debug mode), deferred validation, the fused-linear
op under autocast, and a production-sized vocabulary. Skipped without CUDA (see helpers.requires_cuda)."""

from __future__ import annotations

import pytest
import torch
from helpers import CUDA_MARKS, logits_batch

import dgpo_ops

pytestmark = CUDA_MARKS


def cuda_inputs(B=4, T=64, V=32000, seed=0, dtype=torch.bfloat16, ref_logps=False):
    inputs = logits_batch(B, T, V, seed=seed, dtype=dtype, ref_logps=ref_logps)
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}


@pytest.fixture(autouse=True)
def fresh_checks():
    dgpo_ops.raise_deferred_errors()
    yield
    torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("options", [
    dict(),
    dict(beta=0.05, entropy_coef=0.01, aggregation="seq_mean_token_mean"),
    dict(importance_sampling_level="sequence", aggregation="seq_mean_token_mean"),
], ids=["token", "token_kl_entropy", "sequence"])
def test_logits_op_never_synchronises(options):
    inputs = cuda_inputs(ref_logps="beta" in options)
    logits = inputs.pop("logits").requires_grad_(True)
    inputs["loss_normalizer"] = inputs["mask"].sum().float()  # a device tensor, as TRL passes one
    inputs["mask"] = inputs["mask"].int()

    def step():
        logits.grad = None
        out = dgpo_ops.fused_dgpo_loss(logits, **inputs, **options)
        out.loss.backward()
        return out

    step()  # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call now raises
    out = step()
    metrics = out.metrics.as_tensor()
    torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out.loss) and torch.isfinite(metrics).all() and torch.isfinite(logits.grad).all()
    dgpo_ops.raise_deferred_errors()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_loss_from_logps_never_synchronises_and_equals_the_cpus(level):
    """The verl and SkyRL plugins' route (``policy_loss(logps=..., token_scales=...)``) on the device: no
    synchronisation under CUDA's sync debug mode, and the CPU's loss and gradient."""
    inputs = cuda_inputs(V=1000, dtype=torch.float32)
    target = inputs["target_ids"]
    logps = torch.log_softmax(inputs["logits"], -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    mask = inputs["mask"] & (target != -100)
    options = dgpo_ops.LossOptions.build("dgpo", importance_sampling_level=level)

    def step(device):
        leaf = logps.detach().to(device).requires_grad_(True)
        on = mask.to(device)
        batch = dgpo_ops.LossInputs(None, inputs["advantages"].to(device), on, inputs["old_logps"].to(device))
        out = dgpo_ops.policy_loss(batch, options, logps=leaf, token_scales=on / 100.0)
        out.loss.backward()
        return out.loss, leaf.grad

    expected = step("cpu")
    step("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    loss, grad = step("cuda")
    torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(loss.cpu(), expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.cpu(), expected[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("on_chip", [False, True], ids=["tiles", "on_chip"])
@pytest.mark.parametrize("autocast", [True, False])
def test_linear_op_never_synchronises(autocast, on_chip):
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(4, 64, 256, device="cuda", generator=g, requires_grad=True)
    weight = (torch.randn(32000, 256, device="cuda", generator=g) * 0.05).requires_grad_(True)
    inputs = cuda_inputs(ref_logps=True)
    inputs.pop("logits")

    def step():
        hidden.grad = weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, beta=0.02, logits_on_chip=on_chip)
        out.loss.backward()
        return out

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    out = step()
    torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out.loss) and weight.grad.dtype == torch.float32
    dgpo_ops.raise_deferred_errors()


def serial_then_switched_on(monkeypatch, switch: str, step):
    """``step()`` with the fused linear's ``switch`` (a module flag of ops/linear.py) off, then on: once to warm
    up, then once where any host synchronisation raises."""
    from dgpo_ops.ops import linear as linear_module

    monkeypatch.setattr(linear_module, switch, False)
    serial = step()
    monkeypatch.setattr(linear_module, switch, True)
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    switched = step()
    torch.cuda.set_sync_debug_mode(0)
    return serial, switched


def test_the_pipelined_linear_op_never_synchronises_and_equals_the_serial_one(monkeypatch):
    # Eight chunks over two tile buffers: each tile's row kernels on the side stream beside the previous tile's
    # gradient GEMMs (ops/linear.py, TileSchedule); the same numbers as one buffer on the caller's stream.
    from dgpo_ops.ops import linear as linear_module

    g = torch.Generator(device="cuda").manual_seed(4)
    hidden = torch.randn(4, 64, 256, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(32000, 256, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    inputs = cuda_inputs()
    inputs.pop("logits")

    def step():
        leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight)]
        out = dgpo_ops.fused_linear_dgpo_loss(*leaves, **inputs, memory_budget=32000 * 2 * 64)
        return (out.loss, *torch.autograd.grad(out.loss, leaves))

    serial, pipelined = serial_then_switched_on(monkeypatch, "PIPELINE_TILES", step)
    assert linear_module._SIDE_STREAMS  # the row kernels did run on a side stream
    torch.testing.assert_close(pipelined[0], serial[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(pipelined[1:], serial[1:]):  # the fp32 sums regroup, then round to bf16
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=1e-3 * want.abs().max().item())
    dgpo_ops.raise_deferred_errors()


def test_overlapped_weight_casts_never_synchronise_and_equal_the_serial_ones(monkeypatch):
    # fp32 weights under bf16 autocast, cast per vocabulary block: with OVERLAP_WEIGHT_CASTS the next block's cast
    # runs on the side stream beside this block's GEMM (ops/linear.py, TileProjection.overlapped_casts); the same
    # operands multiplied in the same order, so the same numbers bit for bit.
    from dgpo_ops.ops import linear as linear_module

    g = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(4, 64, 256, device="cuda", generator=g)
    weight = torch.randn(32000, 256, device="cuda", generator=g) * 0.05
    inputs = cuda_inputs()
    inputs.pop("logits")
    budget = 32000 * 2 * 64  # vocab_block_rows: 384 rows a block, 84 blocks

    def step():
        leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = dgpo_ops.fused_linear_dgpo_loss(*leaves, **inputs, memory_budget=budget)
        return (out.loss, *torch.autograd.grad(out.loss, leaves))

    assert linear_module.vocab_block_rows(budget, weight) < 32000
    serial, overlapped = serial_then_switched_on(monkeypatch, "OVERLAP_WEIGHT_CASTS", step)
    assert linear_module._SIDE_STREAMS  # the casts did run on a side stream
    for got, want in zip(overlapped, serial):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    dgpo_ops.raise_deferred_errors()


def test_deferred_errors_on_the_device():
    inputs = cuda_inputs(V=1000)
    inputs["target_ids"][1, 3] = 1000
    out = dgpo_ops.fused_dgpo_loss(**inputs)  # auto: deferred on CUDA, no error yet
    assert torch.isnan(out.loss).item()
    with pytest.raises(ValueError, match=r"target_ids must be in \[0, 1000\) or -100; found 1000"):
        dgpo_ops.raise_deferred_errors()
    inputs = cuda_inputs(V=1000)
    inputs["advantages"][0] = float("nan")
    dgpo_ops.fused_dgpo_loss(**inputs)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="advantages has non-finite values"):
        dgpo_ops.fused_dgpo_loss(**cuda_inputs(V=1000))  # the next call finds the finished bad one


def rounded_like_the_model(logits, dtype):
    return logits + (logits.to(dtype).double() - logits).detach()


@pytest.mark.parametrize("on_chip", [False, True], ids=["tiles", "on_chip"])
@pytest.mark.parametrize("setting", ["autocast_fp32_params", "bf16_params", "fp32"])
@pytest.mark.parametrize("method", ["dgpo", "grpo", "sapo"])
def test_linear_op_matches_the_models_logits(setting, method, on_chip):
    # Both paths score the model's own logits: under bf16 products the fp32 accumulator is rounded once to
    # bf16, in the logits tile (tiles) or in registers (on_chip), as the model's lm_head hands them over.
    g = torch.Generator().manual_seed(2)
    B, T, H, V = 2, 16, 64, 3000
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.2
    inputs = logits_batch(B, T, V, seed=3, logits=hidden @ weight.T, ref_logps=True)
    inputs.pop("logits")
    params_dtype = torch.bfloat16 if setting == "bf16_params" else torch.float32
    low = setting != "fp32"
    operands = [t.to(torch.bfloat16 if low else torch.float32) for t in (hidden, weight)]
    ref_leaves = [t.double().requires_grad_(True) for t in operands]
    ref_logits = ref_leaves[0] @ ref_leaves[1].T
    if low:
        ref_logits = rounded_like_the_model(ref_logits, torch.bfloat16)
    ref = dgpo_ops.reference_loss(ref_logits, **inputs, method=method, beta=0.02)
    ref_grads = torch.autograd.grad(ref.loss, ref_leaves)
    leaves = [t.to(params_dtype).cuda().requires_grad_(True) for t in (hidden, weight)]
    cuda = {k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=setting == "autocast_fp32_params"):
        out = dgpo_ops.fused_linear_dgpo_loss(*leaves, **cuda, method=method, beta=0.02, memory_budget=V * 2 * 8,
                                              logits_on_chip=on_chip)
    grads = torch.autograd.grad(out.loss, leaves)
    torch.testing.assert_close(out.loss.double().cpu(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
    for got, want, leaf in zip(grads, ref_grads, leaves):
        assert got.dtype == leaf.dtype
        tolerance = dict(rtol=2.0**-6, atol=2e-3 * want.abs().max().item()) if low else dict(rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got.double().cpu(), want, **tolerance)


def test_production_vocabulary_bf16():
    inputs = logits_batch(2, 32, 151936, seed=4, dtype=torch.bfloat16)
    logits = inputs.pop("logits")
    ref_logits = logits.double().requires_grad_(True)
    ref = dgpo_ops.reference_loss(ref_logits, **inputs, entropy_coef=0.01)
    ref.loss.backward()
    leaf = logits.cuda().requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(leaf, **{k: v.cuda() for k, v in inputs.items()}, entropy_coef=0.01)
    out.loss.backward()
    torch.testing.assert_close(out.loss.double().cpu(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
    relative = (leaf.grad.double().cpu() - ref_logits.grad).norm() / ref_logits.grad.norm()
    assert relative < 4e-3  # bf16 rounding of the stored gradient (2^-9 relative per element)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scale_cast_rounds_as_torch_does(dtype):
    # the compiled kernel rounds to nearest even (cvt.rn), as the torch.mul into a low-precision output it replaces
    from dgpo_ops.kernels.scale_cast import scale_cast

    accumulator = torch.randn(1000, 77, device="cuda") * 5
    scale = torch.tensor([0.37], device="cuda")
    out = torch.empty(accumulator.shape, dtype=dtype, device="cuda")
    scale_cast(accumulator, scale, out)
    assert torch.equal(out, torch.mul(accumulator, scale, out=torch.empty_like(out)))
