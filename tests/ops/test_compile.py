"""torch.compile(fullgraph=True) of the fused ops and the reference gives the eager results;
the custom ops pass torch.library.opcheck; importing dgpo_ops does not import the compiler."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import METHOD_VARIANTS, ROUTE_VARIANTS, for_method, logits_batch, response_scores, variant_id

import dgpo_ops
from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.core.options import LossOptions, assume_constant_result
from dgpo_ops.ops.compiled import (
    checked_inputs_op,
    fused_linear_policy_loss_op,
    fused_policy_loss_op,
    options_spec,
)

ONE_PER_METHOD = list({name: (name, params) for name, params in reversed(METHOD_VARIANTS)}.values())
B, T, H, V = 2, 4, 8, 24


def linear_inputs(seed=0, ref_logps=False):
    """``ref_logps``: with reference log-probs, for a call with beta > 0."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.4
    inputs = logits_batch(B, T, V, seed=seed, logits=(hidden @ weight.T).double(), ref_logps=ref_logps)
    inputs.pop("logits")
    return hidden, weight, inputs


def all_three(logits, hidden, weight, inputs, kwargs):
    """Reference, fused logits op and fused linear op in one function (one graph when compiled)."""
    ref = dgpo_ops.reference_loss(logits, **inputs, **kwargs)
    fused = dgpo_ops.fused_dgpo_loss(logits, **inputs, **kwargs)
    linear = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, **kwargs)
    outs = (ref, fused, linear)
    return [o.loss for o in outs], [o.logps for o in outs], [o.metrics["eur"] for o in outs], \
        [o.metrics["hp_fraction"] for o in outs]


def leaves(hidden, weight):
    logits = (hidden @ weight.T).detach().requires_grad_(True)
    return logits, hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)


def compiler_backend(variant) -> str:
    """What a method adds under torch.compile is its terms' trace, in one graph (fullgraph), which dynamo
    makes: every method has it made (``eager`` runs dynamo's graph as it is). AOTAutograd's joint
    forward-backward graph (``aot_eager``, what inductor takes) of those terms is made the same way for every
    method of a route: each route's representative has it made too."""
    return "aot_eager" if variant in ROUTE_VARIANTS else "eager"


@pytest.mark.parametrize("variant", ONE_PER_METHOD, ids=variant_id)
def test_compiled_equals_eager_for_every_method(variant):
    name, params = variant
    hidden, weight, inputs = linear_inputs(ref_logps=True)
    kwargs = dict(method=name, **params, beta=0.02, entropy_coef=0.01,
                  **for_method(name, {"positive_nll_coef": 0.05}, responses=B))
    torch._dynamo.reset()
    # fullgraph: no graph break
    compiled = torch.compile(all_three, fullgraph=True, backend=compiler_backend(variant))
    eager_leaves, compiled_leaves = leaves(hidden, weight), leaves(hidden, weight)
    eager = all_three(*eager_leaves, inputs, kwargs)
    got = compiled(*compiled_leaves, inputs, kwargs)
    for expected_group, got_group in zip(eager, got):
        for e, c in zip(expected_group, got_group):
            torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7)
    (sum(eager[0])).backward()
    (sum(got[0])).backward()
    for e_leaf, c_leaf in zip(eager_leaves, compiled_leaves):
        assert c_leaf.grad is not None and torch.isfinite(c_leaf.grad).all()
        torch.testing.assert_close(c_leaf.grad, e_leaf.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_inductor_compiles_the_fused_op(level):
    inputs = logits_batch(B, T, V, seed=3)
    logits = inputs.pop("logits")
    kwargs = dict(method="dgpo", importance_sampling_level=level, aggregation="seq_mean_token_mean")

    def loss_fn(x):
        return dgpo_ops.fused_dgpo_loss(x, **inputs, **kwargs).loss

    torch._dynamo.reset()
    x_eager, x_compiled = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    loss_fn(x_eager).backward()
    torch.compile(loss_fn, fullgraph=True)(x_compiled).backward()
    torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=1e-5, atol=1e-7)


