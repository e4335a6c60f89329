"""Every name in the method table (docs/methods.md) works wherever a method name is taken: ``reference_loss``,
``fused_dgpo_loss`` (both kernel sets), ``DGPOLoss``, ``fused_linear_dgpo_loss`` and ``method_config``; an
alias is its method with its presets where the caller leaves them unset."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import by_name, docs_tool, logits_batch

import dgpo_ops
from dgpo_ops.methods.table import ALIASES, METHODS

METHODS_PAGE = (Path(__file__).resolve().parents[2] / "docs" / "methods.md").read_text()


def readme_names() -> list[str]:
    """The names of docs/methods.md's table, which the README lists."""
    (section,) = [s for s in docs_tool().SECTIONS if s.page == "docs/methods.md"]
    table = METHODS_PAGE[METHODS_PAGE.index(section.start):METHODS_PAGE.index(section.end)]
    return re.findall(r"^\| `([a-z0-9_]+)` \|", table, re.M)


def test_the_readme_table_lists_every_method_and_alias():
    assert readme_names() == [*METHODS, *ALIASES]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in readme_names())  # the README's list of names


@pytest.mark.parametrize("name", readme_names())
def test_every_readme_name_runs_everywhere(name):
    batch = logits_batch(3, 8, 19, seed=4)
    logits = batch.pop("logits")
    expected = dgpo_ops.reference_loss(logits, **batch, method=name, **by_name(name))
    outputs = [dgpo_ops.fused_dgpo_loss(logits, **batch, method=name, backend=backend, **by_name(name))
               for backend in ("torch", "triton")]
    call = by_name(name)
    generator = call.pop("generator")
    outputs.append(dgpo_ops.DGPOLoss(method=name, **call)(logits, **batch, generator=generator))
    for out in outputs:
        torch.testing.assert_close(out.loss, expected.loss, rtol=2e-5, atol=2e-6)


def test_fused_linear_takes_every_name():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(17, 8, generator=g)
    batch = logits_batch(2, 5, 17, seed=1, logits=hidden @ weight.t())
    batch.pop("logits")
    for name in readme_names():
        out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **batch, method=name, **by_name(name))
        ref = dgpo_ops.reference_loss(hidden @ weight.t(), **batch, method=name, **by_name(name))
        torch.testing.assert_close(out.loss, ref.loss, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", list(ALIASES))
def test_alias_is_its_method_with_presets_where_unset(name):
    alias = ALIASES[name]
    assert dgpo_ops.method_config(name) == dgpo_ops.method_config(alias.method, **alias.params)
    given = {param: value / 2 for param, value in alias.params.items()}  # the caller's value wins
    assert dgpo_ops.method_config(name, **given) == dgpo_ops.method_config(alias.method, **given)
    batch = logits_batch(3, 8, 19, seed=2)
    logits = batch.pop("logits")
    torch.testing.assert_close(dgpo_ops.fused_dgpo_loss(logits, **batch, method=name).loss,
                               dgpo_ops.fused_dgpo_loss(logits, **batch, method=alias.method, **alias.params).loss)
