"""``DGPOConfig``: TRL's ``GRPOConfig`` plus the policy loss of any method of the family."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from dgpo_ops.aggregation import AGGREGATIONS
from dgpo_ops.methods import MethodConfig, method_config
from dgpo_ops.options import LossOptions

POLICY_LOSSES = ("dgpo", "grpo", "dapo", "cispo", "dispo", "gppo", "ce_gppo", "aspo", "dcpo", "sapo")
DAPO_EPSILON_HIGH = 0.28  # DAPO's clip-higher: policy_loss="dapo" is grpo with this epsilon_high unless one is set
FUSED_MODES = ("linear", "logits")
ADVANTAGE_ESTIMATORS = ("grpo", "dcpo")

# TRL loss_type -> (aggregation, whether token_mean counts the tokens of this micro-batch only)
TRL_LOSS_TYPE_AGGREGATION = {
    "grpo": "seq_mean_token_mean",
    "sapo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "dapo": "token_mean",
    "cispo": "token_mean",
}


@dataclass
class DGPOConfig(GRPOConfig):
    r"""
    [`~trl.GRPOConfig`] with the policy loss chosen among dgpo-ops' methods. `epsilon`, `epsilon_high`, `beta`,
    `importance_sampling_level`, `sapo_temperature_pos/neg` and `use_bias_correction_kl` keep their TRL meaning;
    `loss_type` keeps choosing the aggregation (and its normaliser) unless `loss_aggregation` is set.

    Parameters:
        policy_loss (`str`, defaults to `"dgpo"`): one of dgpo, grpo, dapo, cispo, dispo, gppo, ce_gppo, aspo,
            dcpo, sapo. `dapo` is grpo with DAPO's clip-higher: `epsilon_high=0.28` unless `epsilon_high` is set
            (its token-level aggregation is TRL's `loss_type="dapo"`, the default).
        dgpo_n, dgpo_m: DGPO's left-boundary polynomial order and right-boundary radical order.
        dual_clip: dual clip `c > 1` for grpo (off when None), gppo/ce_gppo/aspo (3 when None).
        gppo_beta1, gppo_beta2: CE-GPPO's boundary scales.
        dcpo_r_max: DCPO's ratio cap (and dual clip).
        dispo_eps_low_pos, dispo_eps_high_pos, dispo_eps_low_neg, dispo_eps_high_neg: DISPO's sign-dependent bounds.
        sapo_gate: sapo's gate, one of sigmoid, erf, arctan, softsign (taus from `sapo_temperature_pos/neg`).
        loss_aggregation: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm or seq_sum_token_mean; None
            follows `loss_type` (dcpo: seq_sum_token_mean).
        advantage_estimator: `"grpo"` (TRL's group advantages) or `"dcpo"` (smooth advantage standardisation).
        fused: `"linear"` (hidden states + lm_head, logits never whole) or `"logits"` (the model's logits).
        fused_memory_budget: bytes of logits and gradient tiles for `fused="linear"` (a positive integer).
        max_nonfinite_steps: an optimizer step whose gradients are not finite is skipped with a warning naming the
            step and the first such parameter; this many consecutive skips stop the run with an error.

    For `cispo`, `epsilon_high` is TRL's weight cap itself (dgpo-ops' `1 + eps_high`), and there is no lower clip.
    """

    policy_loss: str = field(default="dgpo", metadata={"help": f"Policy loss: one of {', '.join(POLICY_LOSSES)}."})
    dgpo_n: float = field(default=1.0, metadata={"help": "DGPO: polynomial decay order on the left boundary."})
    dgpo_m: float = field(default=2.0, metadata={"help": "DGPO: radical decay order on the right boundary."})
    dual_clip: float | None = field(default=None, metadata={"help": "Dual clip c > 1 (grpo/gppo/ce_gppo/aspo)."})
    gppo_beta1: float = field(default=0.75, metadata={"help": "CE-GPPO: left-boundary scale."})
    gppo_beta2: float = field(default=1.0, metadata={"help": "CE-GPPO: right-boundary scale."})
    dcpo_r_max: float = field(default=10.0, metadata={"help": "DCPO: ratio cap."})
    dispo_eps_low_pos: float = field(default=0.2, metadata={"help": "DISPO: eps_low for A > 0."})
    dispo_eps_high_pos: float = field(default=10.0, metadata={"help": "DISPO: eps_high for A > 0."})
    dispo_eps_low_neg: float = field(default=1.0, metadata={"help": "DISPO: eps_low for A < 0."})
    dispo_eps_high_neg: float = field(default=100.0, metadata={"help": "DISPO: eps_high for A < 0."})
    sapo_gate: str = field(default="sigmoid", metadata={"help": "SAPO gate: sigmoid, erf, arctan or softsign."})
    loss_aggregation: str | None = field(default=None, metadata={"help": "Aggregation; None follows loss_type."})
    advantage_estimator: str = field(default="grpo", metadata={"help": "Advantages: grpo or dcpo."})
    fused: str = field(default="linear", metadata={"help": "linear (hidden states + lm_head) or logits."})
    fused_memory_budget: int = field(default=512 * 2**20, metadata={"help": "Bytes of fp32 logits tiles."})
    max_nonfinite_steps: int = field(default=3, metadata={
        "help": "Optimizer steps with non-finite gradients are skipped; this many in a row stop the run."})

    def __post_init__(self):
        super().__post_init__()
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {', '.join(POLICY_LOSSES)}, got {self.policy_loss!r}")
        if self.fused not in FUSED_MODES:
            raise ValueError(f"fused must be one of {FUSED_MODES}, got {self.fused!r}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {self.advantage_estimator!r}")
        if self.loss_aggregation is not None and self.loss_aggregation not in AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be None or one of {', '.join(AGGREGATIONS)}")
        if self.loss_aggregation is None and self.loss_type not in TRL_LOSS_TYPE_AGGREGATION:
            raise ValueError(
                f"loss_type={self.loss_type!r} has no dgpo-ops aggregation; use one of "
                f"{', '.join(TRL_LOSS_TYPE_AGGREGATION)} or set loss_aggregation"
            )
        unsupported = {
            "delta": self.delta is not None,
            "top_entropy_quantile": self.top_entropy_quantile < 1.0,
            "use_adaptive_entropy": bool(getattr(self, "use_adaptive_entropy", False)),
            "use_liger_kernel": bool(self.use_liger_kernel),
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(f"DGPOConfig does not support {name} (the fused loss replaces that code path)")
        if (isinstance(self.fused_memory_budget, bool) or not isinstance(self.fused_memory_budget, int)
                or self.fused_memory_budget < 1):
            raise ValueError(f"fused_memory_budget must be a positive integer number of bytes, got "
                             f"{self.fused_memory_budget!r}")
        if isinstance(self.max_nonfinite_steps, bool) or not isinstance(self.max_nonfinite_steps, int) or \
                self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps must be an integer >= 1, got {self.max_nonfinite_steps!r}")
        # Every method's own fields, whichever method is chosen: a bad value fails here, not when a
        # later run switches policy_loss.
        for fields, build in self._method_field_checks():
            try:
                build()
            except ValueError as error:
                raise ValueError(f"DGPOConfig({', '.join(fields)}): {error}") from None
        self.loss_options()  # the chosen method with the shared fields (epsilon, ...), now, not at the first step

    def _method_field_checks(self):
        dual_clip = 3.0 if self.dual_clip is None else self.dual_clip
        return [
            (("dgpo_n", "dgpo_m"), lambda: method_config("dgpo", n=self.dgpo_n, m=self.dgpo_m)),
            (("dual_clip",), lambda: method_config("grpo", dual_clip=self.dual_clip)),
            (("gppo_beta1", "gppo_beta2", "dual_clip"),
             lambda: method_config("ce_gppo", beta1=self.gppo_beta1, beta2=self.gppo_beta2, dual_clip=dual_clip)),
            (("dcpo_r_max",), lambda: method_config("dcpo", r_max=self.dcpo_r_max)),
            (("dispo_eps_low_pos", "dispo_eps_high_pos", "dispo_eps_low_neg", "dispo_eps_high_neg"),
             lambda: method_config("dispo", eps_low_pos=self.dispo_eps_low_pos, eps_high_pos=self.dispo_eps_high_pos,
                                   eps_low_neg=self.dispo_eps_low_neg, eps_high_neg=self.dispo_eps_high_neg)),
            (("sapo_gate", "sapo_temperature_pos", "sapo_temperature_neg"),
             lambda: method_config("sapo", gate=self.sapo_gate, tau_pos=self.sapo_temperature_pos,
                                   tau_neg=self.sapo_temperature_neg)),
        ]

    @property
    def aggregation(self) -> str:
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        if self.policy_loss == "dcpo":
            return "seq_sum_token_mean"
        return TRL_LOSS_TYPE_AGGREGATION[self.loss_type]

    def method(self) -> MethodConfig:
        eps_low = self.epsilon
        eps_high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        name = self.policy_loss
        if name == "dapo" and self.epsilon_high is None:
            eps_high = DAPO_EPSILON_HIGH
        if name in ("grpo", "dapo"):
            return method_config("grpo", eps_low=eps_low, eps_high=eps_high, dual_clip=self.dual_clip)
        if name == "cispo":
            if eps_high < 1.0:
                raise ValueError(f"cispo: epsilon_high is the weight cap (TRL semantics) and must be >= 1, got {eps_high}")
            return method_config("cispo", eps_low=1.0, eps_high=eps_high - 1.0)
        if name == "dispo":
            return method_config("dispo", eps_low_pos=self.dispo_eps_low_pos, eps_high_pos=self.dispo_eps_high_pos,
                                 eps_low_neg=self.dispo_eps_low_neg, eps_high_neg=self.dispo_eps_high_neg)
        dual_clip = 3.0 if self.dual_clip is None else self.dual_clip
        if name == "gppo":
            return method_config("gppo", eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
        if name == "ce_gppo":
            return method_config("ce_gppo", eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
                                 beta1=self.gppo_beta1, beta2=self.gppo_beta2)
        if name == "aspo":
            return method_config("aspo", eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
        if name == "dgpo":
            return method_config("dgpo", eps_low=eps_low, eps_high=eps_high, n=self.dgpo_n, m=self.dgpo_m)
        if name == "dcpo":
            return method_config("dcpo", eps_low=eps_low, eps_high=eps_high, r_max=self.dcpo_r_max)
        return method_config("sapo", gate=self.sapo_gate, tau_pos=self.sapo_temperature_pos,
                             tau_neg=self.sapo_temperature_neg)

    def loss_options(self) -> LossOptions:
        return LossOptions(
            method=self.method(),
            temperature=self.temperature,
            aggregation=self.aggregation,
            beta=self.beta,
            kl_ratio_correction=bool(self.use_bias_correction_kl),
            entropy_coef=self.entropy_coef,
            importance_sampling_level=self.importance_sampling_level,
        )
