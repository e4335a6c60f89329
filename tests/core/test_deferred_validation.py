"""Deferred validation (the CUDA default: checking values on the host would synchronise every call): bad
values are found by the prologue kernel on the device, the loss and gradient become NaN at once, and the
ValueError naming the argument (the same message as immediate validation gives) comes from a later call or
``raise_deferred_errors()``."""

from __future__ import annotations

import pytest
import torch
from helpers import logits_batch

import dgpo_ops
from dgpo_ops.core.inputs import TOKEN_FLOATS
from dgpo_ops.core.validation import pending_deferred_checks

BACKENDS = ["triton", "torch"]
pytestmark = pytest.mark.usefixtures("no_pending_checks")


def bad_inputs(kind: str, ref_logps: bool = False) -> dict:
    """``ref_logps``: with reference log-probs, for a call with beta > 0."""
    inputs = logits_batch(2, 5, 30, seed=21, per_token_adv=kind == "per_token_advantages",
                          ref_logps=ref_logps)
    inputs["rollout_weights"] = torch.rand(2, 5) + 0.5
    if kind == "target_ids":
        inputs["target_ids"][1, 2] = 30
    elif kind == "negative_target_ids":
        inputs["target_ids"][0, 3] = -7
    elif kind == "mask":
        inputs["mask"] = inputs["mask"].to(torch.int64)
        inputs["mask"][0, 1] = 2
    elif kind in ("advantages", "per_token_advantages"):
        inputs["advantages"].view(-1)[-1] = float("nan")
    elif kind == "old_logps":
        inputs["old_logps"][0, 0] = float("inf")
    elif kind == "ref_logps":
        inputs["ref_logps"][1, 0] = float("-inf")
    elif kind == "rollout_weights":
        inputs["rollout_weights"][0, 0] = float("nan")
    elif kind == "negative_rollout_weights":  # a log-ratio where the ratio belongs
        inputs["rollout_weights"][1, 4] = -0.25
    elif kind == "loss_normalizer":
        inputs["loss_normalizer"] = torch.tensor(0.0)
    elif kind in TOKEN_FLOATS:  # any other per-token float (each response's score): found by its mark alone
        inputs[kind] = torch.rand(2, 5) + 0.5
        inputs[kind][1, 3] = float("nan")
    else:
        raise AssertionError(kind)
    inputs["mask"] = inputs["mask"] if kind == "mask" else torch.ones(2, 5, dtype=torch.bool)  # every token scored
    return inputs


KINDS = ["target_ids", "negative_target_ids", "mask", "advantages", "per_token_advantages", "old_logps", "ref_logps",
         "rollout_weights", "negative_rollout_weights", "loss_normalizer"]
KINDS += [name for name in TOKEN_FLOATS if name not in KINDS]
ARGUMENT = {"negative_target_ids": "target_ids", "per_token_advantages": "advantages",
            "negative_rollout_weights": "rollout_weights"}


