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


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'dgpo_ops.trainer' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
