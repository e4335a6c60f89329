"""DGPOTrainer is GRPOTrainer, fused: every field of TRL's GRPOConfig either gives GRPOTrainer's
first update -- loss, gradients, gradient norm and logged metrics on the same weights and batch, the old
log-probs off-policy so that the check depends on the weights -- or is refused when DGPOConfig is made, with a
message that says what to use instead.

``COVERAGE`` lists every GRPOConfig field beyond transformers' TrainingArguments: the ``CASES`` that compare it
(the same field values on GRPOConfig and DGPOConfig, policy_loss unset: a TRL user's set-up with the class
switched), the ``REFUSALS`` that refuse a value, or ``TRL(why)``: GRPOTrainer's own code reads it (generation,
rewards, vLLM, logging, checkpoints, model loading) and DGPOTrainer inherits that code unchanged
(``test_dgpo_trainer_overrides_only_the_loss``). A field a new TRL adds fails
``test_every_grpo_config_field_is_covered`` until it is listed here: a TRL upgrade cannot bring a silently
ignored option (pyproject.toml bounds trl to the versions this module passed on; docs/training.md says how to
check a newer one). The models are built in-process from configs: a Qwen2 causal LM (tied and untied), a
GPT-2 with dropout modules, a Granite (scaled logits), a Qwen3-MoE with router logits, and two vision-language models, Qwen2.5-VL and
Gemma3.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from unittest import mock

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from trainer_fixtures import (  # noqa: E402
    build_dropout_model_dir,
    build_gemma3_model_dir,
    build_granite_model_dir,
    build_model_dir,
    build_moe_model_dir,
    build_tokenizer,
    build_vlm_model_dir,
    first_update_batch,
    length_reward,
    loss_and_grads,
    make_trainer,
    prompt_dataset,
)

from dgpo_ops.frameworks import trl as trl_spec  # noqa: E402

# TRL's loss types from TRL's spec (dgpo_ops.frameworks.trl); vespo's cases are their own (below)
TRL_LOSS_TYPES = tuple(name for name in trl_spec.LOSS_TYPES if name != "vespo")
# TRL's CISPO cap is epsilon_high itself (5.0 recommended); its default (epsilon, 0.2) caps every weight below 1.
LOSS_TYPE_FIELDS = {name: {"loss_type": name, **({"epsilon_high": 5.0} if name == "cispo" else {})}
                    for name in TRL_LOSS_TYPES}


@dataclasses.dataclass(frozen=True)
class Case:
    fields: dict  # the same on GRPOConfig and DGPOConfig
    model: str = "qwen2"
    batch: dict = dataclasses.field(default_factory=dict)  # first_update_batch's options
    vllm: bool = False  # use_vllm set on both trainers after construction: vLLM's importance sampling on the loss side
    steps: int = 1  # micro-batches in a row on the same batch (adaptive entropy control)
    rtol: float = 1e-5  # loss; gradients (relative to each parameter's largest) and metrics get 10 x


CASES = {
    "default": Case({}),
    **{f"loss_type={name}": Case(fields) for name, fields in LOSS_TYPE_FIELDS.items()},
    "loss_type=luspo, sequence": Case({"loss_type": "luspo", "importance_sampling_level": "sequence"}),
    "max_completion_length": Case({"loss_type": "dr_grpo", "max_completion_length": 12}),
    "steps_per_generation": Case({"steps_per_generation": 4}),
    "generation_batch_size": Case({"generation_batch_size": 24}),
    "gradient_accumulation_steps=1": Case({"gradient_accumulation_steps": 1}),
    "num_iterations": Case({"num_iterations": 3}),
    "temperature": Case({"temperature": 0.7}),
    "epsilon": Case({"epsilon": 0.1}),
    "epsilon_high": Case({"epsilon_high": 0.28}),
    "delta": Case({"delta": 1.5}),
    "delta <= 1 + epsilon_high": Case({"delta": 1.1, "loss_type": "grpo"}),  # also caps A > 0 in the trust region
    "sapo temperatures": Case({"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 3.0}),
    # read by loss_type="vespo" only (refused below), so ignored by the other loss types, as in TRL
    "vespo parameters": Case({"vespo_k_pos": 5.0, "vespo_lambda_pos": 1.0, "vespo_k_neg": 1.0, "vespo_lambda_neg": 5.0}),
    "beta": Case({"beta": 0.05}, batch={"beta": 0.05}),
    "use_bias_correction_kl=False": Case({"beta": 0.05, "use_bias_correction_kl": False}, batch={"beta": 0.05}),
    "importance_sampling_level": Case({"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.05},
                                      batch={"beta": 0.05}),
    "top_entropy_quantile": Case({"top_entropy_quantile": 0.3}),
    "top_entropy_quantile=0": Case({"loss_type": "grpo", "top_entropy_quantile": 0.0}),
    **{f"entropy_coef, {name}": Case({**fields, "entropy_coef": 0.5}) for name, fields in LOSS_TYPE_FIELDS.items()},
    "entropy_coef, top_entropy_quantile": Case({"entropy_coef": 0.5, "top_entropy_quantile": 0.5}),
    "adaptive entropy, below target": Case({"use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_target": 100.0,
                                            "entropy_coef_delta": 0.05, "entropy_coef_max": 0.12}, steps=3),
    "adaptive entropy, above target": Case({"use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_target": 0.2,
                                            "entropy_coef_delta": 0.06, "entropy_coef_min": 0.05,
                                            "top_entropy_quantile": 0.5, "loss_type": "grpo"}, steps=3),
    # the first two drop one of the two negative-advantage sequences, the third one (see the test's check)
    "off_policy_mask_threshold": Case({"off_policy_mask_threshold": 0.2}, batch={"advantages": (-1.2, 0.7, -0.4, 1.5)}),
    "off_policy_mask_threshold < 0": Case({"off_policy_mask_threshold": -0.15, "loss_type": "grpo"}),
    "off_policy_mask_threshold, vLLM sampling log-probs": Case({"off_policy_mask_threshold": 0.3},
                                                               batch={"sampling": True,
                                                                      "advantages": (-1.2, 0.7, -0.4, 1.5)}),
    "vLLM token importance sampling": Case({}, vllm=True,
                                           batch={"importance_sampling": "token", "sampling": True}),
    "vLLM sequence importance sampling": Case({"loss_type": "grpo"}, vllm=True,
                                              batch={"importance_sampling": "sequence", "sampling": True}),
    "vllm_importance_sampling_correction=False": Case({"vllm_importance_sampling_correction": False}, vllm=True,
                                                      batch={"importance_sampling": "token"}),
    "disable_dropout": Case({"disable_dropout": True}, model="gpt2 dropout"),
    "cast_lm_head_to_fp32": Case({"cast_lm_head_to_fp32": True, "bf16": True}, model="qwen2 untied"),
    "bf16": Case({"bf16": True}, model="qwen2 untied", rtol=1e-3),  # bf16 products: TRL's and ours round apart
    "granite (logits_scaling)": Case({}, model="granite"),
    "moe": Case({}, model="moe"),
    "moe, router_aux_loss_coef": Case({"router_aux_loss_coef": 0.05, "loss_type": "grpo"}, model="moe"),
    "moe, router_aux_loss_coef=0": Case({"router_aux_loss_coef": 0.0}, model="moe"),
    "moe, output_router_logits": Case({"entropy_coef": 0.2}, model="moe router logits"),
    "vlm": Case({}, model="qwen2.5-vl", batch={"vision": True}),
    "vlm, masks and bonus": Case({"top_entropy_quantile": 0.5, "entropy_coef": 0.3, "off_policy_mask_threshold": 0.0,
                                  "beta": 0.05}, model="qwen2.5-vl",
                                 batch={"vision": True, "beta": 0.05, "advantages": (-1.2, 0.7, -0.4, 1.5)}),
    "gemma3": Case({"loss_type": "grpo"}, model="gemma3", batch={"vision": True}),
}

# field values DGPOConfig refuses -> a fragment of the message, which says why and what to use instead
# What the fused path refuses although TRL takes it: the fields that name two objectives at once.
REFUSALS = {
    "delta with a method that has no such cap": ({"policy_loss": "dgpo", "delta": 1.5}, "delta is TRL's two-sided clip"),
    "loss_type naming another objective than policy_loss": ({"loss_type": "cispo", "policy_loss": "dgpo"},
                                                            "names TRL's cispo objective"),
}

# TRL's vespo (the method table's vespo row)
CASES.update({
    "loss_type=vespo": Case({"loss_type": "vespo"}),
    "vespo parameters with loss_type=vespo": Case({"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5,
                                                   "vespo_k_neg": 4.0, "vespo_lambda_neg": 1.0, "entropy_coef": 0.2,
                                                   "top_entropy_quantile": 0.5}),
    "loss_type=vespo, vLLM token importance sampling": Case({"loss_type": "vespo", "off_policy_mask_threshold": 0.3},
                                                            vllm=True, batch={"importance_sampling": "token",
                                                                              "sampling": True,
                                                                              "advantages": (-1.2, 0.7, -0.4, 1.5)}),
    # vespo's weight is its summed sequence ratio, but TRL's KL correction multiplies by the token's ratio (coef_1),
    # whatever the loss type: the beta cases above have a loss type whose ratio is the token's (or GSPO's mean),
    # where the two are one, so they passed while dgpo-ops corrected vespo's KL by its sequence weight
    "loss_type=vespo, beta": Case({"loss_type": "vespo", "beta": 0.05}, batch={"beta": 0.05}),
    "loss_type=vespo, beta, use_bias_correction_kl=False": Case({"loss_type": "vespo", "beta": 0.05,
                                                                 "use_bias_correction_kl": False},
                                                                batch={"beta": 0.05}),
})



class TRL(str):
    """Why the loss never sees the field: GRPOTrainer's own code reads it, and DGPOTrainer inherits that code."""