def immediate_message(inputs) -> str:
    with pytest.raises(ValueError) as caught:
        dgpo_ops.fused_dgpo_loss(**inputs, beta=0.1, validation="immediate")
    return str(caught.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_value_gives_nan_now_and_the_named_error_later(backend, kind):
    inputs = bad_inputs(kind, ref_logps=True)
    expected = immediate_message(inputs)
    assert ARGUMENT.get(kind, kind) in expected
    logits = inputs.pop("logits").requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(logits, **inputs, beta=0.1, backend=backend, validation="deferred")
    assert torch.isnan(out.loss)
    out.loss.backward()  # the gradient is poisoned too, never quietly wrong
    scored = inputs["mask"].bool() & (inputs["target_ids"] >= 0) & (inputs["target_ids"] < 30)
    assert torch.isnan(logits.grad[scored]).all()
    assert pending_deferred_checks() == 1
    with pytest.raises(ValueError) as caught:
        dgpo_ops.raise_deferred_errors()
    assert str(caught.value).startswith(expected), (str(caught.value), expected)
    assert "earlier fused_dgpo_loss call" in str(caught.value)
    assert pending_deferred_checks() == 0


@pytest.mark.parametrize("next_validation", ["deferred", "immediate"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_next_call_raises_an_earlier_calls_error(backend, next_validation):
    # whatever the next call's own validation: a call that checks its values now still reads the queue
    inputs = bad_inputs("target_ids")
    dgpo_ops.fused_dgpo_loss(**inputs, backend=backend, validation="deferred")
    clean = logits_batch(2, 5, 30, seed=22)
    with pytest.raises(ValueError, match="target_ids must be in \\[0, 30\\) or -100; found 30"):
        dgpo_ops.fused_dgpo_loss(**clean, backend=backend, validation=next_validation)
    out = dgpo_ops.fused_dgpo_loss(**clean, backend=backend, validation="deferred")  # raised once, then clean
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_inputs_give_the_immediate_result(backend):
    inputs = logits_batch(3, 6, 40, seed=23, ref_logps=True)
    inputs["loss_normalizer"] = torch.tensor(7.0)
    immediate = dgpo_ops.fused_dgpo_loss(**inputs, backend=backend, validation="immediate", beta=0.1)
    deferred = dgpo_ops.fused_dgpo_loss(**inputs, backend=backend, validation="deferred", beta=0.1)
    dgpo_ops.raise_deferred_errors()
    assert torch.equal(immediate.loss, deferred.loss)
    for name in immediate.metrics:
        assert torch.equal(immediate.metrics[name], deferred.metrics[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_defers_too(backend):
    inputs = bad_inputs("target_ids")
    inputs.pop("logits")
    g = torch.Generator().manual_seed(24)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(30, 8, generator=g, requires_grad=True)
    out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, backend=backend, validation="deferred")
    assert torch.isnan(out.loss)
    out.loss.backward()
    assert torch.isnan(weight.grad).any()
    with pytest.raises(ValueError, match="target_ids .* found 30 \\(found on the device in an earlier fused_linear"):
        dgpo_ops.raise_deferred_errors()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("function", ["fused_linear_logprobs", "linear_logprob_entropy"])
def test_forward_only_log_probs_of_bad_input_are_nan_and_the_error_names_the_function(function, backend):
    """A target outside the vocabulary: fused_linear_logprobs gave that token log-prob 0 and entropy 0 (probability
    1) and its error named fused_linear_dgpo_loss, the op it runs; both functions give NaN and name themselves."""
    inputs = bad_inputs("target_ids")
    g = torch.Generator().manual_seed(29)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(30, 8, generator=g)
    logp, entropy = getattr(dgpo_ops, function)(hidden, weight, inputs["target_ids"], backend=backend,
                                                validation="deferred")
    assert logp.isnan().all() and entropy.isnan().all(), (logp, entropy)
    with pytest.raises(ValueError, match=f"found 30 \\(found on the device in an earlier {function} call\\)"):
        dgpo_ops.raise_deferred_errors()


def test_validation_mode_is_checked():
    with pytest.raises(ValueError, match="validation"):
        dgpo_ops.fused_dgpo_loss(**logits_batch(2, 3, 20), validation="later")


def test_auto_is_immediate_on_the_cpu():
    inputs = bad_inputs("advantages")
    with pytest.raises(ValueError, match="advantages has non-finite values on unmasked tokens$"):
        dgpo_ops.fused_dgpo_loss(**inputs)


@pytest.mark.parametrize("normalizer, match", [
    (True, "loss_normalizer must be a number or a one-element tensor, got True"),
    ("tokens", "loss_normalizer must be a number"),
    (torch.tensor([3.0, 4.0]), "loss_normalizer must be a number or a one-element real tensor"),
    (torch.tensor(True), "loss_normalizer must be a number or a one-element real tensor"),
    (float("inf"), "loss_normalizer must be a finite number > 0"),
    (-2, "loss_normalizer must be a finite number > 0"),
])
@pytest.mark.parametrize("op", ["reference", "fused", "fused_linear"])
def test_a_bad_loss_normalizer_is_named(op, normalizer, match):
    # Its type and shape are checked on the host in every mode; a value in a device tensor is what
    # deferred validation checks on the device.
    inputs = logits_batch(2, 3, 20, seed=25)
    if op == "fused_linear":
        inputs.pop("logits")
        call = lambda: dgpo_ops.fused_linear_dgpo_loss(torch.randn(2, 3, 4), torch.randn(20, 4), **inputs,  # noqa: E731
                                                       loss_normalizer=normalizer, validation="deferred")
    else:
        fn = dgpo_ops.reference_loss if op == "reference" else dgpo_ops.fused_dgpo_loss
        extra = {} if op == "reference" else {"validation": "deferred"}
        call = lambda: fn(**inputs, loss_normalizer=normalizer, **extra)  # noqa: E731
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("budget", [0, -5, float("inf"), 1.5e9, "512MiB", None, True])
def test_a_bad_memory_budget_is_named(budget):
    inputs = logits_batch(2, 3, 20, seed=26)
    inputs.pop("logits")
    with pytest.raises(ValueError, match="memory_budget must be a positive integer number of bytes"):
        dgpo_ops.fused_linear_dgpo_loss(torch.randn(2, 3, 4), torch.randn(20, 4), **inputs, memory_budget=budget)


@pytest.mark.parametrize("route", ["triton_sequence", "torch_token"])
def test_errors_that_hide_every_scored_token_still_give_a_nan_loss(route):
    inputs = logits_batch(2, 4, 20, seed=27)
    inputs["mask"][:] = False
    inputs["target_ids"][0, 0] = 99  # out of range, masked: still an error
    options = dict(backend="triton", importance_sampling_level="sequence", aggregation="seq_mean_token_mean")
    if route == "torch_token":
        options = dict(backend="torch")
    out = dgpo_ops.fused_dgpo_loss(**inputs, validation="deferred", **options)
    assert torch.isnan(out.loss)
    with pytest.raises(ValueError, match="found 99"):
        dgpo_ops.raise_deferred_errors()


def test_finite_means_finite_where_the_loss_is_computed():
    # 1e39 is finite in fp64 but inf in the fp32 the loss uses: both modes name it.
    inputs = logits_batch(2, 3, 20, seed=28)
    inputs["advantages"] = inputs["advantages"].double()
    inputs["advantages"][1] = 1e39
    with pytest.raises(ValueError, match="advantages has non-finite values"):
        dgpo_ops.fused_dgpo_loss(**inputs, validation="immediate")
    out = dgpo_ops.fused_dgpo_loss(**inputs, validation="deferred", backend="triton")
    assert torch.isnan(out.loss)
    with pytest.raises(ValueError, match="advantages has non-finite values"):
        dgpo_ops.raise_deferred_errors()
