"""The presets of ``dgpo-ops train``: method presets from the method table, the tiny CPU run's defaults,
its regimes and tasks, the GPU run's defaults, and the one-line usage error. ``cli.py`` parses with
them, ``run.py`` runs with them."""

from __future__ import annotations

from dgpo_ops.methods.catalog import POLICY_LOSSES
from dgpo_ops.methods.table import NOT_METHODS, resolve

from ..config import method_field_names
from ..method_fields import config_method_params

METHODS = POLICY_LOSSES

# Other DGPOConfig values dgpo-ops train applies for a method unless given (DCPO's: its smooth advantage
# standardisation).
PRESETS: dict[str, dict] = {"dcpo": {"advantage_estimator": "dcpo"}}


def trainer_presets(name: str) -> dict:
    """``DGPOConfig`` values ``dgpo-ops train`` applies for a method or alias unless given: the defaults of
    parameters read with an offset (TRL's default of their field means something else), the alias's
    parameters, in config terms, then the method's own presets."""
    method, alias_params = resolve(name)
    presets = {}
    for p in config_method_params(method):
        if p.field is None:
            continue
        if p.name in alias_params:
            presets[p.field.name] = p.field.to_config(alias_params[p.name])
        elif p.field.offset:
            presets[p.field.name] = p.field.to_config(p.default)
    return {**presets, **PRESETS.get(method, {})}


def unknown_methods(names: list[str]) -> str:
    """What ``--method`` and ``--compare`` say of names that are not methods: each, with the option it stands
    for where it is one (``gspo``: ``--importance_sampling_level sequence`` with any method)."""
    hints = "".join(f"; {name}: {NOT_METHODS[name]}" for name in names if name in NOT_METHODS)
    return f"unknown method(s) {', '.join(names) or '(none given)'}{hints}; choose from {', '.join(METHODS)}"


# Method presets, applied unless the option is given explicitly (from the method table: dapo's clip-higher,
# cispo's cap in TRL's terms, dcpo's advantages).
METHOD_PRESETS = {name: presets for name in POLICY_LOSSES if (presets := trainer_presets(name))}

# DGPOConfig fields shown in --help as the method's parameters (all other fields pass through too): every
# field the method table reads, then the loss options.
METHOD_FIELDS = (*method_field_names(), "loss_type", "loss_aggregation", "advantage_estimator", "fused", "beta",
                 "importance_sampling_level")

# The default CPU run (tiny model, 1-2 digit addition). Also the values `--model` runs start from.
TINY_RL_DEFAULTS = {
    "max_steps": 60,
    "learning_rate": 1e-4,
    "lr_scheduler_type": "constant",
    "per_device_train_batch_size": 256,  # completions per optimizer step: 32 prompts x 8
    "steps_per_generation": 1,
    "num_iterations": 2,  # two optimizer steps per generation: the ratios leave 1 and the methods differ
    "num_generations": 8,
    "max_completion_length": 48,
    "temperature": 1.0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
}
# Regimes of the tiny default run (--preset), applied over its defaults and under every explicit
# option and method preset. "off-policy": several optimizer steps per generation with a larger
# learning rate, so that the ratios leave the trust region and the methods' clipping matters
# (docs/train/README.md, "Where the method matters").
REGIME_PRESETS = {
    "default": {},
    "off-policy": {"num_iterations": 8, "learning_rate": 5e-4, "max_steps": 24},
    # two sides of it, measured too (docs/train/README.md): grpo about 9 % outside, and every method collapsing
    "off-policy-mild": {"num_iterations": 8, "learning_rate": 3e-4, "max_steps": 24},
    "off-policy-aggressive": {"num_iterations": 6, "learning_rate": 1e-3, "max_steps": 18},
}

# Tasks of the tiny default run (--task): defaults of the data and warm-start options, under every explicit option.
# "addition-hard": 1-3 digit addition with column (digit by digit, carries) worked solutions and a longer warm start.
# Probed at 1e3653a (CPU, grpo, seed 0, 60 steps, 200 held-out problems, 8 samples): greedy held-out accuracy
# 0.12 after the warm start, 0.52 at step 10 and 0.51 at step 60, below the ceiling; pass@1 0.23 -> 0.37 (step 10)
# -> 0.47 (step 60) and pass@8 0.58 -> 0.67, still rising at step 60, where the default task has flattened from
# step 20. With 250 SFT steps and split solutions the same task starts at 0.02 and RL learns nothing.
TASK_PRESETS = {
    "addition": {},
    "addition-hard": {"max_digits": 3, "solution_style": "column", "sft_steps": 500},
}

GPU_RL_DEFAULTS = {
    "max_steps": 500,
    "learning_rate": 1e-6,
    "per_device_train_batch_size": 8,
    "num_generations": 8,
    "max_completion_length": 1024,
    "gradient_checkpointing": True,
}


class UsageError(Exception):
    """Reported as one line (``dgpo-ops train: error: ...``) and exit code 2, never a traceback."""