GENERATION = TRL("generation (GRPOTrainer._generate_and_score_completions and its helpers)")
VLLM = TRL("vLLM generation and weight sync (GRPOTrainer's VLLMGeneration)")
VLLM_IS = TRL("vLLM's importance-sampling ratios, computed in GRPOTrainer's generation; the loss multiplies by "
              "them (the 'vLLM ... importance sampling' cases)")
LOGGING = TRL("completion logging (GRPOTrainer.log and its generation)")
REWARDS = TRL("rewards and advantages (GRPOTrainer._calculate_rewards, _generate_and_score_completions)")
REF_SYNC = TRL("reference-model sync (TRL's SyncRefModelCallback)")

COVERAGE = {
    "model_init_kwargs": TRL("model loading (GRPOTrainer.__init__)"),
    "trust_remote_code": TRL("model loading (GRPOTrainer.__init__)"),
    "router_aux_loss_coef": ("moe", "moe, router_aux_loss_coef", "moe, router_aux_loss_coef=0",
                             "moe, output_router_logits"),
    "disable_dropout": ("disable_dropout",),
    "cast_lm_head_to_fp32": ("cast_lm_head_to_fp32",),
    "num_generations": REWARDS,
    "num_generations_eval": GENERATION,
    "max_completion_length": ("max_completion_length", "loss_type=dr_grpo"),
    "ds3_gather_for_generation": GENERATION,
    "shuffle_dataset": TRL("the sampler (GRPOTrainer._get_train_sampler)"),
    "pad_to_multiple_of": GENERATION,
    "generation_batch_size": ("generation_batch_size",),
    "steps_per_generation": ("steps_per_generation", "default"),
    "temperature": ("temperature",),
    "top_p": GENERATION,
    "top_k": GENERATION,
    "min_p": GENERATION,
    "generation_kwargs": GENERATION,
    "chat_template_kwargs": GENERATION,
    "repetition_penalty": GENERATION,
    "cache_implementation": GENERATION,
    "use_vllm": ("vLLM token importance sampling", "vLLM sequence importance sampling"),
    "vllm_mode": VLLM,
    "vllm_model_impl": VLLM,
    "vllm_enable_sleep_mode": VLLM,
    "vllm_structured_outputs_regex": VLLM,
    "vllm_server_base_url": VLLM,
    "vllm_server_host": VLLM,
    "vllm_server_port": VLLM,
    "vllm_server_timeout": VLLM,
    "vllm_group_port": VLLM,
    "vllm_gpu_memory_utilization": VLLM,
    "vllm_max_model_length": VLLM,
    "vllm_tensor_parallel_size": VLLM,
    "beta": ("beta", "importance_sampling_level", "vlm, masks and bonus", "loss_type=vespo, beta"),
    "num_iterations": ("num_iterations",),
    "epsilon": ("epsilon",),
    "delta": ("delta", "delta <= 1 + epsilon_high"),
    "epsilon_high": ("epsilon_high", "loss_type=cispo"),
    "sapo_temperature_neg": ("sapo temperatures",),
    "sapo_temperature_pos": ("sapo temperatures",),
    "vespo_k_pos": ("vespo parameters", "vespo parameters with loss_type=vespo"),
    "vespo_lambda_pos": ("vespo parameters", "vespo parameters with loss_type=vespo"),
    "vespo_k_neg": ("vespo parameters", "vespo parameters with loss_type=vespo"),
    "vespo_lambda_neg": ("vespo parameters", "vespo parameters with loss_type=vespo"),
    # (the vespo cases: compared, or refused while the method table has no vespo)
    "importance_sampling_level": ("importance_sampling_level", "loss_type=luspo, sequence"),
    "reward_weights": REWARDS,
    "multi_objective_aggregation": REWARDS,
    "scale_rewards": REWARDS,
    "loss_type": (*(f"loss_type={name}" for name in TRL_LOSS_TYPES), "loss_type=vespo",
                  "loss_type=vespo, vLLM token importance sampling"),
    "mask_truncated_completions": TRL("the completion mask, made in GRPOTrainer's generation (the loss reads it)"),
    "sync_ref_model": REF_SYNC,
    "ref_model_mixup_alpha": REF_SYNC,
    "ref_model_sync_steps": REF_SYNC,
    "top_entropy_quantile": ("top_entropy_quantile", "top_entropy_quantile=0", "entropy_coef, top_entropy_quantile"),
    "entropy_coef": tuple(f"entropy_coef, {name}" for name in TRL_LOSS_TYPES),
    "use_adaptive_entropy": ("adaptive entropy, below target", "adaptive entropy, above target"),
    "entropy_coef_min": ("adaptive entropy, above target",),
    "entropy_coef_max": ("adaptive entropy, below target",),
    "entropy_coef_delta": ("adaptive entropy, below target", "adaptive entropy, above target"),
    "entropy_target": ("adaptive entropy, below target", "adaptive entropy, above target"),
    "max_tool_calling_iterations": GENERATION,
    "vllm_importance_sampling_correction": ("vllm_importance_sampling_correction=False",
                                            "vLLM token importance sampling"),
    "vllm_importance_sampling_mode": VLLM_IS,
    "vllm_importance_sampling_clip_max": VLLM_IS,
    "vllm_importance_sampling_clip_min": VLLM_IS,
    "vllm_importance_sampling_cap": VLLM_IS,
    "off_policy_mask_threshold": ("off_policy_mask_threshold", "off_policy_mask_threshold < 0",
                                  "off_policy_mask_threshold, vLLM sampling log-probs", "vlm, masks and bonus"),
    "use_bias_correction_kl": ("use_bias_correction_kl=False", "beta", "loss_type=vespo, beta",
                               "loss_type=vespo, beta, use_bias_correction_kl=False"),
    "log_completions": LOGGING,
    "log_multimodal": LOGGING,
    "num_completions_to_print": LOGGING,
    "log_unique_prompts": LOGGING,
    "log_completions_hub_repo": LOGGING,
    "use_transformers_continuous_batching": GENERATION,
    "transformers_continuous_batching_config": GENERATION,
    "use_transformers_paged": GENERATION,
}

