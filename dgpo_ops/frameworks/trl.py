"""TRL 1.16: ``GRPOTrainer``'s loss types and what each divides by, where ``GRPOConfig`` holds each method
parameter (``DGPOConfig`` adds a field for every other one), its vLLM importance-sampling correction, and how
``DGPOTrainer`` counts each row's denominator over TRL's step."""

from __future__ import annotations

from typing import NamedTuple

import torch

from dgpo_ops.corrections.trl import TrlCorrection
from dgpo_ops.frameworks.core import (
    AggregationRow,
    ConfigField,
    FrameworkSpec,
    LossType,
    MethodFields,
    Scope,
    named_after_method,
    step_normalizer,
)
from dgpo_ops.kernels.interface import Denominator

SOURCE = "trl 1.16.0 trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss L3153-3184"
_RESPONSES = "B (the micro-batch's responses) x gradient_accumulation_steps x processes"
_GENERATION = ("num_items_in_batch x gradient_accumulation_steps / steps_per_generation (the generation batch's "
               "tokens over every process)")

SPEC = FrameworkSpec(
    name="trl", title="TRL",
    aggregations=(
        AggregationRow("grpo", True, Denominator.RESPONSES, Scope.MICRO_BATCH_MEAN, _RESPONSES, SOURCE),
        AggregationRow("sapo", True, Denominator.RESPONSES, Scope.MICRO_BATCH_MEAN, _RESPONSES, SOURCE),
        AggregationRow("bnpo", False, Denominator.TOKENS, Scope.MICRO_BATCH_MEAN,
                       "the micro-batch's tokens (at least 1) x gradient_accumulation_steps x processes", SOURCE),
        AggregationRow("dr_grpo", False, Denominator.GRID, Scope.MICRO_BATCH_MEAN,
                       "B x max_completion_length x gradient_accumulation_steps x processes (T is "
                       "max_completion_length, not the padded width)", SOURCE),
        AggregationRow("dapo", False, Denominator.TOKENS, Scope.STEP, _GENERATION, SOURCE),
        AggregationRow("cispo", False, Denominator.TOKENS, Scope.STEP, "as trl:dapo", SOURCE),
        AggregationRow("vespo", False, Denominator.TOKENS, Scope.STEP, "as trl:dapo", SOURCE),
        AggregationRow("luspo", False, Denominator.RESPONSES, Scope.MICRO_BATCH_MEAN, _RESPONSES, SOURCE),
    ),
    # GRPOConfig's fields keep TRL's meaning; a parameter not listed is read from a field named after its method,
    # which DGPOConfig adds (trainer/config.py).
    fields=MethodFields(
        root="DGPOConfig",
        by_param={
            "eps_low": ConfigField("epsilon"),
            "eps_high": ConfigField("epsilon_high", fallback="epsilon"),
            "dual_clip": ConfigField("dual_clip"),
            "delta": ConfigField("delta"),
            "beta1": ConfigField("gppo_beta1"),  # ce_gppo's (gppo's boundary scales are fixed at 1)
            "beta2": ConfigField("gppo_beta2"),
            "tau_pos": ConfigField("sapo_temperature_pos"),  # TRL's names for SAPO's temperatures
            "tau_neg": ConfigField("sapo_temperature_neg"),
            "delta_low": ConfigField("dppo_delta_low"),  # dppo_tv's and dppo_kl's
            "delta_high": ConfigField("dppo_delta_high"),
            "is_cap": ConfigField("dppo_is_cap"),
            "ppo_kl_coef": ConfigField("ppo_kl_coef"),  # kl_cov's, verl's name
            "adv_tau": ConfigField("prime_adv_tau"),  # prime_dppo's and prime_ipo's
            "kl_tau": ConfigField("prime_kl_tau"),
        },
        by_method={
            # TRL's CISPO has no lower bound on the weight and calls the cap itself epsilon_high
            ("cispo", "eps_low"): None,
            ("cispo", "eps_high"): ConfigField("epsilon_high", fallback="epsilon", offset=1.0),
        },
        own_field=named_after_method,
    ),
    correction=TrlCorrection, correction_config="GRPOConfig (vllm_importance_sampling_*)",
    # loss_type -> the objective it names in TRL and its aggregation: grpo, bnpo, dr_grpo, dapo and luspo are TRL's
    # clipped objective (dgpo-ops' grpo) under different aggregations; cispo, sapo and vespo objectives of their own.
    loss_types=(LossType("grpo", "grpo", "grpo"), LossType("sapo", "sapo", "sapo"), LossType("bnpo", "grpo", "bnpo"),
                LossType("dr_grpo", "grpo", "dr_grpo"), LossType("dapo", "grpo", "dapo"),
                LossType("cispo", "cispo", "cispo"), LossType("vespo", "vespo", "vespo"),
                LossType("luspo", "grpo", "luspo")),
)

