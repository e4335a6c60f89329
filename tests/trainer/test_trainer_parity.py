"""DGPOTrainer's loss and gradients against GRPOTrainer's on the same batch, for every loss TRL also has."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from trainer_fixtures import build_model_dir, first_update_batch, loss_and_grads, make_trainer  # noqa: E402

# TRL loss_type -> (DGPOConfig additions, GRPOConfig additions)
CASES = {
    "grpo": (dict(policy_loss="grpo"), dict(loss_type="grpo")),
    "dapo": (dict(policy_loss="dapo"), dict(loss_type="dapo", epsilon_high=0.28)),
    "bnpo": (dict(policy_loss="grpo"), dict(loss_type="bnpo")),
    "dr_grpo": (dict(policy_loss="grpo"), dict(loss_type="dr_grpo")),
    "cispo": (dict(policy_loss="cispo"), dict(loss_type="cispo", epsilon_high=5.0)),
    "sapo": (dict(policy_loss="sapo"), dict(loss_type="sapo")),
    "grpo_kl_gspo": (dict(policy_loss="grpo"), dict(loss_type="grpo", beta=0.05, importance_sampling_level="sequence")),
}


# The tests share one saved model (model_dir): they run on one xdist worker.
pytestmark = pytest.mark.xdist_group("trainer_parity")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.mark.parametrize("fused", ["linear", "logits"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_step_matches_grpo_trainer(case, fused, model_dir, tmp_path):
    from dgpo_ops.trainer import DGPOConfig, DGPOTrainer
    from trl import GRPOConfig, GRPOTrainer

    ours_extra, trl_extra = CASES[case]
    ours = make_trainer(DGPOTrainer, DGPOConfig, model_dir, tmp_path / "ours", fused=fused, **trl_extra,
                        **ours_extra)
    theirs = make_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **trl_extra)
    inputs = first_update_batch(theirs, trl_extra.get("beta", 0.0))
    loss_trl, grads_trl = loss_and_grads(theirs, inputs)
    loss_ours, grads_ours = loss_and_grads(ours, inputs)
    # fp32 on both sides; the two sum the same terms in different orders (tiles, chunking): 1e-5.
    torch.testing.assert_close(loss_ours, loss_trl, rtol=1e-5, atol=1e-7)
    assert grads_ours.keys() == grads_trl.keys()
    for name in grads_trl:
        torch.testing.assert_close(grads_ours[name], grads_trl[name], rtol=1e-4, atol=1e-7, msg=name)
    metrics = ours._metrics["train"]
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "eur",
                "ratio_mean", "clip_ratio/lp_mean", "clip_ratio/hn_mean", "clip_ratio/dual_mean"):
        assert key in metrics and all(v == v for v in metrics[key]), key
    if case.startswith("grpo") and case != "grpo_kl_gspo":
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert metrics[key][-1] == pytest.approx(theirs._metrics["train"][key][-1], abs=1e-6), key
