"""SkyRL 0.3.0: ``loss_reduction``'s modes over SkyRL's mini-batch (its trainer scales the advantages by the
mini-batch's count before the loss, its worker multiplies the loss by dp_size), the fields of its algorithm config
that mean a method parameter, and its off-policy correction."""

from __future__ import annotations

from dgpo_ops.corrections.skyrl import SkyRLCorrection
from dgpo_ops.frameworks.core import AggregationRow, ConfigField, FrameworkSpec, MethodFields, Scope
from dgpo_ops.kernels.interface import Denominator

SOURCE = ("skyrl 0.3.0 skyrl/backends/skyrl_train/utils/ppo_utils.py apply_loss_reduction_to_advantages_minibatch "
          "L1095-1150 (the advantages scaled before the off-policy correction; the loss sums); "
          "skyrl/backends/skyrl_train/workers/worker.py L982-989 (the loss x dp_size)")

SPEC = FrameworkSpec(
    name="skyrl", title="SkyRL",
    aggregations=(
        AggregationRow("token_mean", False, Denominator.TOKENS, Scope.STEP,
                       "the mini-batch's tokens over every dp rank, counted before the off-policy correction",
                       SOURCE),
        AggregationRow("sequence_mean", True, Denominator.RESPONSES, Scope.STEP,
                       "the mini-batch's responses over every dp rank", SOURCE),
        AggregationRow("seq_mean_token_sum_norm", False, Denominator.GRID, Scope.STEP,
                       "the mini-batch's responses over every dp rank x max_seq_len", SOURCE),
    ),
    # A path under trainer.algorithm; a parameter without one is read from method_params only.
    fields=MethodFields(
        root="trainer.algorithm", params_field="method_params",
        by_param={
            "eps_low": ConfigField("eps_clip_low"),
            "eps_high": ConfigField("eps_clip_high"),
            "tau_pos": ConfigField("sapo.tau_pos"),
            "tau_neg": ConfigField("sapo.tau_neg"),
            # SkyRL's dppo reads its own thresholds; prime_dppo's keep band is the same total variation
            "delta_low": ConfigField("dppo.delta_low"),
            "delta_high": ConfigField("dppo.delta_high"),
            "clip_cov_ratio": ConfigField("clip_cov.clip_ratio"),
            "clip_cov_lb": ConfigField("clip_cov.clip_cov_lb"),
            "clip_cov_ub": ConfigField("clip_cov.clip_cov_ub"),
            "kl_cov_ratio": ConfigField("kl_cov.kl_cov_frac"),
            "ppo_kl_coef": ConfigField("kl_cov.ppo_kl_coef"),
        },
        # SkyRL's cispo reads its own bounds (defaults 0 and 5); DCPO's eps bound the old probability
        by_method={
            ("cispo", "eps_low"): ConfigField("cispo.cispo_eps_clip_low"),
            ("cispo", "eps_high"): ConfigField("cispo.cispo_eps_clip_high"),
            ("dcpo", "eps_low"): None,
            ("dcpo", "eps_high"): None,
        },
    ),
    correction=SkyRLCorrection, correction_config="trainer.algorithm.off_policy_correction",
)
