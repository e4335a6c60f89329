"""The call object: ``LossInputs`` and ``LossOptions``, the public functions' signatures made from their fields
(``dgpo_ops.core.call``) and their definitions in dgpo_ops/api.py, and ``policy_loss``, the entry every fused
public function goes through."""

import ast
import dataclasses
import inspect
import pathlib

import pytest
import torch
from helpers import logits_batch

import dgpo_ops
from dgpo_ops import api
from dgpo_ops.core.call import (INPUT_FIELDS, OPTION_FIELDS, PROJECTION_OPTIONS, CallSignature,
                                field_annotation)
from dgpo_ops.ops import linear_logprobs

KEYWORD = inspect.Parameter.KEYWORD_ONLY


def keywords(fn) -> set[str]:
    return {name for name, p in inspect.signature(fn).parameters.items() if p.kind == KEYWORD}


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_loss_functions_take_every_field_of_their_kind():
    """Each field of the two classes is a parameter of every function that takes its kind: a new field is a
    keyword there without an edit of any signature."""
    every_input, every_option = set(INPUT_FIELDS), set(OPTION_FIELDS)
    for fn, without in ((dgpo_ops.fused_dgpo_loss, set(PROJECTION_OPTIONS)),
                        (dgpo_ops.fused_linear_dgpo_loss, {"inplace"}),
                        (dgpo_ops.reference_loss, {*PROJECTION_OPTIONS, "inplace", "backend", "validation",
                                                   "vocab_parallel_group"})):
        names = set(parameters(fn))
        assert every_input <= names, (fn.__name__, every_input - names)
        assert every_option - without <= names, (fn.__name__, every_option - without - names)
        assert not names & without, fn.__name__
        assert {"method", "method_params"} <= names
    # the loss options that are not a method's parameter are named, not hidden in **method_params
    assert {"kl_ratio_correction", "positive_nll_coef"} <= keywords(dgpo_ops.fused_dgpo_loss)
    assert parameters(dgpo_ops.DGPOLoss.forward)[:7] == ["self", "logits", "target_ids", "advantages", "mask",
                                                         "old_logps", "ref_logps"]
    assert set(parameters(dgpo_ops.DGPOLoss.forward)) == {"self", "logits", *INPUT_FIELDS}
    # the module's constructor: the method (by position too) and fused_dgpo_loss's options
    init = inspect.signature(dgpo_ops.DGPOLoss.__init__).parameters
    assert list(init)[:2] == ["self", "method"]
    assert init["method"].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert set(init) == {"self", "method", "method_params", *(set(OPTION_FIELDS) - set(PROJECTION_OPTIONS))}


def test_every_public_call_documents_each_of_its_arguments():
    calls = (dgpo_ops.fused_dgpo_loss, dgpo_ops.fused_linear_dgpo_loss, dgpo_ops.fused_linear_logprobs,
             dgpo_ops.reference_loss, dgpo_ops.DGPOLoss.__init__, dgpo_ops.DGPOLoss.forward)
    for fn in calls:
        for name in parameters(fn):
            if name != "self":
                assert f"* ``{name}``: " in (fn.__doc__ or ""), (fn.__qualname__, name)


def test_a_signature_lists_only_fields():
    with pytest.raises(AssertionError, match="not fields of LossInputs or LossOptions"):
        CallSignature(source=("logits",), options=("temperature", "colour"))