LOSS_TYPES = tuple(loss_type.name for loss_type in SPEC.loss_types)
CLIPPED = "grpo"  # the objective of TRL's plain loss types
# The loss types that name an objective other than the clipped one: with an explicit policy_loss they must agree.
OBJECTIVE_LOSS_TYPES = tuple(t.name for t in SPEC.loss_types if t.method != CLIPPED)


def same_aggregation(loss_type: str) -> str:
    """The loss type of TRL's clipped objective that aggregates as ``loss_type`` does (cispo's is dapo)."""
    row = SPEC.row(SPEC.loss_type(loss_type).aggregation)
    for other in SPEC.loss_types:
        other_row = SPEC.row(other.aggregation)
        if other.method == CLIPPED and (other_row.per_response, other_row.denominator, other_row.scope) == \
                (row.per_response, row.denominator, row.scope):
            return other.name
    raise AssertionError(f"no loss type of TRL's clipped objective aggregates as {loss_type}")


for _name in OBJECTIVE_LOSS_TYPES:  # each has its clipped twin, which the config's error names
    same_aggregation(_name)

# DGPOTrainer applies one of dgpo-ops' own aggregations (loss_aggregation, a method's own) over TRL's step as the
# loss types do: a token count over the generation batch (dapo's), any other count per micro-batch.
OWN_SCOPES: dict[Denominator, Scope] = {
    Denominator.TOKENS: Scope.STEP, Denominator.RESPONSES: Scope.MICRO_BATCH_MEAN,
    Denominator.GRID: Scope.MICRO_BATCH_MEAN, Denominator.ONE: Scope.MICRO_BATCH_MEAN,
    Denominator.SCORED_RESPONSES: Scope.MICRO_BATCH_MEAN, Denominator.HORIZON: Scope.MICRO_BATCH_MEAN,
}


class TrlStep(NamedTuple):
    """What ``GRPOTrainer._compute_loss`` counts with, for one micro-batch on one process."""

    mask: torch.Tensor  # the micro-batch's completion mask (B, T)
    max_completion_length: int
    num_items_in_batch: torch.Tensor  # the generation batch's tokens over every process
    accumulation: int  # the step's micro-batches (gradient accumulation steps; 1 in evaluation)
    window: float  # gradient_accumulation_steps / steps_per_generation (1 in evaluation)
    processes: int


# Denominator -> its count over TRL's step (``scope``: the step's, or the micro-batch's), as TRL counts it
COUNTS = {
    Denominator.TOKENS: lambda step, scope: (
        step.num_items_in_batch.clamp(min=1.0).float() * step.window if scope is Scope.STEP
        else step.mask.sum().clamp(min=1.0).float()),
    Denominator.RESPONSES: lambda step, scope: float(step.mask.size(0)),
    Denominator.GRID: lambda step, scope: float(step.mask.size(0) * step.max_completion_length),
    Denominator.ONE: lambda step, scope: 1.0,
    Denominator.SCORED_RESPONSES: lambda step, scope: step.mask.bool().any(dim=1).sum().clamp(min=1).float(),
    Denominator.HORIZON: lambda step, scope: float(step.max_completion_length),
}
if set(COUNTS) != set(Denominator) or set(OWN_SCOPES) != set(Denominator):
    raise AssertionError("trl.COUNTS and trl.OWN_SCOPES must cover every Denominator")


def trainer_row(aggregation: str, per_response: bool, denominator: Denominator) -> AggregationRow:
    """The row ``DGPOTrainer`` divides by: a ``trl:<loss_type>`` row, or one of dgpo-ops' own aggregations
    (its codes ``per_response``, ``denominator``) over TRL's step (``OWN_SCOPES``)."""
    if aggregation.startswith(f"{SPEC.name}:"):
        return SPEC.row(aggregation.split(":", 1)[1])
    return AggregationRow(aggregation, per_response, denominator, OWN_SCOPES[denominator], "", "")


def trainer_normalizer(row: AggregationRow, step: TrlStep):
    """``(loss_normalizer, policy_loss_scale)`` of one micro-batch: the row's step normalizer, and the factor that
    turns the loss into TRL's ``policy_loss`` metric (logged before the division by the accumulation steps, except
    for the counts over the generation batch)."""
    count = COUNTS[row.denominator](step, row.scope)
    normalizer = step_normalizer(row, count, micro_batches=step.accumulation, dp_size=step.processes)
    return normalizer, (1 if row.scope is Scope.STEP else step.accumulation)
