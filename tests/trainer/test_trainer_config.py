"""DGPOConfig checks every field when it is made, not at the first training step, so
a bad setting fails before the model is loaded."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from dgpo_ops.trainer import DGPOConfig
from helpers import required_fields, required_params

from dgpo_ops.methods.catalog import POLICY_LOSSES, resolve
from dgpo_ops.methods.catalog import method_params as catalog_method_params
from dgpo_ops.methods.table import ALIASES, METHODS, method_config
from dgpo_ops.trainer import DGPOConfig


def make(tmp_path, **fields):
    return DGPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **fields)


@pytest.mark.parametrize("field, value, message", [
    ("fused_memory_budget", 0, "fused_memory_budget must be a positive integer"),
    ("fused_memory_budget", -5, "fused_memory_budget must be a positive integer"),
    ("fused_memory_budget", 1.5e6, "fused_memory_budget must be a positive integer"),
    ("fused_memory_budget", True, "fused_memory_budget must be a positive integer"),
    ("fused_logits_on_chip", "yes", "fused_logits_on_chip must be True or False"),
    # A method's own fields are checked whichever policy_loss is chosen (the default is dgpo).
    ("dcpo_r_max", 0.5, "dcpo_r_max=0.5): dcpo: r_max must be in (1.0, inf)"),
    ("gppo_beta1", float("nan"), "gppo_beta1=nan, gppo_beta2=1.0): ce_gppo: beta1 must be a finite number"),
    ("dispo_eps_low_neg", -1.0, "dispo_eps_low_neg=-1.0, dispo_eps_high_neg=100.0): dispo: eps_low_neg"),
    ("sapo_gate", "tanh", "sapo: gate must be one of"),
    ("dual_clip", 1.0, "dual_clip=1.0): grpo: dual_clip must be in (1.0, inf)"),
    ("dgpo_m", 0.5, "dgpo_m=0.5): dgpo: m must be in [1.0, inf)"),
    ("policy_loss", "gspo", "got 'gspo'; GSPO's sequence ratio is an option of every method, not a method: "
                            "keep the method (grpo or any other) and set importance_sampling_level="),
])
def test_a_bad_field_fails_when_the_config_is_made(tmp_path, field, value, message):
    with pytest.raises(ValueError) as error:
        make(tmp_path, **{field: value})
    assert message in str(error.value)


@pytest.mark.parametrize("fields, message", [
    # read by fused='linear' alone
    (dict(fused="logits", fused_memory_budget=2**20), "fused_memory_budget applies to fused='linear'"),
    # DCPO's smooth advantages are made from the weighted reward sum: TRL's scaling and aggregation would do nothing
    (dict(advantage_estimator="dcpo", scale_rewards="batch"), "scale_rewards='batch' shapes TRL's group advantages"),
    (dict(advantage_estimator="dcpo", scale_rewards="none"), "scale_rewards='none' shapes TRL's group advantages"),
    (dict(advantage_estimator="dcpo", multi_objective_aggregation="normalize_then_sum"),
     "multi_objective_aggregation='normalize_then_sum' shapes TRL's group advantages"),
])
def test_a_field_the_other_settings_never_read_fails_when_the_config_is_made(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **fields)


@pytest.mark.parametrize("fields", [
    dict(fused="logits"), dict(fused="linear", fused_memory_budget=2**20),
    dict(advantage_estimator="dcpo"), dict(advantage_estimator="grpo", scale_rewards="batch",
                                           multi_objective_aggregation="normalize_then_sum"),
])
def test_the_same_fields_where_they_are_read_are_taken(tmp_path, fields):
    config = make(tmp_path, **fields)
    assert all(getattr(config, name) == value for name, value in fields.items())


def test_the_aggregation_texts_list_every_aggregation():
    """loss_aggregation's help and DGPOConfig's docstring name every aggregation the package has."""
    import dataclasses
    import re

    from dgpo_ops.core.aggregation import AGGREGATIONS

    help_text = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(DGPOConfig)}["loss_aggregation"]
    docstring = DGPOConfig.__doc__.split("loss_aggregation:")[1].split("advantage_estimator:")[0]
    for name in AGGREGATIONS:
        assert name in re.findall(r"\w+", help_text), name
        assert name in re.findall(r"\w+", docstring), name


def test_the_memory_budget_help_says_the_tiles_are_in_the_compute_dtype():
    import dataclasses

    help_text = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(DGPOConfig)}["fused_memory_budget"]
    assert "compute dtype" in help_text and "fp32 logits tiles" not in help_text


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_a_bad_field_of_the_chosen_method_names_that_method(tmp_path, name):
    """dppo_tv and dppo_kl read the same fields: the error names the method chosen, and policy_loss."""
    with pytest.raises(ValueError, match=rf"\(policy_loss='{name}', .*dppo_is_cap=0\): {name}: is_cap must be in"):
        make(tmp_path, policy_loss=name, dppo_is_cap=0)


def test_logits_on_chip_needs_the_linear_op(tmp_path):
    with pytest.raises(ValueError, match="fused_logits_on_chip=True applies to fused='linear'"):
        make(tmp_path, fused="logits", fused_logits_on_chip=True)
    assert make(tmp_path, fused_logits_on_chip=True).fused_logits_on_chip


def test_dapo_carries_dapos_clip_higher_unless_epsilon_high_is_set(tmp_path):
    dapo = make(tmp_path, policy_loss="dapo").method()
    assert (dapo.name, dapo.eps_low, dapo.eps_high) == ("grpo", 0.2, 0.28)
    explicit = make(tmp_path, policy_loss="dapo", epsilon_high=0.3).method()
    assert explicit.eps_high == 0.3
    assert make(tmp_path, policy_loss="grpo").method().eps_high == 0.2


def test_the_chosen_method_names_policy_loss_and_trl_fields(tmp_path):
    # cispo reads TRL's epsilon_high as its cap 1 + eps_high; left None it falls back to epsilon, which set to
    # TRL's 0.2 is far below 1: the error names both fields.
    with pytest.raises(ValueError, match=r"DGPOConfig\(policy_loss='cispo', epsilon=0.2 \(-> eps_high=-0.8\)\)"):
        make(tmp_path, policy_loss="cispo", epsilon=0.2)
    assert make(tmp_path, policy_loss="cispo", epsilon_high=5.0).method().eps_high == 4.0


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_unset_fields_give_every_method_its_table_defaults(tmp_path, name):
    """Every parameter of every method and alias is the table's default (the alias's preset) when no field
    is set (dcpo's eps_low is 0.16, not TRL's epsilon 0.2); a parameter without a default
    (dro's dro_beta, as verl's) is refused unset, naming its field."""
    method, presets = resolve(name)
    required = required_params(name)
    if required:
        with pytest.raises(ValueError, match=f"policy_loss='{name}'.*{next(iter(required))} must be in"):
            make(tmp_path, policy_loss=name)
    expected = method_config(method, **presets, **required)
    assert make(tmp_path, policy_loss=name, **required_fields(name)).method() == expected
    for p in catalog_method_params(method):
        assert getattr(expected, p.name) == {**presets, **required}.get(p.name, p.default)


@pytest.mark.parametrize("name", [*METHODS, *ALIASES])
def test_every_method_and_alias_gives_loss_options_that_run_it(tmp_path, name):
    """A config naming any method or alias of the table, with the loss-level fields set, gives the fused op's
    options: that method at its table defaults (the alias's presets), and the config's temperature, KL and
    entropy bonus."""
    method, presets = resolve(name)
    config = make(tmp_path, policy_loss=name, fused_memory_budget=2**20, temperature=0.7, beta=0.04,
                  use_bias_correction_kl=True, entropy_coef=0.01, **required_fields(name))
    options = config.loss_options()
    assert options.method == method_config(method, **presets, **required_params(name))
    assert (options.temperature, options.beta, options.kl_ratio_correction, options.entropy_coef) == (0.7, 0.04, True,
                                                                                                     0.01)
    assert (options.aggregation, options.importance_sampling_level) == (config.aggregation,
                                                                        config.importance_sampling_level)


# ---- which objective trains: policy_loss and TRL's loss_type


@pytest.mark.parametrize("fields, method, loss_type, aggregation", [
    ({}, "grpo", "dapo", "trl:dapo"),  # GRPOConfig's defaults: TRL's clipped objective, token mean
    ({"loss_type": "grpo"}, "grpo", "grpo", "trl:grpo"),
    ({"loss_type": "bnpo"}, "grpo", "bnpo", "trl:bnpo"),
    ({"loss_type": "dr_grpo"}, "grpo", "dr_grpo", "trl:dr_grpo"),
    ({"loss_type": "luspo"}, "grpo", "luspo", "trl:luspo"),  # TRL's luspo: one aggregation, one path
    ({"loss_type": "cispo", "epsilon_high": 5.0}, "cispo", "cispo", "trl:cispo"),
    ({"loss_type": "sapo"}, "sapo", "sapo", "trl:sapo"),
    ({"policy_loss": "dgpo"}, "dgpo", "dapo", "trl:dapo"),
    ({"policy_loss": "dgpo", "loss_type": "grpo"}, "dgpo", "grpo", "trl:grpo"),  # the aggregation only
    ({"policy_loss": "dapo", "loss_type": "dr_grpo"}, "dapo", "dr_grpo", "trl:dr_grpo"),
    ({"policy_loss": "cispo", "loss_type": "cispo"}, "cispo", "cispo", "trl:cispo"),
    ({"policy_loss": "sapo", "loss_type": "sapo", "sapo_gate": "erf"}, "sapo", "sapo", "trl:sapo"),
    ({"policy_loss": "dcpo"}, "dcpo", "dapo", "seq_sum_token_mean"),
])
def test_loss_type_names_the_objective_unless_policy_loss_is_set(tmp_path, fields, method, loss_type, aggregation):
    config = make(tmp_path, **fields)
    assert (config.policy_loss, config.loss_type, config.aggregation) == (method, loss_type, aggregation)
    again = make(tmp_path, **{**fields, "policy_loss": config.policy_loss})  # resolved: a copy resolves the same
    assert again.method() == config.method()


@pytest.mark.parametrize("policy_loss, loss_type, use", [
    ("dgpo", "cispo", "loss_type='dapo'"), ("grpo", "sapo", "loss_type='grpo'"), ("dispo", "cispo", "loss_type='dapo'"),
    ("dgpo", "vespo", "loss_type='dapo'"),
])
def test_a_loss_type_that_names_another_objective_conflicts_with_policy_loss(tmp_path, policy_loss, loss_type, use):
    with pytest.raises(ValueError, match=f"loss_type='{loss_type}' names TRL's {loss_type} objective.*{use}"):
        make(tmp_path, policy_loss=policy_loss, loss_type=loss_type)


def test_unknown_loss_type_is_refused_and_vespo_needs_the_method_table(tmp_path):
    with pytest.raises(ValueError, match="loss_type must be one of TRL's"):
        make(tmp_path, loss_type="ppo")
    if "vespo" in POLICY_LOSSES:  # TRL's VESPO objective, from the method table
        config = make(tmp_path, loss_type="vespo", vespo_k_pos=1.5)
        assert (config.policy_loss, config.aggregation, config.method().k_pos) == ("vespo", "trl:vespo", 1.5)
    else:
        with pytest.raises(ValueError, match="loss_type='vespo' is not yet fused.*GRPOTrainer"):
            make(tmp_path, loss_type="vespo")


def test_delta_is_grpos_and_refused_by_other_methods(tmp_path):
    """TRL's two-sided clip is a parameter of its clipped objective; another method would ignore it."""
    assert make(tmp_path, delta=1.1).method().delta == 1.1
    assert make(tmp_path, loss_type="dr_grpo", delta=3.0).method().delta == 3.0
    with pytest.raises(ValueError, match="gppo.*set dual_clip"):
        make(tmp_path, policy_loss="gppo", delta=2.0)
    with pytest.raises(ValueError, match="dgpo has no such cap"):
        make(tmp_path, policy_loss="dgpo", delta=2.0)


def test_trl_features_the_fused_path_runs_are_accepted(tmp_path):
    config = make(tmp_path, top_entropy_quantile=0.2, use_adaptive_entropy=True, entropy_coef=0.01,
                  off_policy_mask_threshold=0.5, cast_lm_head_to_fp32=True, use_liger_kernel=True)
    assert config.top_entropy_quantile == 0.2
    with pytest.raises(ValueError, match=r"top_entropy_quantile must be in \[0, 1\]"):
        make(tmp_path, top_entropy_quantile=1.5)


def test_a_grpo_config_becomes_the_same_dgpo_config(tmp_path):
    import dataclasses

    from trl import GRPOConfig

    grpo = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], loss_type="sapo",
                      steps_per_generation=4, gradient_accumulation_steps=2, beta=0.01)
    dgpo = DGPOConfig.from_grpo_config(grpo)
    assert all(getattr(dgpo, f.name) == getattr(grpo, f.name) for f in dataclasses.fields(GRPOConfig))
    assert dgpo.policy_loss == "sapo"