# TrainingArguments fields that reach the loss or the model call, compared like the GRPOConfig ones; every
# other TrainingArguments field acts through transformers' Trainer, which DGPOTrainer inherits.
TRAINING_ARGUMENTS_IN_THE_LOSS = {
    "gradient_accumulation_steps": ("gradient_accumulation_steps=1", "default"),
    "bf16": ("bf16", "cast_lm_head_to_fp32"),
}

# The GRPOTrainer (and Trainer) methods DGPOTrainer overrides, and why: nothing outside the loss is replaced.
OVERRIDES = {
    "__init__": "args=None or a GRPOConfig; the model's forward gets the fused head (TRL's own patch stays)",
    "_get_per_token_logps_and_entropies": "old and reference log-probs on the fused op (through TRL's chunking)",
    "_compute_loss": "the loss on the fused ops (through TRL's chunking and multimodal slicing)",
    "_calculate_rewards": "keeps the rewards for DCPO's advantages and the responses' scores (returns TRL's)",
    "_generate_and_score_completions": "DCPO's advantages when advantage_estimator='dcpo' (TRL's otherwise); the "
                                       "responses' scores beside them where the loss reads them (topr, positive NLL)",
    "_save_checkpoint": "DCPO's advantage statistics beside TRL's checkpoint",
    "_load_optimizer_and_scheduler": "DCPO's advantage statistics from a checkpoint",
    "train": "reports the last optimizer steps skipped for non-finite gradients",
    "_clip_grad_norm": "notes which gradients are not finite before clipping",
    "_get_grad_norm": "skips optimizer steps whose gradients are not finite",
}


