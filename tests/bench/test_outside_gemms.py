"""The fused-linear op moves nothing outside its GEMMs and row kernels that the math does not need
(bench/outside_gemms.py): no zero-fill, no copy of the weight, no tile-sized pass on the device path, one
scale-and-cast per gradient. The counts are derived here from the tiles and vocabulary blocks of the call, so a
pass that comes back, or a cast per block that stops being one, fails."""

from __future__ import annotations

import pytest
import torch

from bench.outside_gemms import SETTINGS, SHAPE, count_setting
from dgpo_ops.kernels.interface import cdiv
from dgpo_ops.ops.linear import vocab_block_rows

# The counts do not depend on values or time: the module's cases run on one xdist worker.
pytestmark = pytest.mark.xdist_group("outside_gemms")


def expected_ops(setting: str, tiles: int, level: str, bias: bool) -> dict:
    """``{phase: {"kind: op": calls}}`` of one forward + backward on the CPU's torch twins."""
    dtype, autocast = SETTINGS[setting]
    budget = SHAPE["tile_rows"] * SHAPE["V"] * (4 if dtype == torch.float32 and autocast is None else 2)
    weight = torch.empty(SHAPE["V"], SHAPE["H"])
    blocks = cdiv(SHAPE["V"], vocab_block_rows(budget, weight))
    # casts of an operand on its way to the CPU's fp32 products: none for fp32 weights; bf16 -> fp32 for bf16
    # ones; fp32 -> bf16 -> fp32 under autocast (a GPU casts once, to bf16)
    casts = 0 if dtype == torch.float32 and autocast is None else 1 if autocast is None else 2
    logits_sweeps = 1 if level == "token" else 2  # GSPO recomputes the tiles for its gradients
    forward = {"hidden: where": tiles}  # G^T H reads the hidden states of tokens not scored as 0
    if casts:
        # each weight block cast where it is multiplied, in the logits and the d hidden GEMMs, in every tile
        forward["weight block: _to_copy"] = (logits_sweeps + 1) * tiles * blocks * casts
        forward["hidden: _to_copy"] = (logits_sweeps + 1) * tiles * casts  # the tile's hidden states, ditto
        # CPU only: each block's fp32 product (plus the bias) rounded into the bf16 tile, and the bf16 gradient
        # tile cast for the fp32 products that read it; a GPU's GEMMs write and read bf16 themselves
        forward["tile: copy_"] = logits_sweeps * tiles * blocks
        forward["tile: _to_copy"] = tiles
        if bias:
            forward["tile: add_"] = logits_sweeps * tiles * blocks
    if bias:
        forward["tile: sum"] = tiles  # d bias: the column sums of the gradient tile
    # the backward scales each gradient once, cast to its input's dtype where that differs
    backward = {"weight: mul": 1, "hidden: mul": 1}
    return {"forward": forward, "backward": backward}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("level", ["token", "sequence"])  # sequence: GSPO, the gradients in a second sweep
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_nothing_outside_the_gemms_but_what_the_math_needs(setting, level, bias):
    result = count_setting(setting, level=level, bias=bias)
    ops = result["ops"]
    expected = expected_ops(setting, result["tiles"], level, bias)
    if bias:  # the bias's gradient is scaled once too (not weight- nor hidden-sized: counted as small)
        assert result["counts"]["backward"]["small"] >= 1
    assert ops == expected
    assert result["counts"]["forward"].get("weight", 0) == 0  # no copy of the weight, no zero-filled accumulator


def test_the_counter_sees_a_zero_fill_and_a_weight_copy(monkeypatch):
    # the counter's own check: accumulators zero-filled and the weight copied whole show up as weight-sized
    # passes
    from dgpo_ops.ops import linear

    monkeypatch.setattr(linear, "vocab_block_rows", lambda budget, weight: weight.shape[0])
    original = torch.empty

    def zeroed(*args, **kwargs):
        return original(*args, **kwargs).zero_()

    monkeypatch.setattr(linear.torch, "empty", zeroed)
    ops = count_setting("autocast over fp32 weights")["ops"]["forward"]
    assert ops.get("weight: zero_", 0) >= 1 and ops.get("weight: _to_copy", 0) >= 2
