"""verl 0.9.1: ``agg_loss``'s modes over verl's step (``global_batch_info``), the fields of verl's actor config that
mean a method parameter, a method whose verl loss aggregates its own way, and verl's rollout correction."""

from __future__ import annotations

from dgpo_ops.corrections.verl import VerlCorrection
from dgpo_ops.frameworks.core import AggregationRow, ConfigField, FrameworkSpec, MethodFields, Scope
from dgpo_ops.kernels.interface import Denominator

SOURCE = ("verl 0.9.1 verl/trainer/ppo/core_algos.py agg_loss L1170-1202; global_batch_info from "
          "verl/workers/engine/fsdp/transformer_impl.py L724-735, verl/workers/utils/losses.py L64-68; the row count "
          "from verl/trainer/ppo/ray_trainer.py L1352-1362")
ACTOR = "actor_rollout_ref.actor"

SPEC = FrameworkSpec(
    name="verl", title="verl",
    aggregations=(
        AggregationRow("token-mean", False, Denominator.TOKENS, Scope.STEP, "global_batch_info batch_num_tokens",
                       SOURCE),
        AggregationRow("token-sum", False, Denominator.ONE, Scope.STEP, "1", SOURCE),
        AggregationRow("seq-mean-token-mean", True, Denominator.RESPONSES, Scope.STEP,
                       "global_batch_size (every row, fully masked ones included)", SOURCE),
        AggregationRow("seq-mean-token-sum", False, Denominator.RESPONSES, Scope.STEP, "global_batch_size", SOURCE),
        AggregationRow("seq-mean-token-sum-norm", False, Denominator.GRID, Scope.STEP,
                       "global_batch_size x loss_scale_factor (else the padded width)", SOURCE),
    ),
    # A parameter without a field here is read from policy_loss.method_params only.
    fields=MethodFields(
        root=ACTOR, params_field="policy_loss.method_params",
        by_param={
            # clip_ratio_low / clip_ratio_high: None means clip_ratio (as verl's own losses read them)
            "eps_low": ConfigField("clip_ratio_low", fallback="clip_ratio"),
            "eps_high": ConfigField("clip_ratio_high", fallback="clip_ratio"),
            "dual_clip": ConfigField("clip_ratio_c"),
            # dppo's divergence thresholds and weight cap are what verl's dppo losses read its clip fields as
            "delta_low": ConfigField("clip_ratio_low", fallback="clip_ratio"),
            "delta_high": ConfigField("clip_ratio_high", fallback="clip_ratio"),
            "is_cap": ConfigField("clip_ratio_c"),
            "tau_pos": ConfigField("tau_pos"),
            "tau_neg": ConfigField("tau_neg"),
            "dro_beta": ConfigField("policy_loss.dro_beta"),  # no constant: None raises in verl too
            # when_null: verl's code constant for a null field (which may differ from its config's default)
            "clip_cov_ratio": ConfigField("policy_loss.clip_cov_ratio", when_null=2e-4),
            "clip_cov_lb": ConfigField("policy_loss.clip_cov_lb", when_null=1.0),
            "clip_cov_ub": ConfigField("policy_loss.clip_cov_ub", when_null=5.0),
            "kl_cov_ratio": ConfigField("policy_loss.kl_cov_ratio", when_null=2e-4),
            "ppo_kl_coef": ConfigField("policy_loss.ppo_kl_coef", when_null=1.0),  # the config's default is 0.1
        },
        # DCPO's eps bound the old probability, which verl's clip fields do not mean
        by_method={("dcpo", "eps_low"): None, ("dcpo", "eps_high"): None},
    ),
    correction=VerlCorrection, correction_config="algorithm.rollout_correction",
)

# What a row's denominator is in global_batch_info: the key of its global count (GRID: times the horizon,
# loss_scale_factor or the padded width); ONE: none.
COUNT_KEYS: dict[Denominator, str | None] = {
    Denominator.TOKENS: "batch_num_tokens", Denominator.RESPONSES: "global_batch_size",
    Denominator.GRID: "global_batch_size", Denominator.ONE: None,
}
HORIZON_DENOMINATORS = (Denominator.GRID,)
# verl's geo_mean: torch.mean over the micro-batch's rows of each response's loss (its length plus 1e-8 divides the
# token sum), whatever loss_agg_mode and global_batch_info say.
ROW_MEAN = "row-mean"
METHOD_AGGREGATIONS: dict[str, str] = {"geo_mean": ROW_MEAN}

if {row.denominator for row in SPEC.aggregations} - set(COUNT_KEYS):
    raise AssertionError("a verl row's denominator has no count in global_batch_info (COUNT_KEYS)")
