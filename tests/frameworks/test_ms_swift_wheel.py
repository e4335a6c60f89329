"""ms-swift 4.6.0's own GRPO loss (``GRPOTrainer._compute_loss_and_metrics`` and the methods it calls, read
from the installed ``ms-swift`` wheel: its trainer module imports trl, transformers, accelerate and vllm)
against dgpo-ops on the same inputs: every ``loss_type`` dgpo-ops has (grpo, bnpo, dr_grpo, dapo, cispo, sapo,
fipo), GSPO's importance-sampling levels, the KL term and the rollout importance sampling modes.

The loss runs as a method of a stand-in trainer (``SwiftTrainer``) that holds the attributes
``_prepare_algorithm_params`` sets from the arguments, one process, one micro-batch: the window normaliser of
dapo / cispo / fipo (``num_items_in_batch``) is this batch's token count, and the gradient-accumulation scale
``_undo_gradient_accumulation_scaling`` undoes is 1. Statistics gathering runs on that one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from wheel_source import (
    ROUTES,
    assert_beyond_the_clamp,
    assert_same,
    class_defaults,
    load,
    ragged_batch,
    require,
)

require("ms-swift", "4.6.0")

from dgpo_ops.corrections import SwiftCorrection  # noqa: E402

TRAINER = "swift/rlhf_trainers/grpo_trainer.py"
METHODS = ["_compute_loss_and_metrics", "_compute_fipo_influence", "_undo_gradient_accumulation_scaling",
           "_get_rollout_is_correction", "_compute_sequence_level_ratios",
           "_apply_rollout_importance_sampling", "_compute_rollout_offpolicy_metrics",
           "_compute_is_correction_metrics"]
SWIFT = load("ms-swift", TRAINER, ["WINDOW_NORMALIZED_LOSS_TYPES", *(f"GRPOTrainer.{m}" for m in METHODS)],
             {"gather_object": lambda objects: list(objects), "nanmax": lambda x: x[~x.isnan()].max(),
              "nanmin": lambda x: x[~x.isnan()].min()})
ARGUMENTS = class_defaults("ms-swift", "swift/rlhf_trainers/args_mixin.py", "GRPOArgumentsMixin")

SwiftTrainer = type("SwiftTrainer", (), {name: SWIFT[f"GRPOTrainer.{name}"] for name in METHODS})


def swift_trainer(loss_type, logp_holder, **arguments):
    """The trainer's attributes as ``_prepare_algorithm_params`` sets them from ``arguments`` over the
    defaults."""
    # beta and gradient_accumulation_steps: fields of TRL's GRPOConfig and transformers' TrainingArguments,
    # which ms-swift's GRPOConfig extends (beta 0 here unless a test sets it)
    args = SimpleNamespace(**{**ARGUMENTS, "beta": 0.0, "gradient_accumulation_steps": 1, **arguments})
    trainer = SwiftTrainer()
    trainer.__dict__.update(
        args=args, loss_type=loss_type, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        importance_sampling_level=args.importance_sampling_level, tau_pos=args.tau_pos, tau_neg=args.tau_neg,
        fipo_gamma=2 ** (-1 / args.fipo_decay_rate), fipo_clip_range=args.fipo_clip_range,
        fipo_clip_high_only=args.fipo_clip_high_only, fipo_safety_threshold=args.fipo_safety_threshold,
        beta=args.beta, kl_in_reward=False, overlong_filter=False, compute_entropy=False,
        rollout_importance_sampling_mode=args.rollout_importance_sampling_mode,
        rollout_importance_sampling_threshold=args.rollout_importance_sampling_threshold,
        log_rollout_offpolicy_metrics=False, disable_rollout_importance_sampling=False,
        off_policy_sequence_mask_delta=None, _has_teacher=False, sdar_loss_coef=0.0, chord_sft_iterator=None,
        max_completion_length=args.max_completion_length, model=SimpleNamespace(training=True),
        model_accepts_loss_kwargs=False, compute_loss_func=None, current_gradient_accumulation_steps=1,
        accelerator=SimpleNamespace(num_processes=1, gather_for_metrics=lambda x: x if x.dim() else x[None]),
        _get_per_token_logps_and_entropies=lambda model, inputs, batch, compute_entropy: (logp_holder[0],
                                                                                           None))
    return trainer


def swift_loss(batch, loss_type, ref_logp=None, **arguments):
    _, _, mask, old_logp, rollout_logp, advantages = batch
    holder = []
    trainer = swift_trainer(loss_type, holder, max_completion_length=mask.shape[1], **arguments)
    grpo_batch = SimpleNamespace(completion_mask=mask,
                                 truncated_mask=torch.zeros(mask.shape[0], dtype=torch.bool),
                                 advantages=advantages[:, None].expand(mask.shape),
                                 old_per_token_logps=old_logp,
                                 rollout_per_token_logps=rollout_logp, ref_per_token_logps=ref_logp,
                                 num_items_in_batch=mask.sum())

    def loss(logp):
        holder[:] = [logp]
        return trainer._compute_loss_and_metrics(None, {}, grpo_batch)[0]
    return loss


# ms-swift's loss_type -> dgpo-ops' method and aggregation (dr_grpo's T: max_completion_length)
LOSS_TYPES = {
    "grpo": dict(method="grpo", aggregation="seq_mean_token_mean"),
    "bnpo": dict(method="grpo", aggregation="token_mean"),
    "dr_grpo": dict(method="grpo", aggregation="seq_mean_token_sum_norm"),
    "dapo": dict(method="grpo", aggregation="token_mean"),
    "sapo": dict(method="sapo", gate="sigmoid", aggregation="seq_mean_token_mean"),
    "cispo": dict(method="cispo", aggregation="token_mean"),
    "fipo": dict(method="fipo", aggregation="token_mean"),
}
ARGUMENT_CASES = {  # ms-swift's arguments -> dgpo-ops' parameters, per loss type
    "defaults": ({}, {}),
    "asymmetric": (dict(epsilon=0.1, epsilon_high=0.28, tau_pos=2.0, tau_neg=0.5, fipo_decay_rate=2.0,
                        fipo_clip_range=0.5, fipo_clip_high_only=False, fipo_safety_threshold=1.5),
                   dict(eps_low=0.1, eps_high=0.28, tau_pos=2.0, tau_neg=0.5, decay_rate=2.0, clip_range=0.5,
                        clip_side="both", safety_threshold=1.5)),
    "delta": (dict(epsilon_high=0.28, delta=1.8), dict(eps_high=0.28, delta=1.8)),
}


def ours_for(loss_type, arguments, params):
    """dgpo-ops' keywords for ms-swift's ``loss_type`` under ``arguments`` (the mapped ``params``)."""
    keywords = {**LOSS_TYPES[loss_type]}
    args = {**ARGUMENTS, **arguments}
    if loss_type == "cispo":  # ms-swift's epsilon_high is the cap itself; no floor
        high = args["epsilon_high"] if args["epsilon_high"] is not None else args["epsilon"]
        return {**keywords, "eps_low": 1.0, "eps_high": high - 1.0}
    if loss_type == "sapo":
        return {**keywords, **{k: v for k, v in params.items() if k.startswith("tau")}}
    names = {"eps_low", "eps_high", "delta"} | ({"decay_rate", "clip_range", "clip_side", "safety_threshold"}
                                                if loss_type == "fipo" else set())
    return {**keywords, **{k: v for k, v in params.items() if k in names}}


PPO_CLIP_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "fipo")  # the loss types delta caps the ratio of


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 2.0])
@pytest.mark.parametrize("loss_type, case", [(loss_type, case) for loss_type in LOSS_TYPES
                                             for case in ARGUMENT_CASES
                                             if case != "delta" or loss_type in PPO_CLIP_TYPES])
def test_loss_type(route, drift, loss_type, case):
    arguments, params = ARGUMENT_CASES[case]
    if loss_type == "cispo":  # ms-swift's epsilon_high is CISPO's cap itself (None: epsilon, 0.2)
        arguments = {**arguments, "epsilon_high": 5.0 if case == "defaults" else 1.6}
    batch = ragged_batch(seed=31, drift=drift)
    assert_same(route, batch, swift_loss(batch, loss_type, **arguments),
                **ours_for(loss_type, arguments, params))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
@pytest.mark.parametrize("loss_type, case", [("grpo", "defaults"), ("grpo", "delta"), ("bnpo", "defaults"),
                                             ("dr_grpo", "defaults"), ("sapo", "asymmetric"),
                                             ("cispo", "defaults")])
def test_gspo(route, level, loss_type, case):
    """importance_sampling_level sequence (the mean log-ratio, differentiated) and sequence_token (GSPO-token:
    the same gradient here, where every token of a response has its advantage), for each loss type that reads
    the ratio (cispo's value is the token's own log-prob times its response's clipped weight)."""
    arguments, params = ARGUMENT_CASES[case]
    if loss_type == "cispo":
        arguments = {"epsilon_high": 1.6}
    batch = ragged_batch(seed=37, drift=1.0)
    assert_same(route, batch, swift_loss(batch, loss_type, importance_sampling_level=level, **arguments),
                importance_sampling_level="sequence", **ours_for(loss_type, arguments, params))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_kl_term(route, loss_type):
    """beta > 0: the k3 KL to the reference on every token, no rollout weights."""
    batch = ragged_batch(seed=41, drift=0.5)
    ref_logp = batch[3] + 0.7 * torch.randn(batch[3].shape, generator=torch.Generator().manual_seed(1),
                                            dtype=torch.float64)
    assert_same(route, batch, swift_loss(batch, loss_type, ref_logp=ref_logp, beta=0.04), beta=0.04,
                ref_logps=ref_logp, **LOSS_TYPES[loss_type])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("rollout_drift", [0.05, 1.0])
@pytest.mark.parametrize("threshold", [2.0, 1.2])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "fipo"])
def test_rollout_importance_sampling(route, rollout_drift, threshold, mode, loss_type):
    batch = ragged_batch(seed=43, drift=0.5, rollout_drift=rollout_drift)
    assert_same(route, batch, swift_loss(batch, loss_type, rollout_importance_sampling_mode=mode,
                                         rollout_importance_sampling_threshold=threshold),
                rollout_logps=batch[4], rollout_correction=SwiftCorrection(mode, threshold),
                **LOSS_TYPES[loss_type])


