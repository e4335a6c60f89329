"""Launch wrappers bound once per plan template: the launch a wrapper makes, recorded at its first call and replayed
with the next calls' tensors, without the wrapper's Python.

A launch wrapper (``kernels/logprob_entropy.py``'s ``logprob_entropy``, ``kernels/prologue.py``'s
``token_prologue``, ``kernels/logits_grad.py``'s ``logits_grad``) turns its arguments into one
``kernel[grid](*args, **kwargs)`` launch: strides, sizes, block sizes, warps and constexpr flags worked out again
on every call, though for the calls of one ``PlanTemplate`` (one input signature, ``dgpo_ops.ops.plan_cache``)
only the tensors change. ``BoundLaunch`` runs the wrapper itself the first time, in a copy whose kernel names
resolve to recorders (the module's own kernels stay as they are for every other caller and thread), and keeps
its one launch: the grid, the non-tensor arguments as constants, and for each tensor argument where in the call's
arguments the wrapper found it (``args[2].per_token``). Later calls fill those slots from their own arguments and
launch the same kernel object the same way, so Triton still binds and specialises every launch itself (a pointer's
alignment is read from the call's tensor there): no kernel compiled for other arguments runs.

What a replay compares, and what it takes on trust: the wrapper's other inputs (every scalar and every None in the
call's arguments, and which tensors were one object) are compared with the recorded call's, and on any difference
the wrapper runs instead; the tensors' metadata (shapes, strides, dtypes, devices), from which the wrapper works out
the rest, is taken as the recorded call's, which the template's signature guarantees. No launch argument depends
on a tensor's values or address. ``tests/ops/test_plan_cache.py`` compares replayed launches with the wrapper's
own over the signatures the suite exercises. A first call that cannot be replayed this way (no launch or several,
a tensor argument found nowhere in the call's arguments, an empty grid's early return) leaves the wrapper to run
on every call.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from triton.runtime.jit import KernelInterface

# How deep into the wrapper's arguments a tensor is looked for: a tuple holding a dataclass holding it
# (``finalize=(workspace, has_kl)``: ``workspace.per_token``).
_SEARCH_DEPTH = 3


class BoundLaunch:
    """``wrapper`` bound on its first call: called as the wrapper is, it launches what the wrapper would."""

    def __init__(self, wrapper):
        self.wrapper = wrapper
        self.replay = None  # (args, kwargs) -> the wrapper's result, or _MISMATCH
        self.unbound = False  # the first call could not be recorded: the wrapper runs on every call

    def __call__(self, *args, **kwargs):
        replay = self.replay
        if replay is not None:
            result = replay(args, kwargs)
            if result is not _MISMATCH:
                return result
            return self.wrapper(*args, **kwargs)
        if self.unbound or not isinstance(self.wrapper, types.FunctionType):
            self.unbound = True
            return self.wrapper(*args, **kwargs)
        launches, result = _recorded_call(self.wrapper, args, kwargs)
        self.replay = _replay(launches[0], result, args, kwargs) if len(launches) == 1 else None
        self.unbound = self.replay is None
        return result


def bind_launches(kernels):
    """``kernels`` (a ``RowKernels``) with its launch wrappers bound (``BoundLaunch``): the Triton set's; the torch
    twins launch nothing and stay as they are."""
    if kernels.name != "triton":
        return kernels
    return dataclasses.replace(kernels, forward=BoundLaunch(kernels.forward), prologue=BoundLaunch(kernels.prologue),
                               backward=BoundLaunch(kernels.backward))


@dataclasses.dataclass(frozen=True)
class _Launch:
    kernel: KernelInterface
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands for a kernel in the wrapper's copy: records each launch, then makes it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(_Launch(self.kernel, grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _recorded_call(wrapper, args, kwargs):
    """Run ``wrapper`` once, its kernels recorded: ``(launches, result)``."""
    launches: list[_Launch] = []
    names = set(wrapper.__code__.co_names)
    for const in wrapper.__code__.co_consts:  # the names its nested functions read
        if isinstance(const, types.CodeType):
            names |= set(const.co_names)
    module_globals = dict(wrapper.__globals__)
    for name in names:
        value = module_globals.get(name)
        if isinstance(value, KernelInterface):
            module_globals[name] = _Recorder(value, launches)
    copy = types.FunctionType(wrapper.__code__, module_globals, wrapper.__name__, wrapper.__defaults__,
                              wrapper.__closure__)
    copy.__kwdefaults__ = wrapper.__kwdefaults__
    return launches, copy(*args, **kwargs)


def _leaves(args, kwargs):
    """Every leaf of the call's arguments: ``(path, value)`` for each tensor, None and other value reachable from
    the positional ``(i, ...)`` and keyword ``(name, ...)`` arguments through tuple indices and dataclass field
    names (a dict is a leaf, not compared: ``RowInputs.objective_inputs``, which no kernel reads)."""
    leaves = []

    def visit(value, path):
        if len(path) < _SEARCH_DEPTH and isinstance(value, (tuple, list)) and not torch.is_tensor(value):
            for index, item in enumerate(value):
                visit(item, path + (index,))
        elif len(path) < _SEARCH_DEPTH and dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name), path + (field.name,))
        else:
            leaves.append((path, value))

    for index, value in enumerate(args):
        visit(value, (index,))
    for name, value in kwargs.items():
        visit(value, (name,))
    return leaves


def _expression(path: tuple) -> str:
    """The source text that reads ``path`` from ``args`` and ``kwargs``."""
    head, text = path[0], ""
    for step in path[1:]:
        if isinstance(step, int):
            text += f"[{step}]"
        elif step.isidentifier():
            text += f".{step}"
        else:
            raise AssertionError(f"not a field name: {step!r}")
    return (f"args[{head}]" if isinstance(head, int) else f"kwargs[{head!r}]") + text


_MISMATCH = object()  # a replay's answer to a call that is not like the recorded one: the wrapper runs instead
_COMPARED = (bool, int, float, str, type(None), torch.dtype, torch.device)  # leaves compared by value


def _replay(launch: _Launch, result, args, kwargs):
    """The recorded launch as a function ``(args, kwargs) -> result`` (or ``_MISMATCH``), or None where it cannot be
    replayed. It is written out as source once (this is the per-call path whose Python is being cut): the guards,
    then one launch whose tensor arguments are read from the call's arguments where the recorded call had them.

    Guards: the same number of positional arguments and the same keywords; every non-tensor leaf (a scalar, a
    None) equal to the recorded one, so the wrapper would decide as it did; tensors that were one object at several
    places (the workspace's scales, also in ``finalize``) one object again. A tensor leaf is taken as it comes:
    the template's signature fixes which inputs are passed and their metadata."""
    if any(torch.is_tensor(v) for v in launch.kwargs.values()):
        return None
    leaves = _leaves(args, kwargs)
    where: dict[int, list[tuple]] = {}
    namespace = {"_MISMATCH": _MISMATCH, "_kernel": launch.kernel, "_grid": launch.grid, "_kwargs": launch.kwargs,
                 "_keywords": frozenset(kwargs)}
    guards = [f"len(args) != {len(args)}", "kwargs.keys() != _keywords"]
    for path, value in leaves:
        if torch.is_tensor(value):
            where.setdefault(id(value), []).append(path)
        elif value is None:
            guards.append(f"{_expression(path)} is not None")
        elif type(value) in _COMPARED or isinstance(value, (int, float)):  # enums are ints
            name = f"_c{len(namespace)}"
            namespace[name] = value
            guards.append(f"{_expression(path)} != {name}")
        elif not isinstance(value, dict):
            return None  # an object the wrapper might read anything of
    values = []
    for position, value in enumerate(launch.args):
        if torch.is_tensor(value):
            if id(value) not in where:
                return None  # made by the wrapper itself, not one of the call's
            values.append(_expression(where[id(value)][0]))
        else:
            name = f"_c{len(namespace)}"
            namespace[name] = value
            values.append(name)
    if result is None:
        returned = "None"
    elif torch.is_tensor(result) and id(result) in where:
        returned = _expression(where[id(result)][0])
    else:
        return None
    for paths in where.values():
        guards += [f"{_expression(path)} is not {_expression(paths[0])}" for path in paths[1:]]
    source = (f"def replay(args, kwargs):\n"
              f"    if {' or '.join(guards)}:\n"
              f"        return _MISMATCH\n"
              f"    _kernel[_grid]({', '.join(values)}, **_kwargs)\n"  # indexed per launch, as the wrapper does
              f"    return {returned}\n")
    exec(compile(source, f"<replay of {launch.kernel}>", "exec"), namespace)  # noqa: S102
    replay = namespace["replay"]
    replay.source = source
    return replay
