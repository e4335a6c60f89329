"""TRL integration, the trainer library: ``from dgpo_ops.trainer import DGPOTrainer, DGPOConfig``.

TRL and transformers are imported on first use of these names, so ``import dgpo_ops.trainer``
stays as light as ``import dgpo_ops``. The ``dgpo-ops`` command and its ``train`` app are built on this
library in ``dgpo_ops.trainer.app``, which nothing here imports.
"""

_LAZY = {
    "DGPOTrainer": ("trainer", "DGPOTrainer"),
    "DGPOConfig": ("config", "DGPOConfig"),
    "SmoothAdvantageStandardizer": ("advantages", "SmoothAdvantageStandardizer"),
    "group_advantages": ("advantages", "group_advantages"),
}

__all__ = list(_LAZY)

# The modules of the trl extra (pyproject.toml's optional-dependencies), by their import names.
TRL_EXTRA_MODULES = ("trl", "transformers", "accelerate", "datasets", "math_verify", "peft")


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'dgpo_ops.trainer' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if missing not in TRL_EXTRA_MODULES:
            raise
        raise ImportError(f"dgpo_ops.trainer.{name} needs the trl extra ({missing} is not installed): "
                          f'pip install "dgpo-ops[trl]"', name=error.name) from error