# ----------------------------------------------------------------------------- models


# The tests share the saved models (model_dirs): they run on one xdist worker.
pytestmark = [pytest.mark.xdist_group("trainer_conformance"), pytest.mark.early]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance-models")
    return {
        "qwen2": build_model_dir(root / "qwen2", seed=0),
        "qwen2 untied": build_model_dir(root / "qwen2-untied", seed=0, tie_word_embeddings=False),
        "gpt2 dropout": build_dropout_model_dir(root / "gpt2-dropout", seed=0),
        "granite": build_granite_model_dir(root / "granite", seed=0),
        "moe": build_moe_model_dir(root / "moe", seed=0),
        "moe router logits": build_moe_model_dir(root / "moe-router", seed=0, output_router_logits=True),
        "qwen2.5-vl": build_vlm_model_dir(root / "qwen2.5-vl", seed=0),
        "gemma3": build_gemma3_model_dir(root / "gemma3", seed=0),
    }


def _grpo_own_fields():
    from transformers import TrainingArguments
    from trl import GRPOConfig

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in inherited]


# ----------------------------------------------------------------------------- the list is complete


def test_every_grpo_config_field_is_covered():
    own = _grpo_own_fields()
    missing = sorted(set(own) - set(COVERAGE))
    assert not missing, (f"GRPOConfig fields nobody checked: {missing}. Add each to COVERAGE: a case comparing "
                         "DGPOTrainer with GRPOTrainer, a refusal in DGPOConfig, or TRL(why the loss never sees it)")
    assert not sorted(set(COVERAGE) - set(own)), "COVERAGE lists fields this TRL no longer has"
    for field, cover in {**COVERAGE, **TRAINING_ARGUMENTS_IN_THE_LOSS}.items():
        if isinstance(cover, TRL):
            continue
        assert cover, field
        for name in cover:
            assert name in CASES or name in REFUSALS, (field, name)
        # at least one of them sets the field (use_vllm: set on the trainers, as vLLM's generation needs a GPU)
        sets = [CASES[name].fields if name in CASES else REFUSALS[name][0] for name in cover]
        assert any(field in fields for fields in sets) or (field == "use_vllm" and all(
            CASES[name].vllm for name in cover)), f"no case for {field} sets it"


