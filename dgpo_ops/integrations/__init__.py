"""Integrations with training frameworks other than TRL (whose trainer is ``dgpo_ops.trainer``).

``verl``: the method table as verl policy losses and the fused kernels as verl's fused log-prob
backend; loaded in every verl worker through the ``verl.plugins`` entry point. ``verl_params``: the
part of that integration that needs no verl (names, hyperparameters, aggregations), importable anywhere.
"""
