"""The public functions' keyword signatures, generated from the call object's fields.

A loss call is its source (logits, or hidden states and the lm_head), ``LossInputs`` (the tensors) and
``LossOptions`` (everything else). Each public function takes some of those fields as keywords: ``CallSignature``
names which, and ``split`` turns a call's arguments back into the two objects. A keyword it does not take is a
``ValueError``, as a method parameter the method lacks; argument errors of Python's own kind (a missing or repeated
argument, too many positional ones) are ``TypeError``. So a field added to either class
is a keyword of every function that lists it, with the docstring text of ``dgpo_ops.core.docstrings``, and no
signature restates it. ``split`` runs on every call and under ``torch.compile`` (dynamo traces it): plain dict and
tuple work, no ``inspect`` at call time.

Each public function is also a real definition in ``dgpo_ops/api.py``, written from its ``PublicFunction`` by
``python docs/generate.py``: its annotated parameters are what an IDE, a type checker and ``grep`` see, and
``PublicFunction.define`` turns it into the function that runs.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from dgpo_ops.core.docstrings import documented
from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.core.options import LossOptions

INPUT_FIELDS = LossInputs._fields
OPTION_FIELDS = tuple(name for name in LossOptions.__dataclass_fields__ if name != "method")
# the tensors a loss call takes by position after its source, as TRL's and verl's losses order them
POSITIONAL_INPUTS = ("target_ids", "advantages", "mask", "old_logps", "ref_logps")
PROJECTION_OPTIONS = ("logit_scale", "softcap", "memory_budget", "logits_on_chip")
_REQUIRED_INPUTS = ("target_ids", "advantages")
# The annotations of the parameters that are no field (the source, the method and its parameters), as source
# text: the names they use are imported where the definitions are (dgpo_ops/api.py).
SOURCE_ANNOTATIONS = {"logits": "torch.Tensor", "hidden": "torch.Tensor",
                      "weight": "torch.Tensor | torch.nn.Module", "bias": "torch.Tensor | None"}
METHOD_ANNOTATION = "str | MethodConfig"
METHOD_PARAMS_ANNOTATION = "Any"


def field_annotation(annotation) -> str:
    """A field's annotation as source text, without the ``Annotated`` marks only the package reads
    (``TokenFloat``)."""
    text = getattr(annotation, "__forward_arg__", annotation)  # a NamedTuple keeps it as a ForwardRef
    tree = ast.parse(text, mode="eval").body
    if isinstance(tree, ast.Subscript) and isinstance(tree.value, ast.Name) and tree.value.id == "Annotated":
        return ast.unparse(tree.slice.elts[0])
    return text


_INPUT_ANNOTATIONS = {name: field_annotation(annotation)
                      for name, annotation in LossInputs.__annotations__.items()}
_OPTION_ANNOTATIONS = {name: field_annotation(LossOptions.__dataclass_fields__[name].type)
                       for name in OPTION_FIELDS}


class CallSignature:
    """Which of the call object's fields a public function takes, in what order, and how a call's arguments
    become ``(source values, LossInputs, LossOptions)``.

    ``source``: the leading positional parameters that are not inputs (``logits``; ``hidden``, ``weight``), or
    keyword-only ones (``bias``); ``positional``: the inputs taken by position after them; ``inputs`` and
    ``options``: the keyword fields, in signature order (None: all, less ``without``); ``method``: whether the
    function takes ``method`` and the method's own parameters (``**method_params``); ``default_method``: the
    method of a call that names none; ``refusals``: for a field it does not take, why (the error says so)."""

    def __init__(self, source=(), keyword_source=(), positional=POSITIONAL_INPUTS, inputs=None, options=None,
                 without=(), method=True, default_method="dgpo", refusals=None):
        self.source = tuple(source)
        self.keyword_source = tuple(keyword_source)
        self.positional = self.source + tuple(positional)
        self.inputs = tuple(name for name in (INPUT_FIELDS if inputs is None else inputs)
                            if name not in without and name not in positional)
        self.options = tuple(name for name in (OPTION_FIELDS if options is None else options) if name not in without)
        unknown = set(self.inputs) - set(INPUT_FIELDS) | set(self.options) - set(OPTION_FIELDS)
        if unknown:
            raise AssertionError(f"not fields of LossInputs or LossOptions: {sorted(unknown)}")
        self.method, self.default_method = method, default_method
        self.refusals = refusals or {}
        self.input_names = frozenset(positional) | frozenset(self.inputs)
        self.option_names = frozenset(self.options)
        self.source_names = self.positional[:len(self.source)] + self.keyword_source
        self.known = self.input_names | self.option_names | frozenset(self.source_names) | (
            frozenset({"method"}) if method else frozenset())
        # made once for split, which runs on every call: the arguments a call may not leave out, and the fields
        # this function does not take (a keyword that names one is refused, not read as a method parameter)
        self.required = tuple(name for name in self.source + _REQUIRED_INPUTS if name in self.positional)
        self.not_taken = frozenset(INPUT_FIELDS) - self.input_names | frozenset(OPTION_FIELDS) - self.option_names
        self.signature = inspect.Signature(self._parameters(positional))

    def _parameters(self, positional) -> list[inspect.Parameter]:
        positional_kind, keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
        option_fields, input_defaults = LossOptions.__dataclass_fields__, LossInputs._field_defaults
        inputs, options, sources = _INPUT_ANNOTATIONS, _OPTION_ANNOTATIONS, SOURCE_ANNOTATIONS
        params = [inspect.Parameter(name, positional_kind, annotation=sources[name]) for name in self.source]
        params += [inspect.Parameter(name, positional_kind, annotation=inputs[name],
                                     default=input_defaults.get(name, inspect.Parameter.empty))
                   for name in positional]
        params += [inspect.Parameter(name, keyword, default=None, annotation=sources[name])
                   for name in self.keyword_source]
        if self.method:
            params.append(inspect.Parameter("method", keyword, default=self.default_method,
                                            annotation=METHOD_ANNOTATION))
        params += [inspect.Parameter(name, keyword, default=input_defaults[name], annotation=inputs[name])
                   for name in self.inputs]
        params += [inspect.Parameter(name, keyword, default=option_fields[name].default,
                                     annotation=options[name]) for name in self.options]
        if self.method:
            params.append(inspect.Parameter("method_params", inspect.Parameter.VAR_KEYWORD,
                                            annotation=METHOD_PARAMS_ANNOTATION))
        return params

    def split(self, function: str, args: tuple, kwargs: dict, options: LossOptions | None = None):
        """``(source values, LossInputs, LossOptions)`` of one call of ``function``; ``options``: fixed ones (a
        module's), then the call passes none. Argument errors are ``TypeError``, as Python's own."""
        if len(args) > len(self.positional):
            raise TypeError(f"{function}() takes at most {len(self.positional)} positional arguments "
                            f"({', '.join(self.positional)}), got {len(args)}")
        values = dict(zip(self.positional, args))
        for name, value in kwargs.items():
            if name in values:
                raise TypeError(f"{function}() got multiple values for argument {name!r}")
            if name not in self.known and (options is not None or not self.method):
                self._refuse(function, name)
            values[name] = value
        missing = [name for name in self.required if name not in values]
        if missing:
            raise TypeError(f"{function}() missing required argument(s): {', '.join(map(repr, missing))}")
        source = tuple([values.pop(name, None) for name in self.source_names])
        fields, rest = {"advantages": None}, {}  # a function without advantages (log-probs) makes its own
        for name, value in values.items():
            if name in self.input_names:
                fields[name] = value
            else:
                rest[name] = value
        inputs = LossInputs(**fields) if "target_ids" in self.input_names else None  # None: options only
        if options is None:
            method = rest.pop("method", self.default_method) if self.method else self.default_method
            misplaced = [name for name in rest if name in self.not_taken]
            if misplaced:  # a field this function does not take: not a method parameter either
                self._refuse(function, misplaced[0])
            options = LossOptions.build(method, **rest)
        return source, inputs, options

    def _refuse(self, function: str, name: str):
        """A keyword this function does not take: ``ValueError``, as an unknown method parameter gets."""
        why = self.refusals.get(name, "not an argument of this function (its signature lists them)")
        raise ValueError(f"{function}() got an unexpected keyword argument {name!r}: {why}")


Declared = TypeVar("Declared", bound=Callable[..., Any])


class PublicFunction:
    """A public function: the fields it takes (``call``), its docstring's ``summary`` and ``returns`` text
    (None: a ``PolicyLossOutput``), its return annotation, and ``body(source values, LossInputs,
    LossOptions)``, what each call runs."""

    def __init__(self, call: CallSignature, summary: str, body, returns: str | None = None,
                 return_annotation: str = "PolicyLossOutput"):
        self.call, self.summary, self.body, self.returns = call, summary, body, returns
        self.signature = call.signature.replace(return_annotation=return_annotation)
        self.declaration = None

    def define(self, declaration: Declared) -> Declared:
        """The function that ``declaration``, its definition in the source, declares: each call goes through
        ``split`` (whose errors name the function and say why a keyword is refused) and runs ``body``; its
        signature is ``self.signature``, its docstring composed from the shared argument texts. The
        declaration itself never runs: it is what readers and tools see, and the return type is the
        declaration's, so a type checker checks calls against its signature."""
        name, call, body = declaration.__name__, self.call, self.body

        def function(*args, **kwargs):
            return body(*call.split(name, args, kwargs))

        function.__name__ = function.__qualname__ = name
        function.__module__ = "dgpo_ops"
        function.__signature__ = self.signature
        self.declaration = declaration  # what tests/core/test_call.py compares with self.signature
        return documented(self.summary, self.returns)(function)
