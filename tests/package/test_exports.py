"""What ``dgpo_ops`` exports: an explicit ``__all__``, each name bound where static tools see it (an import
or an assignment in dgpo_ops/__init__.py, nothing made through ``globals()``), and every method's config
class of the method table among them."""

from __future__ import annotations

import ast
import pathlib

import dgpo_ops
from dgpo_ops.methods.table import METHODS


def _statically_bound() -> set[str]:
    """The names dgpo_ops/__init__.py binds as a type checker reads it (``if TYPE_CHECKING:`` blocks included:
    ``linear_logprob_entropy`` is bound on first access at run time, by the module's ``__getattr__``)."""
    tree = ast.parse(pathlib.Path(dgpo_ops.__file__).read_text())
    bound = set()
    nodes = [*tree.body]
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            nodes += node.body
    for node in nodes:
        if isinstance(node, ast.ImportFrom | ast.Import):
            bound |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Assign):
            bound |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
    calls = {node.func.id for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "globals" not in calls, "dgpo_ops/__init__.py binds names through globals()"
    return bound


def test_every_export_is_bound_where_static_tools_see_it():
    exported = dgpo_ops.__all__
    assert len(exported) == len(set(exported))
    assert set(exported) <= _statically_bound(), set(exported) - _statically_bound()
    for name in exported:
        assert getattr(dgpo_ops, name) is not None, name


def test_every_method_config_class_is_exported_by_name_in_the_tables_order():
    configs = [spec.config for spec in METHODS.values()]
    listed = [name for name in dgpo_ops.__all__ if name.endswith("Config") and name != "MethodConfig"]
    assert listed == [config.__name__ for config in configs]
    for config in configs:
        assert getattr(dgpo_ops, config.__name__) is config
