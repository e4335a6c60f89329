"""The package's imports run one way: every import of every module (function-local ones included) is
parsed, and the test fails on any cycle between modules and on any import from a lower part of the
architecture to a higher one.

The checkout's three parts are the folders ``kernels/`` (installed as ``dgpo_ops.kernels``), ``dgpo_ops/``
and ``trainer/`` (installed as ``dgpo_ops.trainer``). Their layers, lowest first (docs/design.md, "Layout"):

    kernels -> methods -> corrections -> frameworks -> core -> layouts -> ops -> distributed -> api -> integrations | trainer -> app

``dgpo_ops.kernels`` imports nothing else of the package; ``dgpo_ops.api`` and the package's own
``__init__`` are the public front; ``integrations`` and ``trainer`` (the library: ``DGPOTrainer``,
``DGPOConfig``) sit side by side on top of it and do not import each other. The ``dgpo-ops`` command and its
``train`` app (``trainer/app/``, installed as ``dgpo_ops.trainer.app``) are the top, the one part that may
import all the others; the trainer library imports nothing of it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dgpo_ops"
# Each folder of the checkout and the package it installs as (pyproject.toml's package-dir).
PARTS = {REPO / "kernels": "dgpo_ops.kernels", PACKAGE: "dgpo_ops", REPO / "trainer": "dgpo_ops.trainer"}
LAYERS = {"kernels": 0, "methods": 1, "corrections": 1.5, "frameworks": 1.75, "core": 2, "layouts": 3, "ops": 4,
          "distributed": 5, "api": 6, "integrations": 7, "trainer": 7, "app": 8}
APP = "dgpo_ops.trainer.app"
# The folder of each layer outside dgpo_ops/ (the others are dgpo_ops/<layer>)
FOLDERS = {"kernels": REPO / "kernels", "trainer": REPO / "trainer", "app": REPO / "trainer" / "app"}


def part_folder(part: str) -> pathlib.Path:
    return FOLDERS.get(part, PACKAGE / part)


def module_name(path: pathlib.Path, folder: pathlib.Path) -> str:
    parts = (*PARTS[folder].split("."), *path.relative_to(folder).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, pathlib.Path]:
    modules = {}
    for folder in PARTS:
        modules.update({module_name(path, folder): path for path in folder.rglob("*.py")})
    return modules


def imported_modules(name: str, path: pathlib.Path, modules) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            # `from pkg import sub` imports the submodule sub where there is one
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` names a module or a name in one
                target = target.rpartition(".")[0]
            if target.startswith("dgpo_ops") and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "api":
        return "api"
    if module == APP or module.startswith(APP + "."):
        return "app"
    return parts[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_function_local_imports():
    # The check is only as good as the parser: a local import must count as an edge.
    graph = import_graph()
    assert "dgpo_ops.trainer.app.cli" in graph["dgpo_ops.trainer.app.command"]  # imported inside main()
    assert "dgpo_ops.trainer.vllm_cpu" in graph["dgpo_ops.trainer.trainer"]  # inside DGPOTrainer.__init__
    assert "dgpo_ops.kernels.interface" in graph["dgpo_ops.core.validation"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_run_down_the_layers():
    upward = []
    for module, targets in import_graph().items():
        for target in targets:
            source_layer, target_layer = layer_of(module), layer_of(target)
            if source_layer == target_layer:
                continue
            if LAYERS[target_layer] >= LAYERS[source_layer]:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_the_trainer_library_imports_nothing_of_the_app():
    """``DGPOTrainer`` and ``DGPOConfig`` work without the ``dgpo-ops train`` app: no module of ``trainer/``
    outside ``trainer/app/`` imports one inside it (function-local imports included)."""
    graph = import_graph()
    assert APP in graph and any(module.startswith(APP + ".") for module in graph)
    library = [module for module in graph if module.startswith("dgpo_ops.trainer") and layer_of(module) == "trainer"]
    assert "dgpo_ops.trainer.trainer" in library and "dgpo_ops.trainer.config" in library
    assert sorted(f"{module} -> {target}" for module in library for target in graph[module]
                  if layer_of(target) == "app") == []


def test_the_layer_check_refuses_a_library_import_of_the_app():
    assert LAYERS[layer_of("dgpo_ops.trainer.app.cli")] > LAYERS[layer_of("dgpo_ops.trainer.trainer")]
    assert layer_of(APP) == "app" and layer_of("dgpo_ops.trainer.apparatus") == "trainer"


@pytest.mark.parametrize("part", sorted(set(LAYERS) - {"api"}))
def test_every_part_is_a_folder(part):
    assert (part_folder(part) / "__init__.py").is_file()


def test_no_module_outside_a_part():
    loose = sorted(path.name for path in PACKAGE.glob("*.py") if path.stem not in ("__init__", "api"))
    assert loose == []


def test_the_three_parts_are_the_checkout_top_level():
    # kernels/ and trainer/ are not nested in dgpo_ops/: the checkout's layout, mapped by pyproject.toml
    assert not (PACKAGE / "kernels").exists() and not (PACKAGE / "trainer").exists()
    assert {module.split(".")[1] for module in all_modules() if module.count(".")} >= {"kernels", "trainer"}