def test_the_threshold_bites():
    """At 1 nat of mismatch the 1.2 threshold truncates or masks some tokens and responses and keeps
    others."""
    _, _, mask, old_logp, rollout_logp, _ = ragged_batch(seed=43, drift=0.5, rollout_drift=1.0)
    ratio = (old_logp - rollout_logp).exp()
    assert ((ratio > 1.2) & mask).any() and ((ratio <= 1.2) & mask).any()
    log_ratio = (old_logp - rollout_logp) * mask
    geometric = torch.exp(log_ratio.sum(-1) / mask.sum(-1).clamp(min=1))[mask.any(-1)]
    assert (geometric > 1.2).any() and (geometric <= 1.2).any()


def test_defaults_are_ms_swifts():
    """SwiftCorrection's threshold and fipo's parameters default to ms-swift's GRPO arguments."""
    threshold = ARGUMENTS["rollout_importance_sampling_threshold"]
    assert SwiftCorrection().rollout_importance_sampling_threshold == threshold
    from dgpo_ops.methods.fipo import FipoConfig
    fipo = FipoConfig()
    assert (fipo.decay_rate, fipo.clip_range, fipo.safety_threshold) == (
        ARGUMENTS["fipo_decay_rate"], ARGUMENTS["fipo_clip_range"], ARGUMENTS["fipo_safety_threshold"])
    assert (fipo.clip_side == "high") == ARGUMENTS["fipo_clip_high_only"]
    assert set(SWIFT["WINDOW_NORMALIZED_LOSS_TYPES"]) == {"cispo", "dapo", "fipo"}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo"])