def test_arguments_a_function_does_not_take_are_refused_with_the_reason():
    inputs = logits_batch(2, 3, 11, seed=0)
    logits = inputs.pop("logits")
    args = (logits, inputs["target_ids"], inputs["advantages"])
    with pytest.raises(ValueError, match="unexpected keyword argument 'memory_budget': it applies to the loss from "
                                         "hidden states"):
        dgpo_ops.fused_dgpo_loss(*args, memory_budget=1024)
    with pytest.raises(TypeError, match="multiple values for argument 'mask'"):
        dgpo_ops.fused_dgpo_loss(*args, inputs["mask"], mask=inputs["mask"])
    with pytest.raises(TypeError, match="missing required argument"):
        dgpo_ops.fused_dgpo_loss(logits, inputs["target_ids"])
    with pytest.raises(TypeError, match="at most 6 positional arguments"):
        dgpo_ops.fused_dgpo_loss(*args, None, None, None, None)
    with pytest.raises(ValueError, match="unexpected keyword argument 'beta': an option of the module"):
        dgpo_ops.DGPOLoss("grpo")(*args, beta=0.1)  # a module's options are its own
    with pytest.raises(ValueError, match="unexpected keyword argument 'softcap'"):
        dgpo_ops.DGPOLoss("grpo", softcap=30.0)
    # an unknown name is not a field: it reaches the method, which names its parameters
    with pytest.raises(ValueError, match="colour"):
        dgpo_ops.fused_dgpo_loss(*args, method="grpo", colour=1)


def test_every_public_function_is_policy_loss_on_the_same_objects():
    torch.manual_seed(0)
    inputs = logits_batch(2, 5, 37, seed=1, ref_logps=True)
    logits = inputs.pop("logits")
    options = dgpo_ops.LossOptions.build("grpo", eps_high=0.28, beta=0.05, kl_ratio_correction=True)
    batch = dgpo_ops.LossInputs(**inputs)
    direct = dgpo_ops.policy_loss(batch, options, logits=logits)
    by_keywords = dgpo_ops.fused_dgpo_loss(logits, **inputs, method="grpo", eps_high=0.28, beta=0.05,
                                           kl_ratio_correction=True)
    module = dgpo_ops.DGPOLoss("grpo", eps_high=0.28, beta=0.05, kl_ratio_correction=True)(logits, **inputs)
    assert module.loss.item() == by_keywords.loss.item() == direct.loss.item()
    assert dgpo_ops.DGPOLoss("grpo", eps_high=0.28, beta=0.05, kl_ratio_correction=True).options is options
    reference = dgpo_ops.reference_loss(logits.double(), **inputs, method="grpo", eps_high=0.28, beta=0.05,
                                        kl_ratio_correction=True)
    torch.testing.assert_close(direct.loss.double(), reference.loss, rtol=1e-5, atol=1e-6)
    leaf = logits.double().requires_grad_(True)
    by_entry = dgpo_ops.policy_loss(batch, options, logits=leaf, reference=True)
    assert by_entry.loss.item() == reference.loss.item()
    # the reference's graph: the fused ops refuse a gradient of their gradient
    (grad,) = torch.autograd.grad(by_entry.loss, leaf, create_graph=True)
    assert grad.requires_grad


def test_policy_loss_takes_one_source_and_projection_options_only_from_hidden_states():
    inputs = logits_batch(1, 4, 9, seed=2)
    logits = inputs.pop("logits")
    batch = dgpo_ops.LossInputs(**inputs)
    with pytest.raises(ValueError, match="takes one source"):
        dgpo_ops.policy_loss(batch, dgpo_ops.LossOptions.build("grpo"))
    with pytest.raises(ValueError, match="takes one source"):
        dgpo_ops.policy_loss(batch, dgpo_ops.LossOptions.build("grpo"), logits=logits, hidden=logits)
    with pytest.raises(ValueError, match="apply to the loss from hidden states"):
        dgpo_ops.policy_loss(batch, dgpo_ops.LossOptions.build("grpo", logit_scale=2.0), logits=logits)
    hidden, weight = torch.randn(1, 4, 6), torch.randn(9, 6)
    with pytest.raises(ValueError, match="reference=True is the loss from whole logits"):
        dgpo_ops.policy_loss(batch, dgpo_ops.LossOptions.build("grpo"), hidden=hidden, weight=weight,
                             reference=True)
    scaled = dgpo_ops.policy_loss(batch, dgpo_ops.LossOptions.build("grpo", logit_scale=2.0), hidden=hidden,
                                  weight=weight)
    by_logits = dgpo_ops.policy_loss(batch, dgpo_ops.LossOptions.build("grpo"), logits=2.0 * hidden @ weight.T)
    torch.testing.assert_close(scaled.loss, by_logits.loss, rtol=1e-5, atol=1e-6)


