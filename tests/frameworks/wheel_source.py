"""The frameworks' released functions, read from their installed wheels: the oracles of tests/frameworks/.

The frameworks' modules import what a CPU test venv cannot take (ray, deepspeed, vllm, trl's trainer, their
launchers and configs), so a test takes the named definitions out of the installed source file (located
through the distribution's own file list, whose version ``require`` asserts) and executes them, unchanged, in
a namespace that holds only what they call: torch and the few helpers named beside them. Function annotations
are dropped (they name the frameworks' config and typing classes, never read); decorators stay and resolve in
that namespace (SkyRL's ``register_policy_loss`` there fills a dict, the way its registry maps a name to a
loss). Nothing is copied into this repository."""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
import types

import pytest
import torch

import dgpo_ops


def require(distribution: str, version: str) -> None:
    """Skip the calling test module where ``distribution`` is not installed (the main suite; the venv of
    .ci/frameworks_cpu.sh has it, and counts a skip as a failure); fail on another version than
    ``version``."""
    try:
        found = md.version(distribution)
    except md.PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed (.ci/frameworks_cpu.sh installs "
                    f"{distribution}=={version})", allow_module_level=True)
    assert found == version, f"{distribution} {found} is installed; these tests read {version}'s code"


def source_file(distribution: str, path: str):
    """The installed file ``path`` of ``distribution`` (a path its RECORD lists)."""
    listed = {str(file): file for file in md.files(distribution) or ()}
    assert path in listed, f"{distribution} {md.version(distribution)} has no {path}"
    return listed[path].locate()


def _unannotated(node):
    for function in ast.walk(node):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function.returns = None
            arguments = function.args
            for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg,
                             arguments.kwarg):
                if argument is not None:
                    argument.annotation = None
    return node


def load(distribution: str, path: str, names=None, namespace: dict | None = None) -> dict:
    """Execute the top-level definitions ``names`` of ``distribution``'s file ``path`` (a function, a class or
    a constant; ``"Class.method"``: one method of a class, as a plain function taking ``self``; None: the
    whole file, for a module that imports only the standard library) in ``namespace`` (torch is always there),
    in the file's order; returns the namespace. Tracebacks point at the wheel's file and lines."""
    file = source_file(distribution, path)
    tree = ast.parse(file.read_text(), filename=str(file))
    wanted = set(names or ())
    body = list(tree.body) if names is None else []
    for node in tree.body if names is not None else ():
        name = defined_name(node)
        if name in wanted:
            body.append(_unannotated(node))
            wanted.discard(name)
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef) and f"{node.name}.{member.name}" in wanted:
                    wanted.discard(f"{node.name}.{member.name}")
                    member.name = f"{node.name}.{member.name}"
                    body.append(_unannotated(member))
    assert not wanted, f"{path} of {distribution} {md.version(distribution)} defines no {sorted(wanted)}"
    # a module of its own in sys.modules, as dataclasses look their class's module up there
    module = types.ModuleType(f"wheel_source.{distribution}.{path.removesuffix('.py').replace('/', '.')}")
    sys.modules[module.__name__] = module
    scope = module.__dict__
    scope.update({"torch": torch, **(namespace or {})})
    for node in body:
        name = defined_name(node) or ""
        if "." in name and isinstance(node, ast.FunctionDef):  # a method: run as a plain function, kept as
            # "Class.method"
            node.name = "_method"
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(file), "exec"), scope)
            scope[name] = scope.pop("_method")
        else:
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(file), "exec"), scope)
    return scope