def test_a_token_25_nats_off_policy(loss_type):
    """coef_1 = exp(log_ratio) unclamped: a token 25 nats off contributes |A| e^25; dgpo-ops' straight-through
    clamp gives it ms-swift's own value and gradient at 20 nats (a known difference)."""
    assert_beyond_the_clamp("reference", lambda batch: swift_loss(batch, loss_type), **LOSS_TYPES[loss_type])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("level,mode", [("sequence", "token_truncate"), ("sequence", "sequence_truncate"),
                                        ("sequence_token", "sequence_truncate")])
def test_gspo_with_rollout_importance_sampling(route, level, mode):
    """sequence differentiates the mean log-ratio, so per-token weights reach every token of the response, as
    in dgpo-ops' importance_sampling_level="sequence"; sequence_token (GSPO-token) gives each token its own
    weighted gradient, the same where the weight is the response's (sequence_truncate). GSPO-token with
    per-token weights is not offered (docs/normalization.md, "Known differences")."""
    batch = ragged_batch(seed=43, drift=0.5, rollout_drift=1.0)
    oracle = swift_loss(batch, "grpo", importance_sampling_level=level, rollout_importance_sampling_mode=mode,
                        rollout_importance_sampling_threshold=1.5)
    assert_same(route, batch, oracle, importance_sampling_level="sequence", rollout_logps=batch[4],
                rollout_correction=SwiftCorrection(mode, 1.5), **LOSS_TYPES["grpo"])
