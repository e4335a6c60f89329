"""No fall-through: each correction module dispatches its modes, levels and gates through tables keyed by every
value its fields take, checked when the module is imported (``check_dispatch``), so a value added to a field's
list without its branch stops the import; and the tables give each mode its documented math
(docs/corrections.md)."""

from __future__ import annotations

import math

import pytest
import torch

from dgpo_ops.corrections import TrlCorrection, areal, swift, tis, trl, verl
from dgpo_ops.corrections.core import CorrectionInputs, check_branches

# (module, the tuple of a field's values, a value without a branch)
UNBRANCHED = [
    (trl, "TRL_MODES", "token_clip"),
    (swift, "SWIFT_MODES", "sequence_geometric"),
    (verl, "IS_LEVELS", "chunk"),
    (verl, "RS_OPTIONS", "seq_min_k2"),  # a level without its reduction
    (verl, "RS_OPTIONS", "token_k4"),  # an estimator without its bounds
    (tis, "TIS_TYPES", "seq-clip-tis"),
    (tis, "OPENRLHF_LEVELS", "chunk"),
    (tis, "OPENRLHF_MODES", "clamp"),  # no ratio scheme for (token, clamp), (seq, clamp)
    (tis, "OPENRLHF_GATINGS", "js"),
    (areal, "LEVELS", "chunk"),
    (areal, "ACTIONS", "rescale"),
    (areal, "METRICS", "kl_k4"),
    (areal, "AGGREGATIONS", "min"),
]


@pytest.mark.parametrize("module,field,value", UNBRANCHED, ids=lambda v: getattr(v, "__name__", v))
def test_a_value_without_its_branch_stops_the_import(monkeypatch, module, field, value):
    module.check_dispatch()  # the tables as they are: complete
    monkeypatch.setattr(module, field, (*getattr(module, field), value))
    with pytest.raises(AssertionError, match="no branch for"):
        module.check_dispatch()


@pytest.mark.parametrize("module,patch", [
    (verl, lambda monkeypatch: monkeypatch.setattr(verl, "KL_ESTIMATORS", ("k1", "k2"))),  # k3 not computed
    (areal, lambda monkeypatch: monkeypatch.setitem(areal.METRIC_ESTIMATORS, "kl_k3", "k4")),
    (tis, lambda monkeypatch: monkeypatch.setitem(tis.RATIO_SCHEMES, ("token", "mask"), "icepop2")),
], ids=["verl", "areal", "openrlhf"])
def test_a_branch_naming_what_does_not_exist_stops_the_import(monkeypatch, module, patch):
    patch(monkeypatch)
    with pytest.raises(AssertionError, match="are not among"):
        module.check_dispatch()


def test_a_branch_for_no_value_is_refused_too():
    check_branches("mode", ("a", "b"), {"a": 1, "b": 2})
    with pytest.raises(AssertionError, match=r"a branch for no value \['c'\]"):
        check_branches("mode", ("a", "b"), {"a": 1, "b": 2, "c": 3})


def test_each_trl_mode_is_its_documented_math():
    """docs/corrections.md: token_* weigh each token by its own ratio, sequence_* by the product over its
    response; *_truncate clamp into [clip_min, clip_max], *_mask zero outside it (the bounds kept)."""
    log_ratio = torch.log(torch.tensor([0.25, 2.0, 0.5, 4.0, 1.5]))
    x = CorrectionInputs(old_logps=log_ratio, rollout_logps=torch.zeros(5), mask=torch.ones(5, dtype=torch.bool),
                         sequence=torch.tensor([0, 0, 1, 1, 1]), n_sequences=2)
    token = torch.tensor([0.25, 2.0, 0.5, 4.0, 1.5])
    sequence = torch.tensor([0.5, 0.5, 3.0, 3.0, 3.0])  # 0.25 * 2, 0.5 * 4 * 1.5
    low, high = 0.5, 2.0
    documented = {"token_truncate": token.clamp(low, high), "sequence_truncate": sequence.clamp(low, high),
                  "token_mask": torch.where((token >= low) & (token <= high), token, 0.0),
                  "sequence_mask": torch.where((sequence >= low) & (sequence <= high), sequence, 0.0)}
    assert set(documented) == set(trl.TRL_MODES)
    for mode, want in documented.items():
        weights = TrlCorrection(mode, low, high)(x).weights
        torch.testing.assert_close(weights, want, rtol=1e-6, atol=0, msg=mode)
        assert TrlCorrection(mode, low, high).sequence_level == mode.startswith("sequence_"), mode
    assert math.isclose(float(TrlCorrection("token_mask", low, high)(x).weights[1]), 2.0)  # the bound is kept