def test_compiled_autocast_linear_op_multiplies_in_bf16_as_eager():
    hidden, weight, inputs = linear_inputs(seed=4)

    def loss_fn(h, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return dgpo_ops.fused_linear_dgpo_loss(h, w, **inputs, method="grpo").loss

    torch._dynamo.reset()
    eager = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    compiled = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    loss_e = loss_fn(*eager)
    loss_c = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(*compiled)
    torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=0)
    loss_e.backward()
    loss_c.backward()
    for e, c in zip(eager, compiled):
        assert c.grad.dtype == torch.float32
        torch.testing.assert_close(c.grad, e.grad, rtol=0, atol=0)
    # ... and that is not what fp32 products give: the autocast dtype reached the op.
    fp32 = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, method="grpo").loss
    assert fp32.item() != loss_e.item()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_compiled_on_chip_linear_op_equals_eager(level):
    hidden, weight, inputs = linear_inputs(seed=5)
    kwargs = dict(method="dgpo", importance_sampling_level=level, entropy_coef=0.01, backend="triton",
                  logits_on_chip=True)

    def loss_fn(h, w):
        return dgpo_ops.fused_linear_dgpo_loss(h, w, **inputs, **kwargs).loss

    torch._dynamo.reset()
    eager = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    compiled = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    loss_e = loss_fn(*eager)
    loss_c = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(*compiled)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7)
    loss_e.backward()
    loss_c.backward()
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c.grad, e.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fn", ["reference_loss", "fused_dgpo_loss"])
def test_compiled_calls_keep_the_input_errors(fn):
    inputs = logits_batch(B, T, V, seed=5)
    logits = inputs.pop("logits")
    inputs["target_ids"] = inputs["target_ids"].clone()
    inputs["target_ids"][0, 0] = V + 3
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: getattr(dgpo_ops, fn)(x, **inputs).loss, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"target_ids must be in \[0, 24\)"):
        compiled(logits)


def test_inplace_is_refused_under_compile():
    inputs = logits_batch(B, T, V, seed=6)
    logits = inputs.pop("logits")
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: dgpo_ops.fused_dgpo_loss(x * 1.0, **inputs, inplace=True).loss,
                             fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="inplace=True is not supported under torch.compile"):
        compiled(logits.requires_grad_(True))


def test_opcheck_every_custom_op():
    inputs = logits_batch(B, T, V, seed=7)
    logits = inputs.pop("logits").requires_grad_(True)

    def tensors(**fields):  # the schema's tensors, by their LossInputs names
        return LossInputs(**{k: inputs[k] for k in ("target_ids", "advantages", "mask", "old_logps")},
                          **fields).tensors()

    spec = options_spec(LossOptions.build("dgpo", beta=0.0))
    hidden, weight = torch.randn(B * T, H, requires_grad=True), (torch.randn(V, H) * 0.3).requires_grad_(True)
    scores = response_scores(B)
    topr, grpo = options_spec(LossOptions.build("topr")), options_spec(LossOptions.build("grpo"))
    on_chip = options_spec(LossOptions.build("grpo", backend="triton", logits_on_chip=True))
    sequence = options_spec(LossOptions.build("grpo", importance_sampling_level="sequence"))
    wants = [True, True, False]  # the gradients of hidden, weight, bias
    cases = [
        (fused_policy_loss_op, (logits, *tensors(), None, None, spec, True)),
        (fused_policy_loss_op, (logits, *tensors(), None, 7.0, sequence, True)),
        (fused_policy_loss_op, (logits, *tensors(scores=scores), None, None, topr, True)),
        # a token-local method with scores passed: the objective route, its coefficients in the backward
        (fused_policy_loss_op, (logits, *tensors(scores=scores), None, None, spec, True)),
        (fused_linear_policy_loss_op, (hidden, weight, None, *tensors(), None, None, grpo, wants, "")),
        (fused_linear_policy_loss_op, (hidden, weight, None, *tensors(), None, None, on_chip, wants, "")),
        (fused_linear_policy_loss_op, (hidden, weight, None, *tensors(scores=scores), None, None, topr, wants,
                                       "")),
        (checked_inputs_op, (*tensors(), None, None, [B, T, V], torch.float32, spec)),
        (checked_inputs_op, (*tensors(scores=scores), None, None, [B, T, V], torch.float32, topr)),
    ]
    for op, args in cases:
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, (op, results)


