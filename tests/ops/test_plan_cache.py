"""The logits op's plan cache (``dgpo_ops.ops.plan_cache``) and its bound launches (``dgpo_ops.ops.bound_launches``),
on the Triton route under the interpreter: a call of a signature seen before reuses its template and replays its
launches, a call that differs in any one thing the plan reads gets a template of its own, and either way the loss
and the gradient are bit for bit those of the uncached call, the values are checked on every call and no tensor
outlives its call in the cache."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import logits_batch
from triton.runtime.interpreter import InterpretedFunction

import dgpo_ops
import dgpo_ops.ops.logits as logits_op
from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.core.options import LossOptions
from dgpo_ops.ops.bound_launches import BoundLaunch
from dgpo_ops.ops.plan_cache import LOGITS_PLANS, PlanCache, input_signature

pytestmark = pytest.mark.usefixtures("no_pending_checks")

B, T, V = 2, 5, 30


@pytest.fixture(autouse=True)
def empty_cache():
    LOGITS_PLANS.clear()
    yield
    LOGITS_PLANS.clear()


def base_call() -> tuple[dict, dict]:
    """``(inputs, options)`` of the call every variation changes one thing of."""
    inputs = logits_batch(B, T, V, seed=3)
    inputs["logits"].requires_grad_(True)
    return inputs, dict(method="dgpo", backend="triton", validation="deferred")


def transposed(tensor: torch.Tensor) -> torch.Tensor:
    """The same values with other strides (the last two axes stored the other way round)."""
    return tensor.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(tensor.requires_grad)


def with_input(name, make):
    def vary(inputs, options):
        inputs[name] = make(inputs.get(name), inputs)
        return inputs, options
    return vary


def with_option(name, value):
    def vary(inputs, options):
        return inputs, dict(options, **{name: value})
    return vary


# One thing of the base call changed per entry: a field of the input signature.
VARIATIONS = {
    "logits vocabulary": with_input("logits", lambda x, _: torch.cat([x.detach(), x.detach()[..., :1]], -1)
                                    .requires_grad_()),
    "logits tokens": lambda inputs, options: ({name: value[:, :-1].detach().contiguous().requires_grad_(
        name == "logits") if value.dim() > 1 else value for name, value in inputs.items()}, options),
    "logits strides": with_input("logits", lambda x, _: transposed(x)),
    "logits dtype": with_input("logits", lambda x, _: x.detach().to(torch.bfloat16).requires_grad_()),
    "logits requires_grad": with_input("logits", lambda x, _: x.detach()),
    "target_ids dtype": with_input("target_ids", lambda x, _: x.to(torch.int32)),
    "target_ids strides": with_input("target_ids", lambda x, _: x.t().contiguous().t()),
    "advantages per token": with_input("advantages", lambda x, _: x[:, None].expand(B, T).contiguous()),
    "advantages dtype": with_input("advantages", lambda x, _: x.double()),
    "advantages requires_grad": with_input("advantages", lambda x, _: x.clone().requires_grad_()),
    "mask absent": with_input("mask", lambda x, _: None),
    "mask dtype": with_input("mask", lambda x, _: x.to(torch.int64)),
    "old_logps absent": with_input("old_logps", lambda x, _: None),
    "old_logps strides": with_input("old_logps", lambda x, _: x.t().contiguous().t()),
    "rollout_weights present": with_input("rollout_weights", lambda x, _: torch.rand(B, T) + 0.5),
    "loss_normalizer number": with_input("loss_normalizer", lambda x, _: 7.0),
    "loss_normalizer other number": with_input("loss_normalizer", lambda x, _: 9.0),
    "loss_normalizer tensor": with_input("loss_normalizer", lambda x, _: torch.tensor(7.0)),
    "scores present": with_input("scores", lambda x, _: torch.randn(B)),
    "entropy_weights present": with_input("entropy_weights", lambda x, _: torch.rand(B, T)),
    "ref_logps and beta": lambda inputs, options: (
        dict(inputs, ref_logps=inputs["old_logps"] - 0.1), dict(options, beta=0.05)),
    "method parameter": with_option("n", 1.5),
    "method": with_option("method", "grpo"),
    "temperature": with_option("temperature", 0.7),
    "aggregation": with_option("aggregation", "seq_mean_token_mean"),
    "entropy_coef": with_option("entropy_coef", 0.01),
    "validation": with_option("validation", "immediate"),
    "backend": with_option("backend", "torch"),
}


def run(inputs: dict, options: dict, mode: str = "grad"):
    """Loss, gradient and per-token outputs of one call; ``mode``: ``grad``, ``no_grad`` or ``autocast``."""
    logits = inputs["logits"]
    logits.grad = None
    if mode == "no_grad":
        with torch.no_grad():
            out = dgpo_ops.fused_dgpo_loss(**inputs, **options)
    elif mode == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = dgpo_ops.fused_dgpo_loss(**inputs, **options)
    else:
        out = dgpo_ops.fused_dgpo_loss(**inputs, **options)
    if out.loss.requires_grad:
        out.loss.backward()
    dgpo_ops.raise_deferred_errors()
    grad = None if logits.grad is None else logits.grad.clone()
    return out.loss.detach().clone(), grad, out.logps.clone(), out.entropy.clone(), out.metrics["eur"].clone()


def uncached(monkeypatch, inputs, options, mode="grad"):
    """The call planned as without the cache (every call planned from scratch, its wrappers run)."""
    with monkeypatch.context() as patch:
        patch.setattr(logits_op, "input_signature", lambda *args: None)
        return run(inputs, options, mode)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bitwise(got, want):
    """Equal to the bit (NaN payloads included), tensor by tensor; None where the other is None."""
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b)), (a, b)


def test_equal_signatures_share_a_template_and_give_the_uncached_numbers(monkeypatch):
    inputs, options = base_call()
    first = run(inputs, options)
    assert (LOGITS_PLANS.misses, LOGITS_PLANS.hits, len(LOGITS_PLANS)) == (1, 0, 1)
    other, _ = base_call()
    other = {name: (value.detach() * 1.5 if name == "logits" else value.clone())
             for name, value in other.items()}
    other["logits"].requires_grad_(True)
    second = run(other, options)
    assert (LOGITS_PLANS.misses, LOGITS_PLANS.hits, len(LOGITS_PLANS)) == (1, 1, 1)
    assert not torch.equal(first[0], second[0])  # other values: another loss, from the same template
    assert_bitwise(first, uncached(monkeypatch, inputs, options))
    assert_bitwise(second, uncached(monkeypatch, other, options))


@pytest.mark.parametrize("variation", list(VARIATIONS))
def test_one_changed_field_gets_its_own_template_with_the_uncached_numbers(monkeypatch, variation):
    inputs, options = base_call()
    run(*base_call())
    assert len(LOGITS_PLANS) == 1
    varied, varied_options = VARIATIONS[variation](inputs, options)
    got = run(varied, varied_options)
    assert len(LOGITS_PLANS) == 2 and LOGITS_PLANS.misses == 2, "the changed call reused the base call's template"
    again = run(varied, varied_options)  # the second call of the variation: its own template, replayed
    assert LOGITS_PLANS.hits == 1
    want = uncached(monkeypatch, varied, varied_options)
    assert_bitwise(got, want)
    assert_bitwise(again, want)


@pytest.mark.parametrize("mode", ["no_grad", "autocast"])
def test_grad_mode_and_autocast_are_part_of_the_signature(monkeypatch, mode):
    inputs, options = base_call()
    run(inputs, options)
    got = run(inputs, options, mode)
    assert len(LOGITS_PLANS) == 2
    assert_bitwise(run(inputs, options, mode), uncached(monkeypatch, inputs, options, mode))
    assert_bitwise(got, uncached(monkeypatch, inputs, options, mode))


def test_signature_reads_device_and_refuses_what_it_cannot_key():
    inputs, options = base_call()
    batch = LossInputs(inputs["target_ids"], inputs["advantages"], inputs["mask"], inputs["old_logps"])
    built = LossOptions.build(**options)
    key = input_signature(inputs["logits"], batch, built, True)
    meta_logits = torch.empty(inputs["logits"].shape, device="meta")
    assert input_signature(meta_logits, batch, built, True) != key
    meta_mask = batch._replace(mask=torch.empty(batch.mask.shape, dtype=torch.bool, device="meta"))
    assert input_signature(inputs["logits"], meta_mask, built, True) != key

    class Subclass(torch.Tensor):
        pass

    assert input_signature(inputs["logits"].detach().as_subclass(Subclass), batch, built, True) is None
    normalizer_elsewhere = batch._replace(loss_normalizer=torch.tensor(2.0, device="meta"))
    assert input_signature(inputs["logits"], normalizer_elsewhere, built, True) is None  # read on the host per call
    assert input_signature(inputs["logits"], batch._replace(mask=[1, 0]), built, True) is None


def test_packed_sequences_are_planned_per_call():
    inputs, options = base_call()
    flat = {name: value.reshape(-1, *value.shape[2:]) if name != "advantages" else value
            for name, value in inputs.items()}
    flat["logits"] = flat["logits"].detach().requires_grad_(True)
    cu_seqlens = torch.tensor([0, T, 2 * T])
    run(flat, dict(options, cu_seqlens=cu_seqlens))
    assert len(LOGITS_PLANS) == 0


def test_the_cache_is_a_bounded_lru():
    inputs, options = base_call()
    batch = LossInputs(inputs["target_ids"], inputs["advantages"], inputs["mask"], inputs["old_logps"])
    template = logits_op.logits_template(inputs["logits"], batch, LossOptions.build(**options), True)
    cache, made = PlanCache(size=3), []

    def get(key):
        def make():
            made.append(key)
            return template
        return cache.template((key,), make)

    for key in ("a", "b", "c", "a", "d"):  # "a" again: a hit, the most recently used; "d" evicts the least, "b"
        get(key)
    assert len(cache) == 3 and made == ["a", "b", "c", "d"] and (cache.hits, cache.misses) == (1, 4)
    get("a")
    get("b")
    assert made == ["a", "b", "c", "d", "b"]
    assert cache.template(([],), lambda: template) is None  # an unhashable key: planned without the cache
    assert isinstance(get("e").kernels.forward, BoundLaunch)


def test_no_tensor_outlives_its_call():
    inputs, options = base_call()
    inputs["ref_logps"] = inputs["old_logps"] - 0.2
    inputs["rollout_weights"] = torch.rand(B, T) + 0.5
    inputs["loss_normalizer"] = torch.tensor(4.0)
    options = dict(options, beta=0.05)
    for _ in range(2):  # the first call makes the template and records its launches, the second replays them
        out = dgpo_ops.fused_dgpo_loss(**inputs, **options)
        out.loss.backward()
    dgpo_ops.raise_deferred_errors()
    refs = [weakref.ref(value) for value in (*inputs.values(), out.loss, out.logps, out.metrics["eur"],
                                             inputs["logits"].grad)]
    del inputs, out
    gc.collect()
    assert len(LOGITS_PLANS) == 1
    assert [ref() is None for ref in refs] == [True] * len(refs)


def launches_of(call) -> list[tuple]:
    """The kernel launches of ``call()``, each as ``(kernel, grid, args, kwargs)`` with every tensor argument
    described by its metadata and which input it is (by storage), not launched."""
    recorded = []
    original = InterpretedFunction.__getitem__

    def record(self, grid):
        def launch(*args, **kwargs):
            recorded.append((self.fn.__name__, grid, args, kwargs))
        return launch

    InterpretedFunction.__getitem__ = record
    try:
        inputs = call()
    finally:
        InterpretedFunction.__getitem__ = original
    by_storage = {value.untyped_storage().data_ptr(): name for name, value in inputs.items() if torch.is_tensor(value)}

    def describe(value):
        if not torch.is_tensor(value):
            return value
        return (tuple(value.shape), value.stride(), value.dtype, by_storage.get(value.untyped_storage().data_ptr()))

    return [(name, grid, tuple(map(describe, args)), kwargs) for name, grid, args, kwargs in recorded]


@pytest.mark.parametrize("variation", ["base", "mask absent", "old_logps strides", "ref_logps and beta",
                                       "rollout_weights present", "loss_normalizer tensor", "entropy_weights present",
                                       "scores present", "logits strides", "advantages per token"])
def test_replayed_launches_are_the_wrappers(variation):
    """A cache hit launches what the wrappers launch for the same call: the same kernels and grids, the same
    non-tensor arguments, and each tensor argument the same input (or a workspace buffer like it)."""
    def call():
        inputs, options = base_call()
        if variation != "base":
            inputs, options = VARIATIONS[variation](inputs, options)
        inputs["logits"].grad = None
        dgpo_ops.fused_dgpo_loss(**inputs, **options).loss.backward()
        return inputs

    wrappers = launches_of(call)  # the first call runs the wrappers (and records them)
    template = next(iter(LOGITS_PLANS._templates.values()))
    bound = [template.kernels.forward, template.kernels.prologue, template.kernels.backward]
    assert all(isinstance(launch, BoundLaunch) and launch.replay is not None for launch in bound)
    assert launches_of(call) == wrappers
    assert LOGITS_PLANS.hits == 1


def test_a_call_unlike_the_recorded_one_runs_the_wrapper():
    """A replay guards what the recorded call's wrapper read besides tensors: another scalar (here the entropy
    coefficient of the gradient kernel) or a None where there was a tensor sends the call to the wrapper."""
    from dgpo_ops.kernels.logits_grad import logits_grad
    from dgpo_ops.kernels.row_io import RowWorkspace

    logits = torch.randn(B, T, V)
    workspace = RowWorkspace.allocate((B, T), B, logits.device, zero_planes=True)
    bound = BoundLaunch(logits_grad)

    def launches(entropy_coef, grad_loss):
        def call():
            bound(logits, torch.empty_like(logits), workspace, T, 1.0, entropy_coef, grad_loss=grad_loss)
            return {"logits": logits}
        return launches_of(call)

    recorded = launches(0.0, workspace.loss)
    assert bound.replay is not None
    assert launches(0.0, workspace.loss) == recorded
    other_coef = launches(0.5, workspace.loss)
    assert other_coef[0][2][8] == 0.5 and other_coef[0][3]["HAS_ENTROPY_GRAD"]
    without = launches(0.0, None)
    assert not without[0][3]["HAS_GRAD_LOSS"] and without[0][2][7][0] == (B,)  # the scales stand in for it
    assert launches(0.0, workspace.loss) == recorded  # the recorded call's kind replays again


def test_deferred_errors_are_found_on_a_cached_call():
    inputs, options = base_call()
    run(inputs, options)
    bad = dict(inputs, target_ids=inputs["target_ids"].clone())
    bad["target_ids"][1, 1] = V + 3
    out = dgpo_ops.fused_dgpo_loss(**bad, **options)
    assert LOGITS_PLANS.hits == 1
    assert torch.isnan(out.loss)
    with pytest.raises(ValueError, match="target_ids must be in"):
        dgpo_ops.fused_dgpo_loss(**inputs, **options)  # the next call of the signature polls it
    assert LOGITS_PLANS.hits == 2


def test_immediate_errors_are_raised_by_a_cached_call():
    inputs, options = base_call()
    options = dict(options, validation="immediate")
    run(inputs, options)
    bad = dict(inputs, old_logps=inputs["old_logps"].clone())
    bad["old_logps"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="old_logps"):
        dgpo_ops.fused_dgpo_loss(**bad, **options)
    assert LOGITS_PLANS.hits == 1
