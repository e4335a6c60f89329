"""The Triton mirror of the method table (kernels/method_table.py) against the torch table, row by
row, on tokens in every region, exactly on the fp32 boundaries, and with NaN ratios: every per-token method
(one with a ``MethodId``), the ones the row kernels' epilogue evaluates. A method evaluated by the torch objective
has no Triton branch and no kernel parameters."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TOKEN_LEVEL_VARIANTS, config, spanning_tokens, trust_region, variant_id
from method_terms import mirror, table_terms

import dgpo_ops


def fp32_tokens(cfg):
    # Tokens 0.1% either side of every boundary, not on it: the ratio is exp(log r), and torch's
    # exp and Triton's (numpy here, ex2-based on a GPU) may round it differently by one ulp, which
    # can put a token sitting exactly on a bound on either side. The bounds themselves agree to the
    # bit (test_kernel_params_are_the_bounds_rounded_once).
    log_ratio, adv, old_logp = spanning_tokens(cfg)
    edges = torch.tensor([e for e in trust_region(cfg) if e > 0] + [1.0], dtype=torch.float64)
    away = ((log_ratio[:, None] - edges.log()[None]).abs() > 1e-5).all(dim=1)
    return tuple(t[away].float().contiguous() for t in (log_ratio, adv, old_logp))


EXTRA_VARIANTS = [("grpo", {"eps_low": 0.16, "eps_high": 0.09}), ("dgpo", {"eps_low": 0.111, "eps_high": 0.16}),
                  ("ce_gppo", {"beta1": 0.3, "beta2": 1.7, "dual_clip": 2.0}), ("dcpo", {"r_max": 3.0})]


@pytest.mark.parametrize("variant", TOKEN_LEVEL_VARIANTS + EXTRA_VARIANTS, ids=variant_id)
def test_mirror_matches_the_table(variant):
    cfg = config(variant)
    log_ratio, adv, old_logp = fp32_tokens(cfg)
    want = table_terms(cfg, log_ratio, adv, old_logp)
    loss, psi, region, ratio, dloss = mirror(cfg, log_ratio, adv, old_logp, with_gradient=True)
    assert torch.equal(region, want.region)
    # the gradient the epilogue writes: -A psi, plus the penalty's slope (dro)
    slope = 0.0 if want.penalty_slope is None else want.penalty_slope
    torch.testing.assert_close(dloss, -adv * want.psi + slope, rtol=2e-6, atol=1e-6)
    # the ratio psi was evaluated at: exp of the log ratio clamped to +-20 (the metrics' ratio)
    torch.testing.assert_close(ratio, log_ratio.clamp(-20, 20).exp(), rtol=2e-6, atol=0)
    torch.testing.assert_close(psi, want.psi, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(loss, want.loss, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("variant", TOKEN_LEVEL_VARIANTS, ids=variant_id)
def test_nan_ratio_gives_nan_loss_in_table_and_mirror(variant):
    cfg = config(variant)
    log_ratio = torch.tensor([float("nan")] * 2)
    adv = torch.tensor([1.0, -1.0])
    old_logp = torch.tensor([math.log(0.3)] * 2)
    loss, psi, region, _ = mirror(cfg, log_ratio, adv, old_logp)
    want = table_terms(cfg, log_ratio, adv, old_logp)
    assert torch.isnan(want.loss).all() and torch.isnan(loss).all()
    # token by token: psi NaN on the same tokens (NaN == NaN here), equal where finite (gpg's and dro's psi is 1)
    torch.testing.assert_close(psi, want.psi, rtol=2e-6, atol=1e-7, equal_nan=True)
    assert torch.equal(region, want.region)


def test_kernel_params_are_the_bounds_rounded_once():
    cfg = dgpo_ops.method_config("dispo", eps_low_pos=0.16, eps_high_pos=0.09, eps_low_neg=0.3, eps_high_neg=2.0)
    params = torch.tensor(cfg.kernel_params(), dtype=torch.float32)
    assert params[0] == torch.tensor(1 - 0.16, dtype=torch.float32)
    assert params[1] == torch.tensor(1 + 0.09, dtype=torch.float32)
    assert params[2] == torch.tensor(1 - 0.3, dtype=torch.float32)
    assert params[3] == torch.tensor(1 + 2.0, dtype=torch.float32)


def test_the_mirror_holds_exactly_the_per_token_methods():
    """Every method the row kernels' epilogue can be handed (``MethodSpec.token_local``) has a MethodId, every
    MethodId is some such method's, and a method evaluated by the torch objective has none: no dead branch."""
    from dgpo_ops.kernels.interface import MethodId

    per_token = {name for name, spec in dgpo_ops.METHODS.items() if spec.token_local}
    assert {name for name, spec in dgpo_ops.METHODS.items() if spec.config.method_id is not None} == per_token
    assert {dgpo_ops.METHODS[name].config.method_id for name in per_token} == set(MethodId)
    assert {"vespo", "topr", "fipo", "geo_mean", "clip_cov", "kl_cov"} <= set(dgpo_ops.METHODS) - per_token
    with pytest.raises(ValueError, match="vespo has no Triton branch"):
        dgpo_ops.method_config("vespo").kernel_params()


def test_a_spec_whose_kernel_id_disagrees_with_its_locality_is_refused():
    from dgpo_ops.methods.base import MethodSpec
    from dgpo_ops.methods.table import METHODS

    grpo, vespo = METHODS["grpo"], METHODS["vespo"]
    with pytest.raises(TypeError, match="grpo: a per-token method names a MethodId.*this one is not per-token"):
        MethodSpec(grpo.config, grpo.token_fn, "s", "p", token_selection=lambda *a: None)
    with pytest.raises(TypeError, match="vespo: .*this one is per-token and its method_id is None"):
        MethodSpec(vespo.config, vespo.token_fn, "s", "p")
