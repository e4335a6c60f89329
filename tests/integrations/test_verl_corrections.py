"""verl's ``algorithm.rollout_correction`` as a correction stage equals verl 0.9.1's own
``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` on the same inputs: its
IS weights (token and sequence, TIS and IcePop, batch-normalised) and its rejection (every one of the eleven
``rollout_rs`` options, and chains of them), on every route, with ragged and fully masked responses and drifts
of several nats. Runs in verl's venv (``.ci/verl_cpu.sh``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl", reason="verl runs in its own venv: bash .ci/verl_cpu.sh")

from rollout_cases import CORRECTION_ROUTES, assert_same_as_weights, mismatch_batch  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper  # noqa: E402

from dgpo_ops.corrections import VerlCorrection  # noqa: E402

RS_CASES = [
    ("token_k1", "0.5_2.0"), ("token_k1", "2.0"), ("token_k2", 0.5), ("token_k3", "0.3"),
    ("seq_sum_k1", "0.2_5.0"), ("seq_sum_k2", 2.0), ("seq_sum_k3", 3.0),
    ("seq_mean_k1", "0.7_1.5"), ("seq_mean_k2", 0.4), ("seq_mean_k3", 0.5),
    ("seq_max_k2", 1.0), ("seq_max_k3", 2.0),
    ("token_k1,seq_mean_k3", "0.3_3.0,0.6"), ("seq_mean_k3,token_k2,seq_mean_k3", 1.0),
]
IS_CASES = [("token", 2.0, False), ("token", "0.5_5.0", False), ("sequence", "2.0", False),
            ("sequence", "0.1_10", False), ("token", 3.0, True), ("sequence", 5.0, True)]


def verl_correction(batch, **fields):
    """verl's weights (ones where it computes none) and modified response mask on the batch."""
    weights, mask, metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        batch["old_logps"].double(), batch["rollout_logps"].double(), batch["mask"].double(), **fields)
    weights = torch.ones_like(batch["old_logps"]) if weights is None else weights.batch["rollout_is_weights"]
    return weights, mask.bool(), metrics


@pytest.mark.parametrize("rollout_rs,threshold", RS_CASES)
@pytest.mark.parametrize("drift", [0.3, 3.0])
def test_rejection_equals_verl(rollout_rs, threshold, drift):
    batch = mismatch_batch(drift, seed=5)
    weights, mask, _ = verl_correction(batch, rollout_is=None, rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    every_route = rollout_rs in ("seq_mean_k3", "token_k1,seq_mean_k3")
    routes = CORRECTION_ROUTES if every_route else ("reference", "torch", "packed")
    correction = VerlCorrection(rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    assert_same_as_weights(correction, batch, weights, mask, routes, method="grpo")


@pytest.mark.parametrize("rollout_is,threshold,normalize", IS_CASES)
@pytest.mark.parametrize("drift", [0.3, 3.0])
def test_is_weights_equal_verl(rollout_is, threshold, normalize, drift):
    batch = mismatch_batch(drift, seed=6)
    weights, mask, metrics = verl_correction(batch, rollout_is=rollout_is, rollout_is_threshold=threshold,
                                             rollout_is_batch_normalize=normalize)
    correction = VerlCorrection(rollout_is=rollout_is, rollout_is_threshold=threshold,
                                rollout_is_batch_normalize=normalize)
    routes = CORRECTION_ROUTES if drift == 0.3 else ("reference", "torch", "packed")
    ours = assert_same_as_weights(correction, batch, weights, mask, routes, method="grpo",
                                  aggregation="seq_mean_token_mean")
    torch.testing.assert_close(ours["mismatch_kl_k1"].double(), torch.tensor(metrics["rollout_corr/kl"],
                                                                            dtype=torch.float64))
    torch.testing.assert_close(ours["mismatch_kl_k3"].double(), torch.tensor(metrics["rollout_corr/k3_kl"],
                                                                            dtype=torch.float64))
    for name in ("rollout_is_oob_ratio", "rollout_is_batch_norm_factor"):
        if f"rollout_corr/{name}" in metrics:
            torch.testing.assert_close(ours[name].double(), torch.tensor(metrics[f"rollout_corr/{name}"],
                                                                        dtype=torch.float64))


def test_is_and_rejection_together_equal_verl():
    batch = mismatch_batch(1.0, seed=7)
    fields = dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1,token_k3",
                  rollout_rs_threshold="0.5_2.0,1.0")
    weights, mask, _ = verl_correction(batch, **fields)
    assert_same_as_weights(VerlCorrection(**fields), batch, weights, mask, CORRECTION_ROUTES, method="cispo",
                           aggregation="seq_mean_token_sum_norm")


@pytest.mark.parametrize("fields", [
    dict(rollout_is="token", rollout_is_threshold="3_2"), dict(rollout_is="token", rollout_is_threshold=-1.0),
    dict(rollout_is="token", rollout_is_threshold="x"), dict(rollout_rs="token_k1"),
    dict(rollout_rs="token_k4", rollout_rs_threshold=1.0), dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_2"),
    dict(rollout_rs="token_k1,token_k2,token_k3", rollout_rs_threshold="1,2"),
    dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="2_1"),
])
def test_threshold_parsing_refuses_what_verl_refuses(fields):
    with pytest.raises(ValueError):
        VerlCorrection(**fields)
    with pytest.raises((ValueError, TypeError)):
        verl_correction(mismatch_batch(0.3), **{"rollout_is": None, **fields})