def test_the_log_prob_function_takes_its_fields_only():
    hidden, weight = torch.randn(2, 3, 6), torch.randn(9, 6)
    targets = torch.randint(0, 9, (2, 3))
    logps, entropy = dgpo_ops.fused_linear_logprobs(hidden, weight, targets, temperature=0.5)
    want = torch.log_softmax((hidden @ weight.T) / 0.5, -1)
    torch.testing.assert_close(logps, want.gather(-1, targets[..., None]).squeeze(-1), rtol=1e-5, atol=1e-5)
    assert "Returns ``(logps, entropy)``" in dgpo_ops.fused_linear_logprobs.__doc__
    for name in ("method", "beta", "advantages"):
        with pytest.raises(ValueError, match=f"unexpected keyword argument '{name}'"):
            dgpo_ops.fused_linear_logprobs(hidden, weight, targets, **{name: 0.1})


@pytest.mark.parametrize("module", [api, linear_logprobs], ids=lambda module: module.__name__)
def test_each_public_function_is_a_definition_with_the_call_objects_fields(module):
    """The module defines each of its public functions (``def``, written by ``python docs/generate.py``): what
    IDEs, type checkers and grep read. Its parameters are the fields it takes, each with the field's
    annotation and default, and the function that runs has that signature and the definition's docstring."""
    source = pathlib.Path(module.__file__).read_text()
    defined = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    input_types = {name: field_annotation(t) for name, t in dgpo_ops.LossInputs.__annotations__.items()}
    option_fields = dgpo_ops.LossOptions.__dataclass_fields__
    assert set(module.PUBLIC_FUNCTIONS) <= set(dgpo_ops.__all__)
    for name, public in module.PUBLIC_FUNCTIONS.items():
        assert name in defined and f"\ndef {name}(" in source, name
        fn, declared = getattr(dgpo_ops, name), inspect.signature(public.declaration)
        assert declared == inspect.signature(fn), name
        assert " ".join(public.declaration.__doc__.split()) == " ".join(fn.__doc__.split()), name
        for parameter in declared.parameters.values():
            assert parameter.annotation is not inspect.Parameter.empty, (name, parameter.name)
            if parameter.name in INPUT_FIELDS:
                default = dgpo_ops.LossInputs._field_defaults.get(parameter.name, inspect.Parameter.empty)
                assert (parameter.annotation, parameter.default) == (input_types[parameter.name], default)
            elif parameter.name in OPTION_FIELDS:
                field = option_fields[parameter.name]
                want = (field_annotation(field.type), field.default)
                assert (parameter.annotation, parameter.default) == want
        # every field the call takes is a parameter of the definition, and nothing else but its source
        taken = {*public.call.input_names, *public.call.option_names, *public.call.source_names}
        assert set(declared.parameters) - {"method", "method_params"} == taken, name


@pytest.mark.parametrize("name", ["beta", "eps_high", "temperature", "method", "n", "dro_beta"])
def test_a_module_option_set_as_an_attribute_is_refused(name):
    """``DGPOLoss`` reads ``self.options`` alone: an option or a method parameter set as an attribute (as Liger's
    loss modules read theirs: a beta schedule) would change nothing, so it is refused and the message says how."""
    module = dgpo_ops.DGPOLoss("grpo", eps_high=0.28)
    options = module.options
    with pytest.raises(AttributeError, match=rf"setting DGPOLoss\.{name} would change nothing: .*dataclasses\.replace"):
        setattr(module, name, 0.5)
    assert module.options is options and name not in module.__dict__
    module.options = dataclasses.replace(options, beta=0.5)  # the way it names
    assert module.options.beta == 0.5
    module.step = 3  # an attribute of the caller's own
    assert module.step == 3