def test_dgpo_trainer_overrides_only_the_loss():
    """Every other GRPOTrainer and Trainer method is inherited: the fields marked TRL(...) act as in TRL."""
    from dgpo_ops.trainer import DGPOTrainer
    from trl import GRPOTrainer

    mro = DGPOTrainer.__mro__
    own = mro[:mro.index(GRPOTrainer)]  # DGPOTrainer and the mixins it is composed of
    overridden = {name for cls in own for name, value in vars(cls).items()
                  if hasattr(GRPOTrainer, name) and (callable(value) or isinstance(value, property))
                  and (not name.startswith("__") or name == "__init__")}
    assert overridden == set(OVERRIDES)


def test_no_two_mixins_override_one_method():
    """Each method DGPOTrainer changes has one definition among its mixins: their order in the class list decides
    nothing (a second override would run or not by that order, through ``super()``)."""
    from dgpo_ops.trainer import DGPOTrainer
    from trl import GRPOTrainer

    mro = DGPOTrainer.__mro__
    definers = {}
    for cls in mro[:mro.index(GRPOTrainer)]:
        for name, value in vars(cls).items():
            if callable(value) and not name.startswith("__"):
                definers.setdefault(name, []).append(cls.__name__)
    assert {name: classes for name, classes in definers.items() if len(classes) > 1} == {}


# ----------------------------------------------------------------------------- first updates


def _close(ours, theirs, rtol, what):
    if isinstance(theirs, float) and math.isnan(theirs):
        assert math.isnan(ours), what
        return
    assert ours == pytest.approx(theirs, rel=rtol, abs=rtol * 1e-2), what