PRESETS = ["decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop", "decoupled_seq_is_rs",
           "decoupled_geo_rs", "decoupled_geo_rs_token_tis", "decoupled_k3_rs", "decoupled_k3_rs_seq_tis"]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_verl_config_gives_verls_numbers(preset):
    """verl's ``algorithm.rollout_correction`` (a preset of RolloutCorrectionConfig): verl computes the weights and
    the rejected mask before the loss and hands them to the registered policy loss, so ``dgpo_ops.grpo`` through
    verl's registry equals verl's vanilla loss; ``VerlCorrection.from_config`` of the same config gives the same
    loss from ``rollout_logps`` in one call of the op."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig

    import dgpo_ops

    config = getattr(RolloutCorrectionConfig, preset)()
    batch = mismatch_batch(1.0, seed=9)
    # responses 0 and 3 (2 is empty) within the presets' tight rejection bands, 1 far outside them
    drift = torch.tensor([0.0005, 2.0, 0.0, 0.001])[:, None]
    batch["rollout_logps"] = batch["old_logps"] + (batch["rollout_logps"] - batch["old_logps"]) * drift
    weights, mask, _ = verl_correction(batch, rollout_is=config.rollout_is,
                                       rollout_is_threshold=config.rollout_is_threshold,
                                       rollout_is_batch_normalize=config.rollout_is_batch_normalize,
                                       rollout_rs=config.rollout_rs, rollout_rs_threshold=config.rollout_rs_threshold)
    logits = batch["logits"].double().requires_grad_(True)
    log_prob = logits.log_softmax(-1).gather(-1, batch["target_ids"][..., None])[..., 0]
    advantages = batch["advantages"][:, None].expand(mask.shape).double()
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=4)
    verl_args = (batch["old_logps"].double(), log_prob, advantages, mask.double(), "token-mean", actor)
    theirs = get_policy_loss_fn("vanilla")(*verl_args, rollout_is_weights=weights.double())[0]
    plugin = get_policy_loss_fn("dgpo_ops.grpo")(*verl_args, rollout_is_weights=weights.double())[0]
    assert 0 < int(mask.sum()) < int(batch["mask"].sum()) or config.rollout_rs is None
    torch.testing.assert_close(plugin, theirs, rtol=1e-9, atol=1e-12)
    ours = dgpo_ops.fused_dgpo_loss(batch["logits"], batch["target_ids"], batch["advantages"], batch["mask"],
                                    batch["old_logps"], rollout_logps=batch["rollout_logps"], method="grpo",
                                    eps_low=actor.clip_ratio_low, eps_high=actor.clip_ratio_high,
                                    dual_clip=actor.clip_ratio_c, backend="torch",
                                    rollout_correction=VerlCorrection.from_config(config))
    torch.testing.assert_close(ours.loss.double(), theirs, rtol=1e-5, atol=1e-6)


def test_bypass_mode_is_refused_with_the_reason():
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    with pytest.raises(ValueError, match="bypass_mode is not supported"):
        VerlCorrection.from_config(RolloutCorrectionConfig.bypass_ppo_clip())


@pytest.mark.parametrize("mapping,message", [
    (dict(rollout_is="token", rollout_is_batch_normalize="false"), "rollout_is_batch_normalize must be a bool"),
    (dict(rollout_is="token", rollout_is_treshold=3.0), "unknown algorithm.rollout_correction field.*rollout_is_treshold"),
])
def test_a_config_mapping_is_read_strictly(mapping, message):
    """The YAML's mapping: a string where a bool belongs is not truthy, a misspelt field is not ignored."""
    with pytest.raises(ValueError, match=message):
        VerlCorrection.from_config(mapping)
    from omegaconf import OmegaConf

    with pytest.raises(ValueError, match=message):
        VerlCorrection.from_config(OmegaConf.create(mapping))


