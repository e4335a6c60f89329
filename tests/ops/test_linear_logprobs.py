"""linear_logprob_entropy (per-token log-probs and entropies from hidden states, a backward for both
outputs: verl's fused-kernel contract) against log_softmax and autograd on the materialised logits:
both kernel sets, dtypes, shapes, bias, temperature, autocast, ignored targets, either output alone; the
backward row kernel's per-token entropy coefficient."""

from __future__ import annotations

import pytest
import torch
from helpers import value_error_message

from dgpo_ops.ops.linear_logprobs import linear_logprob_entropy

V = 45


def case(shape=(3, 7), H=16, dtype=torch.float32, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.3 if bias else None
    targets = torch.randint(0, V, shape, generator=g)
    grads = torch.randn(2, *shape, generator=g, dtype=torch.float64)
    return [t if t is None else t.to(dtype) for t in (hidden, weight, b)], targets, grads


def exact(hidden, weight, bias, targets, temperature):
    """log-probs and entropies by log_softmax in fp64, differentiable."""
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    log_probs = (logits / temperature).log_softmax(-1)
    scored = targets != -100
    logp = log_probs.gather(-1, torch.where(scored, targets, 0)[..., None])[..., 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return torch.where(scored, logp, 0.0), torch.where(scored, entropy, 0.0)


def compare(params, targets, grads, backend, tol, temperature=0.7, outputs=(0, 1), **kwargs):
    leaves = [None if t is None else t.clone().requires_grad_(True) for t in params]
    exact_leaves = [None if t is None else t.detach().double().requires_grad_(True) for t in params]
    got = linear_logprob_entropy(leaves[0], leaves[1], targets, bias=leaves[2], temperature=temperature,
                                 backend=backend, memory_budget=3 * V * 4 * 2, **kwargs)  # 3-token tiles
    expected = exact(*exact_leaves, targets, temperature)
    for a, b in zip(got, expected):
        assert a.shape == targets.shape
        torch.testing.assert_close(a.double(), b.detach(), rtol=tol, atol=tol)
    sum(got[i] * grads[i].to(got[i].dtype) for i in outputs).sum().backward()
    sum(expected[i] * grads[i] for i in outputs).sum().backward()
    for leaf, exact_leaf in zip(leaves, exact_leaves):
        if leaf is not None:
            assert leaf.grad.dtype == leaf.dtype
            torch.testing.assert_close(leaf.grad.double(), exact_leaf.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(3, 7), (19,)], ids=["BT", "flat"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("backend", "dtype", "tol"), [("torch", torch.float64, 1e-12), ("torch", torch.float32, 2e-5),
                                                      ("triton", torch.float32, 2e-5)])
def test_equals_log_softmax(backend, dtype, tol, bias, shape):
    params, targets, grads = case(shape, dtype=dtype, bias=bias)
    compare(params, targets, grads, backend, tol)


@pytest.mark.parametrize("outputs", [(0,), (1,)], ids=["logp-only", "entropy-only"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_output_in_the_loss(backend, outputs):
    """A loss of the log-probs only (the entropy's gradient is None) or of the entropies only."""
    params, targets, grads = case()
    compare(params, targets, grads, backend, 2e-5, outputs=outputs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ignored_targets_get_zeros_and_no_gradient(backend):
    params, targets, grads = case()
    targets[0, 2:] = -100
    compare(params, targets, grads, backend, 2e-5)
    hidden = params[0].clone().requires_grad_(True)
    logp, entropy = linear_logprob_entropy(hidden, params[1], targets, backend=backend)
    (logp + entropy).sum().backward()
    assert (logp[0, 2:] == 0).all() and (entropy[0, 2:] == 0).all()
    assert (hidden.grad[0, 2:] == 0).all() and hidden.grad[0, :2].abs().sum() > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_autocast_bf16_rounds_as_the_models_lm_head(backend):
    """Under bf16 autocast over fp32 weights the logits are the bf16 product, as ``lm_head(hidden)`` gives."""
    (hidden, weight, _), targets, _ = case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = linear_logprob_entropy(hidden, weight, targets, backend=backend)
        logits = hidden @ weight.t()
    assert logits.dtype == torch.bfloat16
    log_probs = logits.float().log_softmax(-1)
    torch.testing.assert_close(logp, log_probs.gather(-1, targets[..., None])[..., 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1), rtol=1e-5, atol=1e-5)


def test_gradcheck_fp64():
    params, targets, _ = case((2, 3), H=4, bias=True, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in params]

    def fn(hidden, weight, bias):
        logp, entropy = linear_logprob_entropy(hidden, weight, targets, bias=bias, temperature=0.9,
                                               memory_budget=2 * V * 8)
        return logp, entropy

    assert torch.autograd.gradcheck(fn, leaves)


def test_bad_input_is_named():
    (hidden, weight, _), targets, _ = case()
    assert "target_ids must have shape" in value_error_message(
        lambda: linear_logprob_entropy(hidden, weight, targets[:, :-1]))
    assert "weight must have shape" in value_error_message(lambda: linear_logprob_entropy(hidden, weight.t(), targets))
    assert "temperature" in value_error_message(lambda: linear_logprob_entropy(hidden, weight, targets, temperature=0))
    assert "same dtype" in value_error_message(lambda: linear_logprob_entropy(hidden, weight.bfloat16(), targets))
    bad = targets.clone()
    bad[1, 1] = V
    assert "target_ids must be in [0, 45)" in value_error_message(lambda: linear_logprob_entropy(hidden, weight, bad))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_finite_hidden_of_ignored_tokens_is_ignored(backend):
    """A -100 token's hidden state may hold NaN (a padded position): the others' values and every gradient
    are those of the same call with that row zeroed."""
    (hidden, weight, _), targets, grads = case()
    targets[1, 3:] = -100
    results = []
    for fill in (float("nan"), 0.0):
        h = hidden.clone()
        h[1, 3:] = fill
        leaves = [h.requires_grad_(True), weight.clone().requires_grad_(True)]
        logp, entropy = linear_logprob_entropy(leaves[0], leaves[1], targets, backend=backend)
        results.append((logp, entropy, *torch.autograd.grad((logp * grads[0] + entropy * grads[1]).sum(), leaves)))
    for got, expected in zip(*results):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected)


def test_runs_inside_a_compiled_function():
    """Inside ``torch.compile`` (without fullgraph) it runs eagerly, a graph break, with the eager values and
    gradients."""
    (hidden, weight, _), targets, grads = case()

    def loss(h, w):
        logp, entropy = linear_logprob_entropy(h, w, targets)
        return (logp * grads[0] + entropy * grads[1]).sum()

    results = []
    for fn in (loss, torch.compile(loss, backend="aot_eager")):
        leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        value = fn(*leaves)
        results.append((value.detach(), *torch.autograd.grad(value, leaves)))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected)
