"""Aggregations: the per-token scale ``s_t`` with loss = sum_t s_t L_t over unmasked tokens.

Each aggregation is a within-response weight (1 or 1/|o_i|) divided by a denominator; the
denominator can be supplied from outside (``loss_normalizer``), e.g. the global token or
response count across gradient-accumulation steps and processes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dgpo_ops.core.validation import FLOAT32_MAX, FLOAT32_TINY, MESSAGES
from dgpo_ops.kernels.interface import Denominator, InputError
from dgpo_ops.kernels.torch_twins import denominator_of

# name -> (divide each token by its response length?, default denominator): the prologue kernel
# reads the same two codes.
AGGREGATIONS: dict[str, tuple[bool, Denominator]] = {
    "token_mean": (False, Denominator.TOKENS),
    "seq_mean_token_mean": (True, Denominator.RESPONSES),
    "seq_mean_token_sum_norm": (False, Denominator.GRID),
    "seq_sum_token_mean": (True, Denominator.ONE),
    "seq_mean_token_sum": (False, Denominator.RESPONSES),  # TRL's luspo: mean over responses of |o_i| l_i
    "token_sum": (False, Denominator.ONE),  # verl's token-sum: the plain sum over scored tokens
}


class FrameworkAggregation(NamedTuple):
    """A framework's aggregation mode as its trainer applies it to one call's tokens: the within-response weight,
    what the token sum is divided by, what a step over several processes or accumulated micro-batches passes as
    ``loss_normalizer`` to keep the framework's number, and where the framework's code says so."""

    per_response: bool  # each token weighs 1 / |o_i| (the response's scored tokens)
    denominator: Denominator
    global_normalizer: str  # the framework's divisor over a whole step, in its own terms
    source: str  # file and lines (loss function; the trainer's step that sets the divisor), version or commit


_TRL = "trl 1.16.0 trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss L3153-3184"
_VERL = ("verl 0.9.1 verl/trainer/ppo/core_algos.py agg_loss L1170-1202; global_batch_info from "
         "verl/workers/engine/fsdp/transformer_impl.py L724-735, verl/workers/utils/losses.py L64-68; the row count "
         "from verl/trainer/ppo/ray_trainer.py L1352-1362")
_ROLL = ("alibaba/ROLL 8eb27cc roll/utils/functionals.py agg_loss L229-282; roll/distributed/strategy/strategy.py "
         "_get_batch_num_tokens / _get_global_valid_samples L355-431; loss_scale = micro-batches x dp "
         "(apply_loss_scale, roll/configs/worker_config.py L230)")
_OPENRLHF = ("openrlhf 0.11.2 openrlhf/models/loss.py aggregate_loss L11-39 (loss_agg_mode, "
             "openrlhf/trainer/ray/ppo_actor.py L76-86); openrlhf/utils/loss_utils.py L54-105")
_NEMO_RL = ("NVIDIA-NeMo/RL 7ea279a nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn L678-693; "
            "nemo_rl/models/automodel/data.py process_global_batch L381-420")
_AREAL = ("areal 1.0.4 areal/utils/functional/functional.py ppo_actor_loss_fn L479-483, L542; "
          "areal/trainer/ppo/actor.py L336-364, L446-448")
_SKYRL = ("skyrl 0.3.0 skyrl/backends/skyrl_train/utils/ppo_utils.py apply_loss_reduction_to_advantages_minibatch "
          "L1095-1150 (the advantages scaled before the off-policy correction; the loss sums)")

# "framework:mode" -> the row; the mode is the framework's own config value (TRL's loss_type, verl's, ROLL's and
# OpenRLHF's loss_agg_mode, NeMo-RL's token_level_loss, SkyRL's loss_reduction; AReaL has one aggregation).
FRAMEWORK_AGGREGATIONS: dict[str, FrameworkAggregation] = {
    "trl:grpo": FrameworkAggregation(True, Denominator.RESPONSES, "B x gradient_accumulation_steps", _TRL),
    "trl:sapo": FrameworkAggregation(True, Denominator.RESPONSES, "B x gradient_accumulation_steps", _TRL),
    "trl:bnpo": FrameworkAggregation(False, Denominator.TOKENS, "the micro-batch's tokens x gradient_accumulation_steps",
                                     _TRL),
    "trl:dr_grpo": FrameworkAggregation(False, Denominator.GRID,
                                        "B x max_completion_length x gradient_accumulation_steps (T is "
                                        "max_completion_length, not the padded width)", _TRL),
    "trl:dapo": FrameworkAggregation(False, Denominator.TOKENS, "num_items_in_batch / processes x "
                                     "gradient_accumulation_steps / steps_per_generation", _TRL),
    "trl:cispo": FrameworkAggregation(False, Denominator.TOKENS, "as trl:dapo", _TRL),
    "trl:vespo": FrameworkAggregation(False, Denominator.TOKENS, "as trl:dapo", _TRL),
    "trl:luspo": FrameworkAggregation(False, Denominator.RESPONSES, "B x gradient_accumulation_steps", _TRL),
    "verl:token-mean": FrameworkAggregation(False, Denominator.TOKENS, "global_batch_info batch_num_tokens / dp_size",
                                            _VERL),
    "verl:token-sum": FrameworkAggregation(False, Denominator.ONE, "1 / dp_size", _VERL),
    "verl:seq-mean-token-mean": FrameworkAggregation(True, Denominator.RESPONSES,
                                                     "global_batch_size / dp_size (every row, fully masked ones "
                                                     "included)", _VERL),
    "verl:seq-mean-token-sum": FrameworkAggregation(False, Denominator.RESPONSES, "global_batch_size / dp_size",
                                                    _VERL),
    "verl:seq-mean-token-sum-norm": FrameworkAggregation(False, Denominator.GRID,
                                                         "global_batch_size x loss_scale_factor (else the padded "
                                                         "width) / dp_size", _VERL),
    "roll:token-mean": FrameworkAggregation(False, Denominator.TOKENS,
                                            "batch_num_tokens: the step's scored tokens over every dp rank", _ROLL),
    "roll:seq-mean-token-mean": FrameworkAggregation(True, Denominator.SCORED_RESPONSES,
                                                     "global_valid_samples: the step's responses with a scored "
                                                     "token over every dp rank", _ROLL),
    "roll:seq-mean-token-sum": FrameworkAggregation(False, Denominator.SCORED_RESPONSES, "global_valid_samples",
                                                    _ROLL),
    "roll:seq-mean-token-sum-norm": FrameworkAggregation(False, Denominator.HORIZON,
                                                         "the micro-batch's padded width alone (ROLL's loss_mask "
                                                         "spans prompt and response: pass its width - 1 where the "
                                                         "call holds responses only); the step's loss is the sum "
                                                         "of every response's token sum / T", _ROLL),
    "openrlhf:token-mean": FrameworkAggregation(False, Denominator.TOKENS,
                                                "the accumulation window's action tokens over every dp rank, "
                                                "counted before the IS mask", _OPENRLHF),
    "openrlhf:seq-mean-token-mean": FrameworkAggregation(True, Denominator.SCORED_RESPONSES,
                                                         "the window's responses with an action token over every "
                                                         "dp rank", _OPENRLHF),
    "nemo_rl:token_level_loss=true": FrameworkAggregation(False, Denominator.TOKENS,
                                                          "global_valid_toks: the global batch's tokens over every "
                                                          "dp rank, counted before TIS / icepop", _NEMO_RL),
    "nemo_rl:token_level_loss=false": FrameworkAggregation(True, Denominator.RESPONSES,
                                                           "global_valid_seqs: the global batch's sample_mask sum",
                                                           _NEMO_RL),
    "areal:token-mean": FrameworkAggregation(False, Denominator.TOKENS,
                                             "the mini-batch's loss_mask tokens over every dp rank, counted before "
                                             "rejection sampling, after M2PO per micro-batch (AReaL's one "
                                             "aggregation, no config field)", _AREAL),
    "skyrl:token_mean": FrameworkAggregation(False, Denominator.TOKENS,
                                             "the mini-batch's tokens, counted before the off-policy correction",
                                             _SKYRL),
    "skyrl:sequence_mean": FrameworkAggregation(True, Denominator.RESPONSES, "the mini-batch's responses", _SKYRL),
    "skyrl:seq_mean_token_sum_norm": FrameworkAggregation(False, Denominator.GRID,
                                                          "the mini-batch's responses x max_seq_len", _SKYRL),
}


def aggregation_codes(aggregation: str) -> tuple[bool, Denominator]:
    """``(per_response, Denominator)`` of one of ours (``AGGREGATIONS``) or a framework's row
    (``"framework:mode"``, ``FRAMEWORK_AGGREGATIONS``): what the kernels, their twins and the reference read."""
    if aggregation in AGGREGATIONS:
        return AGGREGATIONS[aggregation]
    if aggregation in FRAMEWORK_AGGREGATIONS:
        row = FRAMEWORK_AGGREGATIONS[aggregation]
        return row.per_response, row.denominator
    check_aggregation(aggregation)
    raise AssertionError("unreachable")


def token_level(aggregation: str) -> bool:
    """The aggregation needs no response structure (flat ``(N, V)`` logits may use it)."""
    per_response, denominator = aggregation_codes(aggregation)
    return not per_response and denominator in (Denominator.TOKENS, Denominator.ONE)


def check_aggregation(aggregation: str) -> None:
    if not isinstance(aggregation, str) or (aggregation not in AGGREGATIONS
                                            and aggregation not in FRAMEWORK_AGGREGATIONS):
        framework = aggregation.split(":", 1)[0] if isinstance(aggregation, str) and ":" in aggregation else None
        frameworks = sorted({name.split(":", 1)[0] for name in FRAMEWORK_AGGREGATIONS})
        if framework is not None and framework in frameworks:
            modes = [name for name in FRAMEWORK_AGGREGATIONS if name.startswith(framework + ":")]
            raise ValueError(f"unknown aggregation {aggregation!r}; {framework}'s: {', '.join(modes)}")
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}, or a framework's "
                         f"mode as 'framework:mode' ({', '.join(frameworks)}; dgpo_ops.FRAMEWORK_AGGREGATIONS)")


def check_normalizer_form(loss_normalizer) -> None:
    """A number or a one-element real tensor (its value is not read here)."""
    if torch.is_tensor(loss_normalizer):
        if loss_normalizer.numel() != 1 or loss_normalizer.dtype == torch.bool or loss_normalizer.is_complex():
            raise ValueError("loss_normalizer must be a number or a one-element real tensor, got a tensor of "
                             f"shape {tuple(loss_normalizer.shape)} and dtype {loss_normalizer.dtype}")
    elif isinstance(loss_normalizer, bool) or not isinstance(loss_normalizer, (int, float)):
        raise ValueError(f"loss_normalizer must be a number or a one-element tensor, got {loss_normalizer!r}")


def check_normalizer_value(value: float) -> None:
    if not math.isfinite(value) or not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise ValueError(MESSAGES[InputError.LOSS_NORMALIZER].format(normalizer=repr(value)))


def check_loss_normalizer(loss_normalizer) -> None:
    """A finite number > 0, or a one-element real tensor holding one (read here: host code only)."""
    if loss_normalizer is None:
        return
    check_normalizer_form(loss_normalizer)
    check_normalizer_value(float(loss_normalizer) if torch.is_tensor(loss_normalizer) else loss_normalizer)


def token_scales(mask: torch.Tensor, aggregation: str, loss_normalizer: float | torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token scale s_t (zero on masked tokens) for a boolean ``(B, T)`` mask."""
    check_aggregation(aggregation)
    if not torch.compiler.is_compiling():  # compiled, the reference checks it in dgpo_ops::checked_inputs
        check_loss_normalizer(loss_normalizer)
    per_response, default_denominator = aggregation_codes(aggregation)
    scale = mask.to(dtype)
    if per_response:
        scale = scale / mask.sum(dim=1, keepdim=True).clamp(min=1)
    if loss_normalizer is not None:
        if torch.is_tensor(loss_normalizer):
            loss_normalizer = loss_normalizer.reshape(())
        return scale / loss_normalizer
    return scale / denominator_of(default_denominator, mask.sum(dim=1), mask.shape[1], dtype)