@pytest.mark.parametrize("policy_loss, fields, params", [
    ("grpo", {"dgpo_n": 2.0}, {"n": 2.0}),
    ("dapo", {"dgpo_n": 2.0, "dcpo_r_max": 5.0}, {"n": 2.0, "r_max": 5.0}),
    ("dgpo", {"dcpo_r_max": 5.0}, {"r_max": 5.0}),
])
def test_a_field_the_chosen_method_does_not_take_is_refused_as_the_function_refuses_it(tmp_path, policy_loss,
                                                                                        fields, params):
    """A field of another method's parameter was ignored; the function form refuses the same keyword."""
    with pytest.raises(ValueError) as function_error:
        method_config(policy_loss, **params)
    with pytest.raises(ValueError) as config_error:
        make(tmp_path, policy_loss=policy_loss, **fields)
    assert str(function_error.value) in str(config_error.value)
    assert all(f"{name}={value!r}" in str(config_error.value) for name, value in fields.items())


def test_a_field_at_its_default_or_of_the_chosen_method_is_taken(tmp_path):
    default = DGPOConfig.__dataclass_fields__["dgpo_n"].default
    assert make(tmp_path, policy_loss="grpo", dgpo_n=default).method().name == "grpo"
    assert make(tmp_path, policy_loss="dgpo", dgpo_n=2.0).method().n == 2.0