def defined_name(node) -> str | None:
    """The name a top-level statement defines: a function's, a class's, a single-target assignment's."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if len(targets) == 1 and isinstance(targets[0], ast.Name):
            return targets[0].id
    return None


def ragged_batch(seed: int, drift: float, rollout_drift: float = 0.0):
    """Ragged responses (lengths 7, 4, 0, 2: one fully masked), float64: ``(logits, targets, mask, old_logp,
    rollout_logp, advantages)``, the old log-probs up to ``drift`` nats from the current ones and the
    rollout's a normal of scale ``rollout_drift`` from the old (the rollout's equal to the old where it is
    0), both at most 0, as log-probs are (dgpo-ops refuses log-probs above 0)."""
    generator = torch.Generator().manual_seed(seed)
    B, T, V = 4, 7, 33
    logits = torch.randn(B, T, V, generator=generator, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (B, T), generator=generator)
    mask = torch.arange(T)[None, :] < torch.tensor([7, 4, 0, 2])[:, None]
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    spread = 2 * torch.rand(B, T, generator=generator, dtype=torch.float64) - 1
    old_logp = (logp + drift * spread).clamp(max=0.0)
    rollout_logp = (old_logp + rollout_drift * torch.randn(B, T, generator=generator,
                                                           dtype=torch.float64)).clamp(max=0.0)
    advantages = torch.randn(B, generator=generator, dtype=torch.float64)
    return logits, targets, mask, old_logp, rollout_logp, advantages


def far_off_policy_batch():
    """``ragged_batch(seed=5, drift=0.05)`` with one scored token whose ratio is ``e^25`` where ``A < 0`` and
    one with ``e^-25`` where ``A > 0``: PPO's unclipped side, beyond dgpo-ops' log-ratio clamp of 20 (old =
    rollout)."""
    logits, targets, mask, old_logp, _, advantages = ragged_batch(seed=5, drift=0.05)
    assert advantages[3] < 0 < advantages[0] and mask[3, 0] and mask[0, 1]
    # the e^-25 token's target made improbable, so that its old log-prob, 25 nats above, is still a log-prob
    logits = logits.clone()
    logits[0, 1, targets[0, 1]] -= 40.0
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    old_logp = old_logp.clone()
    old_logp[3, 0] = logp[3, 0] - 25.0
    old_logp[0, 1] = logp[0, 1] + 25.0
    return logits, targets, mask, old_logp, old_logp, advantages


def at_the_clamp(batch):
    """``batch`` (``far_off_policy_batch``) with its two far tokens just inside dgpo-ops' log-ratio clamp of 20
    (``20 - 1e-9`` nats): where every framework's loss and gradient are dgpo-ops' by definition of its
    straight-through clamp, which takes a token beyond 20 nats as one at 20."""
    logits, targets, mask, old_logp, rollout_logp, advantages = batch
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    old_logp = old_logp.clone()
    old_logp[3, 0] = logp[3, 0] - (20.0 - 1e-9)
    old_logp[0, 1] = logp[0, 1] + (20.0 - 1e-9)
    return logits, targets, mask, old_logp, old_logp, advantages


def assert_beyond_the_clamp(route, oracle_of_batch, *, rtol=1e-6, atol=1e-8, differs=True, **keywords):
    """A token 25 nats off-policy on PPO's unclipped side: the frameworks differ (SkyRL's and OpenRLHF's
    ``torch.clamp`` at 20 stops its gradient, AReaL and ms-swift do not clamp, ``|A| e^25``); dgpo-ops gives
    it the framework's own value and gradient at 20 nats (docs/normalization.md, "Known differences"). Every
    other token is the framework's; ``oracle_of_batch(batch)`` is the framework's loss of the log-probs;
    ``differs``: the far tokens' gradients differ between 25 and 20 nats (not under a dual clip, which caps the
    A < 0 token's loss either way)."""
    far = far_off_policy_batch()
    logits, targets, mask, old_logp, _, advantages = far
    expected, expected_grad = theirs(logits, targets, oracle_of_batch(at_the_clamp(far)))
    beyond, beyond_grad = theirs(logits, targets, oracle_of_batch(far))
    assert differs != torch.allclose(beyond_grad, expected_grad)  # the far tokens are where the frameworks differ
    out, grad = ours(route, logits, targets, advantages, mask, old_logp, **keywords)
    torch.testing.assert_close(out.loss.detach().double(), expected.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(grad.double(), expected_grad.double(), rtol=rtol, atol=atol)
    near = torch.ones(mask.shape, dtype=torch.bool)
    near[3, 0] = near[0, 1] = False
    torch.testing.assert_close(grad[near].double(), beyond_grad[near].double(), rtol=rtol, atol=atol)


ROUTES = ("reference", "fused-torch")


def ours(route: str, logits, targets, advantages, mask, old_logp, **keywords):
    """dgpo-ops' output and d loss / d logits on ``route`` (float64)."""
    leaf = logits.detach().clone().requires_grad_(True)
    if route == "reference":
        out = dgpo_ops.reference_loss(leaf, targets, advantages, mask=mask, old_logps=old_logp, **keywords)
    else:
        out = dgpo_ops.fused_dgpo_loss(leaf, targets, advantages, mask=mask, old_logps=old_logp,
                                       backend=route.split("-")[1], **keywords)
    out.loss.backward()
    return out, leaf.grad


def theirs(logits, targets, loss_of_logp):
    """The framework's scalar loss of the differentiable float64 log-probs, and d loss / d logits."""
    leaf = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(leaf, -1).gather(-1, targets[..., None]).squeeze(-1)
    loss = loss_of_logp(logp)
    loss.backward()
    return loss.detach(), leaf.grad


def assert_same(route, batch, loss_of_logp, *, rtol=1e-6, atol=1e-8, values=True, **keywords):
    """dgpo-ops with ``keywords`` on ``route`` gives the framework's loss (unless not ``values``: a loss whose
    value is defined otherwise, with the same gradient) and logits gradient; returns ours."""
    logits, targets, mask, old_logp, _, advantages = batch
    expected, expected_grad = theirs(logits, targets, loss_of_logp)
    out, grad = ours(route, logits, targets, advantages, mask, old_logp, **keywords)
    if values:
        torch.testing.assert_close(out.loss.detach().double(), expected.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(grad.double(), expected_grad.double(), rtol=rtol, atol=atol)
    return out


def class_defaults(distribution: str, path: str, class_name: str) -> dict:
    """The literal defaults of class ``class_name``'s annotated fields in ``distribution``'s file ``path`` (a
    config dataclass whose bases and field factories need more than a test venv has)."""
    tree = ast.parse(source_file(distribution, path).read_text())
    found = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    assert found, f"{path} of {distribution} {md.version(distribution)} defines no class {class_name}"
    defaults = {}
    for node in found[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            try:
                defaults[node.target.id] = ast.literal_eval(node.value)
            except ValueError:  # field(...) and other expressions: not a literal default
                pass
    return defaults
