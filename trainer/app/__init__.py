"""The ``dgpo-ops`` command and its ``train`` application, built on the trainer library beside it.

``command.py`` is the ``dgpo-ops`` entry point (``train``, ``table``, ``plot``; ``restart.py``: ``train``'s
restart with passive OpenMP threads); ``train`` is ``cli.py`` (options, ``presets.py``), ``run.py`` (the run),
``console.py`` (what it prints), ``report.py`` (run.json and the figure), ``data.py`` (the task's problems),
``tiny_model.py`` (the default policy and tokenizer) and ``warm_start.py`` (the SFT warm start and the
held-out evaluation); ``table`` and ``plot`` are ``atlas.py``, the figures' colours ``styles.py``, and
``environment.py`` names the commit and machine a result was measured on (run.json, bench/). The app imports
the library (``DGPOTrainer``, ``DGPOConfig``, the rewards); the library imports nothing of the app
(``tests/package/test_imports.py``).
"""