def _first_updates(case: Case, model_dir, tmp_path, fused="linear", trl_side=None):
    """GRPOTrainer's and DGPOTrainer's first micro-batches of ``case`` on the same batch: ``(theirs, ours, steps)``,
    each step ``((loss, grads) of theirs, (loss, grads) of ours)``.

    ``trl_side``: a dict that keeps GRPOTrainer's side (the trainer, the batch, its steps and off-policy masks),
    which does not depend on ``fused``: given the dict that a call for the other route filled, this call makes
    and steps DGPOTrainer alone, on a copy of the same batch, and takes GRPOTrainer's side from it."""
    from dgpo_ops.trainer import DGPOConfig, DGPOTrainer
    from trl import GRPOConfig, GRPOTrainer

    kept = trl_side.pop("kept", None) if trl_side is not None else None
    theirs = kept["trainer"] if kept else make_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl",
                                                       **case.fields)
    ours = make_trainer(DGPOTrainer, DGPOConfig, model_dir, tmp_path / "ours", fused=fused, **case.fields)
    for trainer in (theirs, ours):
        trainer.use_vllm = trainer.use_vllm or case.vllm
    inputs = copy.deepcopy(kept["inputs"]) if kept else first_update_batch(theirs, **case.batch)
    pristine = None if kept else copy.deepcopy(inputs)
    steps, masks = [], {"theirs": [], "ours": []}
    real, side = GRPOTrainer.get_off_policy_mask, ["theirs"]

    def off_policy_mask(*args, **kwargs):
        masks[side[0]].append(real(*args, **kwargs))
        return masks[side[0]][-1]

    with mock.patch.object(GRPOTrainer, "get_off_policy_mask", side_effect=off_policy_mask):
        for step in range(case.steps):
            side[0] = "theirs"
            theirs_step = kept["steps"][step] if kept else loss_and_grads(theirs, inputs)
            side[0] = "ours"
            steps.append((theirs_step, loss_and_grads(ours, inputs)))
    if kept:
        masks["theirs"] = kept["masks"]
    elif trl_side is not None:
        trl_side["kept"] = {"trainer": theirs, "inputs": pristine, "steps": [step[0] for step in steps],
                            "masks": masks["theirs"]}
    if case.fields.get("off_policy_mask_threshold") is not None:  # the mask drops a sequence, on both sides
        both = masks["theirs"] + masks["ours"]
        assert len(masks["theirs"]) == len(masks["ours"]) == case.steps, masks
        assert all(0 < mask.sum() < mask.numel() for mask in both), both
    return theirs, ours, steps


# GRPOTrainer's side of each case, made by the case's first route and taken by its second (they run one after the
# other): building and stepping TRL's trainer was half of each test, and it is the same for both routes.
_TRL_SIDES: dict[str, dict] = {}


@pytest.mark.parametrize("fused", ["linear", "logits"])
@pytest.mark.parametrize("name", list(CASES))
def test_first_update_matches_grpo_trainer(name, fused, model_dirs, tmp_path):
    case = CASES[name]
    theirs, ours, steps = _first_updates(case, model_dirs[case.model], tmp_path, fused,
                                         trl_side=_TRL_SIDES.setdefault(name, {}))
    for step, ((loss_trl, grads_trl), (loss_ours, grads_ours)) in enumerate(steps):
        _close(loss_ours.item(), loss_trl.item(), case.rtol, f"loss, step {step}")
        assert grads_ours.keys() == grads_trl.keys()
        norm_trl = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads_trl.values()]))
        norm_ours = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads_ours.values()]))
        _close(norm_ours.item(), norm_trl.item(), 10 * case.rtol, f"gradient norm, step {step}")
        for param, grad in grads_trl.items():
            torch.testing.assert_close(grads_ours[param], grad, rtol=10 * case.rtol,
                                       atol=10 * case.rtol * grad.abs().max().item() + 1e-9,
                                       msg=lambda m, p=param: f"{p}, step {step}: {m}")
    # TRL's metrics under TRL's names and values; dgpo-ops' own beside them
    metrics_trl, metrics_ours = theirs._metrics["train"], ours._metrics["train"]
    for key, values in metrics_trl.items():
        assert key in metrics_ours, key
        assert len(metrics_ours[key]) == len(values), key
        for value_ours, value_trl in zip(metrics_ours[key], values):
            _close(value_ours, value_trl, 10 * case.rtol, key)
    for key in ("eur", "ratio_mean", "clip_ratio/lp_mean", "clip_ratio/hn_mean", "clip_ratio/dual_mean"):
        assert key in metrics_ours, key
    if case.model in ("qwen2.5-vl", "gemma3"):  # the vision tower and the projector learn, as under TRL
        vision = [g for p, g in grads_ours.items() if "visual" in p or "vision" in p or "projector" in p]
        assert vision and sum(g.abs().sum() for g in vision) > 0
    if name == "adaptive entropy, below target":
        assert ours.entropy_coef == theirs.entropy_coef == 0.12