def test_the_custom_ops_take_the_call_objects_tensors_by_name():
    """The ops' schemas are made from ``OP_TENSORS``: each names those fields of ``LossInputs``, in order, and
    requires a tensor where the field has no default; a batch's ``tensors()`` fills them."""
    from dgpo_ops.core.inputs import OP_TENSORS, LossInputs

    assert set(OP_TENSORS) <= set(LossInputs._fields) and len(set(OP_TENSORS)) == len(OP_TENSORS)
    for op in (fused_policy_loss_op, fused_linear_policy_loss_op, checked_inputs_op):
        arguments = op._opoverload._schema.arguments
        names = [a.name for a in arguments]
        first = names.index(OP_TENSORS[0])
        taken = arguments[first:first + len(OP_TENSORS)]
        assert [a.name for a in taken] == list(OP_TENSORS), op
        for argument in taken:
            optional = argument.type.str().endswith("?")
            assert optional == (argument.name in LossInputs._field_defaults), (op, argument)
    batch = LossInputs(*[torch.zeros(1)] * 2, mask=torch.ones(1))
    assert batch.tensors() == tuple(getattr(batch, name) for name in OP_TENSORS)


# Each float option changed between two compiled calls (a trainer's schedule does): dynamo makes a float that
# changed dynamic, and the options are a trace-time constant, so the new value must recompile, not fail. All
# of them change at once: a value that did not reach the new graph leaves a result unequal to eager's.
CHANGED_FLOATS = [("temperature", 0.9, 0.7), ("beta", 0.02, 0.05), ("entropy_coef", 0.01, 0.03),
                  ("loss_normalizer", 5.0, 7.0), ("eps_high", 0.2, 0.28)]


def test_changing_float_options_recompile_and_equal_eager():
    hidden, weight, inputs = linear_inputs(ref_logps=True)
    base = dict(method="dgpo", **{name: first for name, first, _ in CHANGED_FLOATS})
    torch._dynamo.reset()
    compiled = torch.compile(all_three, fullgraph=True, backend="aot_eager")
    calls = [base, {**base, **{name: second for name, _, second in CHANGED_FLOATS}}]
    for kwargs in calls:
        eager = all_three(*leaves(hidden, weight), inputs, kwargs)
        got = compiled(*leaves(hidden, weight), inputs, kwargs)
        for expected_group, got_group in zip(eager, got):
            for e, c in zip(expected_group, got_group):
                torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7, msg=f"{kwargs}")


def test_changing_projection_floats_and_module_options_under_compile():
    hidden, weight, inputs = linear_inputs()

    def linear(hidden, weight, logit_scale, softcap):
        return dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, logit_scale=logit_scale,
                                               softcap=softcap).loss

    torch._dynamo.reset()
    compiled = torch.compile(linear, fullgraph=True, backend="aot_eager")
    for logit_scale, softcap in ((1.0, 30.0), (0.5, 30.0), (0.5, 20.0)):
        torch.testing.assert_close(compiled(hidden, weight, logit_scale, softcap),
                                   linear(hidden, weight, logit_scale, softcap), rtol=1e-6, atol=1e-7)
    logits = (hidden @ weight.T).detach()
    module = dgpo_ops.DGPOLoss(method="dgpo", entropy_coef=0.01)
    compiled_module = torch.compile(module, fullgraph=True, backend="aot_eager")
    for entropy_coef in (0.01, 0.02):
        module.options = LossOptions.build("dgpo", entropy_coef=entropy_coef)
        torch.testing.assert_close(compiled_module(logits, **inputs).loss,
                                   dgpo_ops.fused_dgpo_loss(logits, **inputs, entropy_coef=entropy_coef).loss,
                                   rtol=1e-6, atol=1e-7)


def test_the_constant_mark_is_torchs():
    """The options' trace-time constants are marked as ``torch.compiler.assume_constant_result`` marks a
    function, without importing torch._dynamo (if torch marks otherwise, this fails, and so do the fullgraph
    tests above)."""
    def ours():
        return 1

    def torchs():
        return 1

    assert assume_constant_result(ours) is ours and torch.compiler.assume_constant_result(torchs) is torchs
    assert vars(ours) == vars(torchs) != {}


def test_importing_the_package_leaves_the_compiler_unimported():
    """``import dgpo_ops`` does not import torch._dynamo (1.2 s: a third of the import); the first access to
    ``linear_logprob_entropy`` does, to mark it as run eagerly under torch.compile."""
    code = ("import sys, dgpo_ops; print('torch._dynamo' in sys.modules); dgpo_ops.linear_logprob_entropy; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]
