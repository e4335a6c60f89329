"""The SkyRL integration's parts that need no SkyRL (dgpo_ops/integrations/skyrl_params.py): its table in
docs/integrations.md, where a loss's parameters come from, and SkyRL's off-policy correction config. SkyRL itself is
the oracle in tests/integrations/test_skyrl_registry.py, which runs in SkyRL's own venv (.ci/skyrl_cpu.sh)."""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers import docs_tool, value_error_message

from dgpo_ops.corrections import SkyRLCorrection
from dgpo_ops.integrations import skyrl_params
from dgpo_ops.methods import catalog
from dgpo_ops.methods.table import METHODS


@dataclass
class Section:
    """A stand-in for one of SkyRL's nested algorithm configs (its fields as attributes)."""

    values: dict

    def __getattr__(self, name):
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Algorithm:
    """A stand-in for SkyRL's AlgorithmConfig with SkyRL 0.3.0's defaults of the fields the losses read."""

    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    clip_ratio_c: float = 3.0
    sapo: Section = field(default_factory=lambda: Section({"tau_pos": 1.0, "tau_neg": 1.05}))
    cispo: Section = field(default_factory=lambda: Section({"cispo_eps_clip_low": 0.0, "cispo_eps_clip_high": 5.0}))
    dppo: Section = field(default_factory=lambda: Section({"dppo_type": "binary_tv", "delta_low": 0.2,
                                                           "delta_high": 0.2}))
    clip_cov: Section = field(default_factory=lambda: Section({"clip_ratio": 2e-4, "clip_cov_lb": 1.0,
                                                               "clip_cov_ub": 5.0}))
    kl_cov: Section = field(default_factory=lambda: Section({"kl_cov_frac": 0.2, "ppo_kl_coef": 1.0}))
    off_policy_correction: dict = field(default_factory=dict)
    method_params: dict = field(default_factory=dict)


def method(loss_type, **fields):
    return skyrl_params.loss_options(loss_type, Algorithm(**fields)).method


def test_the_skyrl_table_lists_every_loss():
    """docs/integrations.md's SkyRL table (``python docs/generate.py`` writes it; tests/package/test_generated_docs.py
    fails while it is stale) names every ``dgpo_ops.*`` loss, and SkyRL's fields (its spec) where they are read."""
    table = docs_tool().skyrl_methods_markdown()
    for loss_type in skyrl_params.LOSS_TYPES:
        assert f"| `{loss_type}` |" in table
    assert "`eps_low` <- `cispo.cispo_eps_clip_low`" in table and "`n=1`, `m=2`" in table


def test_every_policy_loss_is_a_skyrl_loss_type():
    assert set(skyrl_params.LOSS_TYPES.values()) == set(catalog.POLICY_LOSSES)


def test_parameters_come_from_method_params_then_skyrl_fields_then_defaults():
    dgpo = method("dgpo_ops.dgpo", eps_clip_high=0.28, method_params={"n": 2.0})
    assert (dgpo.eps_low, dgpo.eps_high, dgpo.n, dgpo.m) == (0.2, 0.28, 2.0, 2.0)
    assert method("dgpo_ops.dgpo", method_params={"eps_high": 0.3}).eps_high == 0.3  # method_params win
    # SkyRL's cispo bounds are its own fields; DCPO's eps are not SkyRL's clip
    cispo = method("dgpo_ops.cispo")
    assert (cispo.eps_low, cispo.eps_high) == (0.0, 5.0)
    dcpo = method("dgpo_ops.dcpo", eps_clip_low=0.3)
    assert (dcpo.eps_low, dcpo.eps_high) == (0.16, 0.2)
    # clip_ratio_c is SkyRL's dual_clip loss's, not regular's: grpo's dual clip stays off unless asked for
    assert method("dgpo_ops.grpo", clip_ratio_c=2.0).dual_clip is None
    assert method("dgpo_ops.grpo", method_params={"dual_clip": 2.0}).dual_clip == 2.0
    # an alias's presets win over SkyRL's field
    assert method("dgpo_ops.dapo", eps_clip_high=0.2).eps_high == 0.28
    sapo = method("dgpo_ops.sapo")
    assert (sapo.tau_pos, sapo.tau_neg) == (1.0, 1.05)
    assert (method("dgpo_ops.prime_dppo").delta_low, method("dgpo_ops.dppo_kl").delta_high) == (0.2, 0.2)
    kl_cov = method("dgpo_ops.kl_cov")
    assert (kl_cov.kl_cov_ratio, kl_cov.ppo_kl_coef) == (0.2, 1.0)
    clip_cov = method("dgpo_ops.clip_cov")
    assert (clip_cov.clip_cov_ratio, clip_cov.clip_cov_lb, clip_cov.clip_cov_ub) == (2e-4, 1.0, 5.0)
    assert skyrl_params.loss_options("dgpo_ops.grpo", Algorithm()).aggregation == "token_sum"


def test_bad_parameters_name_the_field():
    assert "trainer.algorithm.method_params.r_max" in value_error_message(
        lambda: method("dgpo_ops.dgpo", method_params={"r_max": 2}))
    assert "trainer.algorithm.eps_clip_low" in value_error_message(lambda: method("dgpo_ops.grpo", eps_clip_low=1.5))
    assert "trainer.algorithm.cispo.cispo_eps_clip_high" in value_error_message(
        lambda: method("dgpo_ops.cispo", cispo=Section({"cispo_eps_clip_low": 0.0, "cispo_eps_clip_high": -1.0})))
    assert "dro_beta" in value_error_message(lambda: method("dgpo_ops.dro"))  # no default, as verl's
    assert "unknown dgpo-ops loss" in value_error_message(lambda: method("dgpo_ops.nope"))
    assert "trainer.algorithm.importance_sampling_level" in value_error_message(
        lambda: skyrl_params.loss_options("dgpo_ops.grpo", {**Algorithm().__dict__, "importance_sampling_level": "x"}))
    assert "trainer.algorithm.eps_clip_low is missing" in value_error_message(
        lambda: skyrl_params.loss_options("dgpo_ops.grpo", {}))


def test_the_off_policy_correction_is_skyrls():
    assert skyrl_params.correction_from_skyrl(Algorithm()) is None
    assert skyrl_params.correction_from_skyrl(Algorithm(off_policy_correction={"tis_ratio_type": None})) is None
    given = {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.5, "token_mask_is_threshold_low": 0.5,
             "token_mask_is_threshold_high": 2.0}
    assert skyrl_params.correction_from_skyrl(Algorithm(off_policy_correction=given)) == SkyRLCorrection(**given)
    # an outlier threshold alone turns SkyRL's correction on (off_policy_correction_enabled)
    alone = skyrl_params.correction_from_skyrl(Algorithm(off_policy_correction={"outlier_token_is_threshold_high": 9}))
    assert alone == SkyRLCorrection(outlier_token_is_threshold_high=9)
    assert "trainer.algorithm.off_policy_correction.token_mask_eps_low" in value_error_message(
        lambda: skyrl_params.correction_from_skyrl(Algorithm(off_policy_correction={"token_mask_eps_low": 0.1})))
    assert "trainer.algorithm.off_policy_correction: token_mask_is_threshold_low" in value_error_message(
        lambda: skyrl_params.correction_from_skyrl(Algorithm(off_policy_correction={
            "token_mask_is_threshold_low": 0.5})))