@pytest.mark.parametrize("fused", ["linear", "logits"])
def test_cast_lm_head_to_fp32_multiplies_in_fp32(fused, model_dirs, tmp_path):
    """The case above passes only with the head in fp32: in the autocast's bf16, the loss moves by far more."""
    theirs, ours, [((loss_trl, _), (loss_ours, _))] = _first_updates(CASES["cast_lm_head_to_fp32"],
                                                                     model_dirs["qwen2 untied"], tmp_path, fused)
    ours.args.cast_lm_head_to_fp32 = False
    bf16_loss = ours._compute_loss(ours.model, first_update_batch(theirs)).item()
    assert abs(bf16_loss - loss_trl.item()) > 100 * abs(loss_ours.item() - loss_trl.item())


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refused_fields_fail_when_the_config_is_made(name, tmp_path):
    import dataclasses

    from dgpo_ops.trainer import DGPOConfig
    from trl import GRPOConfig

    fields, message = REFUSALS[name]
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    trl_names = {f.name for f in dataclasses.fields(GRPOConfig)}
    GRPOConfig(**common, **{k: v for k, v in fields.items() if k in trl_names})  # TRL takes its fields
    with pytest.raises(ValueError, match=message):
        DGPOConfig(**common, **fields)


# ----------------------------------------------------------------------------- set-ups as a TRL user has them


def test_a_grpo_config_or_none_is_taken(model_dirs, tmp_path, monkeypatch):
    """DGPOTrainer(model, reward_funcs, args=GRPOConfig(...)) trains what GRPOTrainer trains (the config's
    loss_type names the objective); args=None takes DGPOConfig's defaults, which are GRPOConfig's."""
    from dgpo_ops.trainer import DGPOConfig, DGPOTrainer
    from trl import GRPOConfig, GRPOTrainer

    fields = dict(loss_type="cispo", epsilon_high=5.0, entropy_coef=0.2, top_entropy_quantile=0.5)
    theirs = make_trainer(GRPOTrainer, GRPOConfig, model_dirs["qwen2"], tmp_path / "trl", **fields)
    ours = make_trainer(DGPOTrainer, GRPOConfig, model_dirs["qwen2"], tmp_path / "ours", **fields)
    assert isinstance(ours.args, DGPOConfig) and ours.args.policy_loss == "cispo"
    inputs = first_update_batch(theirs)
    (loss_trl, _), (loss_ours, _) = loss_and_grads(theirs, inputs), loss_and_grads(ours, inputs)
    assert loss_ours.item() == pytest.approx(loss_trl.item(), rel=1e-5)

    # args=None: TRL's defaults, bf16 included, which this CPU-only machine refuses as GRPOTrainer's does ...
    monkeypatch.chdir(tmp_path)
    for cls in (GRPOTrainer, DGPOTrainer):
        with pytest.raises(ValueError, match="Your setup doesn't support bf16/gpu"):
            cls(model_dirs["qwen2"], length_reward, train_dataset=prompt_dataset(), processing_class=build_tokenizer())
    # ... and takes where bf16 is supported
    with mock.patch("transformers.training_args.is_torch_bf16_gpu_available", return_value=True):
        trainer = DGPOTrainer(model_dirs["qwen2"], length_reward, train_dataset=prompt_dataset(),
                              processing_class=build_tokenizer())
    assert isinstance(trainer.args, DGPOConfig) and trainer.args.output_dir.endswith("qwen2-DGPO")
    assert (trainer.args.policy_loss, trainer.args.loss_type, trainer.args.bf16) == ("grpo", "dapo", True)


