"""A call leaves nothing for Python's garbage collector: every object it makes is freed by reference counting as
soon as the caller drops the outputs (and the graph, after backward). An object in a reference cycle lives until
the collector next runs: the saved logits of a forward whose backward never comes (an evaluation with grad
enabled) would stay on the device until then, and every such object makes the collector run more often, on the
host's time of the calls that follow. ``gc.collect(0)`` returns how many unreachable objects it found among those
made since the last collection, which is all of them with the collector off (a full collection would read every
object of the process, a tenth of a second each time)."""

from __future__ import annotations

import gc

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import dgpo_ops

B, T, V, H = 2, 5, 40, 16


@pytest.fixture
def collector_off():
    """The collector neither runs during the call nor has anything young left from before it."""
    gc.disable()
    gc.collect(0)
    yield
    gc.enable()


@pytest.fixture
def launches_off(monkeypatch):
    """Triton launches that do nothing: the interpreter's own launch machinery makes cycles of its own (closures
    over its arguments' storages) that a compiled launch on CUDA does not; what is tested is the op's host code
    around the launches."""
    monkeypatch.setattr(InterpretedFunction, "__getitem__", lambda self, grid: lambda *args, **kwargs: None)


def warm(call, backward: bool) -> None:
    """One call first, collected: what a process makes once (a plan template, a class made on first use) is not
    what each call leaves."""
    source, out = call(requires_grad=True)
    if backward:
        out.loss.backward()
    del source, out
    dgpo_ops.raise_deferred_errors()
    gc.collect(0)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    old = -torch.rand(B, T, generator=g) * 3
    return target, torch.randn(B, generator=g), mask, old


# token level (the row forward's epilogue makes the loss in the workspace the backward reads on Triton) and
# sequence level (GSPO's ratio: the torch objective)
LEVELS = {"token": {}, "sequence": {"importance_sampling_level": "sequence"}}


def logits_call(level: str, backend: str, validation: str):
    def call(requires_grad: bool):
        logits = torch.randn(B, T, V, requires_grad=requires_grad)
        return logits, dgpo_ops.fused_dgpo_loss(logits, *batch(), backend=backend, validation=validation,
                                                **LEVELS[level])
    return call


def linear_call(level: str, backend: str, validation: str):
    def call(requires_grad: bool):
        hidden = torch.randn(B, T, H, requires_grad=requires_grad)
        weight = torch.randn(V, H, requires_grad=requires_grad)
        return hidden, dgpo_ops.fused_linear_dgpo_loss(hidden, weight, *batch(), backend=backend,
                                                       validation=validation, **LEVELS[level])
    return call


CALLS = {
    f"{op.__name__}-{level}-{backend}-{validation}": op(level, backend, validation)
    for op in (logits_call, linear_call)
    for level in LEVELS
    for backend in ("triton", "torch")
    for validation in ("deferred", "immediate")
}


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("backward", [True, False], ids=["forward_backward", "forward_only"])
def test_a_call_leaves_no_reference_cycle(name, backward, collector_off, no_pending_checks, request):
    if "-triton-" in name:
        request.getfixturevalue("launches_off")
    warm(CALLS[name], backward)
    source, out = CALLS[name](requires_grad=True)
    if backward:
        out.loss.backward()
    del source, out
    dgpo_ops.raise_deferred_errors()  # the deferred check's queue holds the status until it is read
    assert gc.collect(0) == 0


def test_fused_linear_logprobs_leaves_no_reference_cycle(collector_off, no_pending_checks, launches_off):
    """The forward-only function (no graph: its results carry no gradient)."""
    def call(requires_grad: bool):
        hidden = torch.randn(B, T, H, requires_grad=requires_grad)
        weight = torch.randn(V, H, requires_grad=requires_grad)
        logps, entropy = dgpo_ops.fused_linear_logprobs(hidden, weight, batch()[0])
        return (hidden, weight), dgpo_ops.PolicyLossOutput(logps.sum(), logps, entropy, None)

    warm(call, backward=False)
    source, out = call(requires_grad=True)
    del source, out
    dgpo_ops.raise_deferred_errors()
    assert gc.collect(0) == 0


def test_the_check_sees_a_cycle(collector_off):
    """The assertion above can fail: a cycle of the kind the logits op made (an output whose grad_fn's context
    holds the output) is found."""

    class Holding(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = x * 2
            ctx.out = [out]
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    out = Holding.apply(torch.ones(3, requires_grad=True))
    del out
    assert gc.collect(0) > 0
