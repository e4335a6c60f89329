"""Integrations with training frameworks other than TRL (whose trainer is ``dgpo_ops.trainer``).

``verl``: the method table as verl policy losses and the fused kernels as verl's fused log-prob backend; loaded in
every verl worker through the ``verl.plugins`` entry point. ``skyrl``: the method table as SkyRL policy losses,
registered in SkyRL's ``PolicyLossRegistry`` when imported (SkyRL has no entry point; its ``main`` is SkyRL's
``main_base.main``). ``verl_params`` and ``skyrl_params``: the parts of those integrations that need no framework
(names, hyperparameters, aggregations, corrections), importable anywhere; ``config_fields`` and ``token_grid``: what
they share.
"""
