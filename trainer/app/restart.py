"""The ``dgpo-ops train`` program's one restart, with passive OpenMP threads: a module of its own, importing
nothing but the standard library, so that the program can restart before it imports TRL (``command.py``) and
after (``python -m dgpo_ops.trainer.app.cli``)."""

from __future__ import annotations

import os
import sys

PROGRAM_MODULES = ("dgpo_ops.trainer.app.cli", "dgpo_ops.trainer.app.command")
"""The ``python -m`` names of this program (the ``dgpo-ops`` console script is the third way in)."""


def wait_passively() -> None:
    """Run this program again with ``OMP_WAIT_POLICY=passive`` unless the environment names a policy.

    By default torch's OpenMP threads spin after each parallel region, waiting for the next; on a shared
    machine a spinning thread burns the core its partner needs, and the tiny model's many small ops turn that
    into most of the run: beside two busy loops on this project's 2-core CPU the shortened main job took
    67-213 s with spinning threads and 53 s with passive ones (docs/train/timing/README.md). libgomp reads the
    policy once, when torch loads it, which importing dgpo_ops has done already: hence the same command again
    in this process (its PID, arguments and environment kept), before ``train`` imports TRL, so that only
    torch's and dgpo_ops' import (1-2 s) is repeated. Only the program itself does this, never a caller of
    ``main`` (a test, a script)."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    program = sys.modules.get("__main__")
    spec = getattr(program, "__spec__", None)
    if not (spec is not None and spec.name in PROGRAM_MODULES
            or spec is None and os.path.basename(getattr(program, "__file__", "") or "") == "dgpo-ops"):
        return
    os.environ["OMP_WAIT_POLICY"] = "passive"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