def test_the_yaml_defaults_and_the_dataclass_read_as_verls():
    from omegaconf import OmegaConf
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    yaml = OmegaConf.create(dict(_target_="verl.trainer.config.RolloutCorrectionConfig", rollout_is="token",
                                 rollout_is_threshold=2.0, rollout_rs=None, rollout_rs_threshold=None,
                                 bypass_mode=False, loss_type="ppo_clip", rollout_is_batch_normalize=False))
    assert VerlCorrection.from_config(yaml) == VerlCorrection(rollout_is="token")
    assert VerlCorrection.from_config(RolloutCorrectionConfig.decoupled_token_is()) == VerlCorrection(
        rollout_is="token", rollout_is_threshold=2.0)


@pytest.mark.parametrize("rollout_is", ["token", "sequence"])
def test_icepop_with_nan_inference_logps_equals_verl(rollout_is):
    """A token (token level) or response (sequence level) whose inference log-prob is NaN gets IcePop weight 0,
    and verl's rollout_is_oob_ratio does not count it out of bounds."""
    batch = mismatch_batch(0.3, seed=6, nan_tokens=True)
    weights, mask, metrics = verl_correction(batch, rollout_is=rollout_is, rollout_is_threshold="0.5_5.0")
    correction = VerlCorrection(rollout_is=rollout_is, rollout_is_threshold="0.5_5.0")
    ours = assert_same_as_weights(correction, batch, weights, mask, ("reference", "torch", "packed"), method="grpo")
    torch.testing.assert_close(ours["rollout_is_oob_ratio"].double(),
                               torch.tensor(metrics["rollout_corr/rollout_is_oob_ratio"], dtype=torch.float64))


@pytest.mark.parametrize("rollout_rs,threshold,message", [
    ("token_k1", "abc", "Invalid numeric threshold 'abc' for option 'token_k1'"),
    ("token_k1", "0.5_x", "Invalid numeric threshold 'x' for option 'token_k1'"),
    ("seq_mean_k3", "nan", "Invalid numeric threshold 'nan' for option 'seq_mean_k3'"),
    ("token_k1", 0, "Thresholds for option 'token_k1' must be positive"),
])
def test_a_bad_rs_threshold_names_its_option(rollout_rs, threshold, message):
    with pytest.raises(ValueError, match=message):
        VerlCorrection(rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