def _train(cls, config_cls, model_dir, output_dir, **fields):
    args = config_cls(output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, use_cpu=True, bf16=False, report_to=[], logging_steps=1, max_steps=2,
                      num_iterations=2, learning_rate=1e-3, seed=0, save_strategy="no", disable_tqdm=True, **fields)
    trainer = cls(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                  processing_class=build_tokenizer())
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("model", ["qwen2", "moe router logits"])
def test_two_training_steps_log_what_grpo_trainer_logs(model, model_dirs, tmp_path):
    """Whole steps (TRL's generation, rewards, old log-probs, the loss, the optimizer): the same completions, so
    the same logs; TRL's masks are applied through TRL's own functions, as often as GRPOTrainer calls them
    (the off-policy mask was never applied before: GRPOTrainer called get_off_policy_mask twice, DGPOTrainer never)."""
    from dgpo_ops.trainer import DGPOConfig, DGPOTrainer
    from trl import GRPOConfig, GRPOTrainer

    fields = dict(off_policy_mask_threshold=0.01, top_entropy_quantile=0.5, entropy_coef=0.1)
    logs, calls = {}, {}
    for cls, config_cls in ((GRPOTrainer, GRPOConfig), (DGPOTrainer, DGPOConfig)):
        with mock.patch.object(GRPOTrainer, "get_off_policy_mask", wraps=GRPOTrainer.get_off_policy_mask) as opm, \
                mock.patch.object(GRPOTrainer, "get_high_entropy_mask", autospec=True,
                                  side_effect=GRPOTrainer.get_high_entropy_mask) as hem:
            logs[cls] = _train(cls, config_cls, model_dirs[model], tmp_path / cls.__name__, **fields)
        calls[cls] = (opm.call_count, hem.call_count)
    assert calls[GRPOTrainer] == calls[DGPOTrainer] == (2, 2)
    theirs, ours = logs[GRPOTrainer], logs[DGPOTrainer]
    assert len(theirs) == len(ours) == 2
    for step_trl, step_ours in zip(theirs, ours):
        for key, value in step_trl.items():
            if key in ("step_time", "learning_rate", "epoch") or not isinstance(value, float):
                continue
            assert key in step_ours, key
            _close(step_ours[key], value, 1e-3, key)
    if model == "moe router logits":
        assert all(step["aux_loss"] > 0 for step in ours)


def test_two_vespo_steps_with_a_kl_log_what_grpo_trainer_logs(model_dirs, tmp_path):
    """Whole steps of loss_type='vespo' with beta > 0 and TRL's default use_bias_correction_kl, num_iterations=2:
    the second pass's ratios move off 1, where the KL's correction by the token's ratio (TRL's) and by vespo's
    summed sequence weight (dgpo-ops' before) part: a run of the old code logged 0.01151 where GRPOTrainer
    logged -0.09911; this one 0.0299 where it logs 0.0253."""
    from dgpo_ops.trainer import DGPOConfig, DGPOTrainer
    from trl import GRPOConfig, GRPOTrainer

    fields = dict(loss_type="vespo", beta=0.1)
    theirs = _train(GRPOTrainer, GRPOConfig, model_dirs["qwen2"], tmp_path / "trl", **fields)
    ours = _train(DGPOTrainer, DGPOConfig, model_dirs["qwen2"], tmp_path / "ours", **fields)
    assert len(theirs) == len(ours) == 2
    for step_trl, step_ours in zip(theirs, ours):
        for key in ("loss", "kl", "entropy", "vespo/phi_seq_mean"):
            _close(step_ours[key], step_trl[key], 1e-3, key)


def test_generate_keeps_the_models_signature(model_dirs):
    """Gemma3's prepare_inputs_for_generation takes **kwargs: generate() then checks attention_mask,
    pixel_values and token_type_ids against the forward's signature, which the fused head keeps."""
    from dgpo_ops.trainer import DGPOTrainer
    from trl import GRPOConfig

    trainer = make_trainer(DGPOTrainer, GRPOConfig, model_dirs["gemma3"], model_dirs["gemma3"] + "-out")
    inputs = first_update_batch(trainer, vision=True)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    model = trainer.model.eval()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"],
                         token_type_ids=inputs["token_type_ids"], max_new_tokens=2, do_sample=False)
    assert out.shape == (ids.shape[0], ids.shape[1] + 2)
