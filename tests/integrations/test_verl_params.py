"""The verl integration's parts that need no verl (dgpo_ops/integrations/verl_params.py): its table in
docs/integrations.md, where a loss's parameters come from, and verl's aggregations as per-token scales. verl
itself is the oracle in tests/integrations/test_verl.py, which runs in verl's own venv (.ci/verl_cpu.sh)."""

from __future__ import annotations

import pathlib

import pytest
import torch
from helpers import value_error_message

from dgpo_ops.integrations import verl_params

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_verl_table_names_every_loss_mode():
    """docs/integrations.md's table of verl loss names (the README links it; ``docs/generate.py`` writes it from
    ``verl_params``' mapping, tests/package/test_generated_docs.py keeps it current) names every
    method and alias."""
    page = (REPO / "docs" / "integrations.md").read_text()
    for mode in verl_params.LOSS_MODES:
        assert f"`{mode}`" in page


class ActorFields(dict):
    """A stand-in for verl's actor config: a mapping of its fields."""


def test_parameters_come_from_method_params_then_verl_fields_then_defaults():
    config = ActorFields(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0,
                         tau_neg=1.05, policy_loss=ActorFields(method_params={"n": 2.0}))
    method = verl_params.loss_options("dgpo_ops.dgpo", config).method
    assert (method.eps_low, method.eps_high, method.n, method.m) == (0.2, 0.28, 2.0, 2.0)  # low: clip_ratio
    plain = {**config, "policy_loss": ActorFields()}  # verl's own PolicyLossConfig: no method_params
    dcpo = verl_params.loss_options("dgpo_ops.dcpo", plain).method  # DCPO's eps are not verl's clip
    assert (dcpo.eps_low, dcpo.eps_high) == (0.16, 0.2)
    assert verl_params.loss_options("dgpo_ops.grpo", plain).method.dual_clip == 3.0
    assert "policy_loss.method_params.r_max" in value_error_message(
        lambda: verl_params.loss_options("dgpo_ops.dgpo", {**config, "policy_loss": {"method_params": {"r_max": 2}}}))
    assert "clip_ratio_c" in value_error_message(
        lambda: verl_params.loss_options("dgpo_ops.aspo", {**plain, "clip_ratio_c": 0.5}))


@pytest.mark.parametrize("mode", verl_params.LOSS_AGG_MODES)
def test_verl_token_scales_sum_to_verl_normalisation(mode):
    """Per-token scales: with a mask of known counts the sum of each response's scales is what verl's
    agg_loss gives a loss of 1 per token (its arithmetic, written out here for this mask)."""
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    info = {"dp_size": 2, "batch_num_tokens": 10, "global_batch_size": 6, "loss_scale_factor": 8}
    scales = verl_params.verl_token_scales(mask, mode, info, torch.float64)
    per_response = {"token-mean": [3 / 10 * 2, 0, 1 / 10 * 2], "token-sum": [3 * 2, 0, 1 * 2],
                    "seq-mean-token-sum": [3 / 6 * 2, 0, 1 / 6 * 2],
                    "seq-mean-token-sum-norm": [3 / 6 * 2 / 8, 0, 1 / 6 * 2 / 8],
                    "seq-mean-token-mean": [1 / 6 * 2, 0, 1 / 6 * 2]}[mode]
    torch.testing.assert_close(scales.sum(-1), torch.tensor(per_response, dtype=torch.float64))
    assert (scales[~mask] == 0).all()
    # one process without global counts: the micro-batch's own, fully masked responses left out
    local = verl_params.verl_token_scales(mask, mode, {}, torch.float64).sum(-1)
    expected = {"token-mean": [3 / 4, 0, 1 / 4], "token-sum": [3, 0, 1], "seq-mean-token-sum": [3 / 2, 0, 1 / 2],
                "seq-mean-token-sum-norm": [3 / 2 / 4, 0, 1 / 2 / 4], "seq-mean-token-mean": [1 / 2, 0, 1 / 2]}[mode]
    torch.testing.assert_close(local, torch.tensor(expected, dtype=torch.float64))
