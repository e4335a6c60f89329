#!/usr/bin/env bash
# OpenRLHF, SkyRL, AReaL and ms-swift judge dgpo-ops on CPU: tests/frameworks/ in a venv of its own.
#
# Each framework's loss and correction code imports far more than it runs (ray, deepspeed, vllm, trl, its
# launchers and configs), so the venv takes torch 2.13.0 (CPU) and triton 3.9.0 first, then each framework's
# released wheel without dependencies, then only what the tests run of them imports: numpy (AReaL's functional
# module, Triton's interpreter), loguru (SkyRL's sapo and gspo log through it) and pytest. The tests read the
# released functions out of the installed wheels' files (tests/frameworks/wheel_source.py) and run them on the
# same inputs as dgpo-ops; this package goes in without dependencies.
#
# FRAMEWORKS_CPU_VENV=DIR reuses (or creates, and keeps) the venv in DIR; by default it is made in a temporary
# directory and removed at exit. Exits non-zero if an install or a test fails, or if any test was skipped.
VENV_KIND=FRAMEWORKS_CPU NAME=frameworks_cpu
source "$(dirname "$0")/venv_tests.sh"

FRAMEWORKS=(openrlhf==0.11.2 skyrl==0.3.0 areal==1.0.4 ms-swift==4.6.0)
installed() {  # the venv has torch, triton, numpy, loguru, pytest and each framework at its version
    "$venv/bin/python" - "${FRAMEWORKS[@]}" >/dev/null 2>&1 <<'PY'
import importlib.metadata as md
import sys

import loguru, numpy, pytest, torch, triton  # noqa: F401

for pin in sys.argv[1:]:
    name, version = pin.split("==")
    assert md.version(name) == version, pin
PY
}

if [[ ! -x "$venv/bin/python" ]] || ! installed; then
    echo "== creating $venv"
    "$PYTHON" -m venv "$venv"
    pip_quiet install torch==2.13.0 triton==3.9.0
    # --no-warn-conflicts: the frameworks' own requirements are left out on purpose
    pip_quiet install --no-deps --no-warn-conflicts "${FRAMEWORKS[@]}"
    pip_quiet install --no-warn-conflicts numpy loguru pytest
fi
echo "== installing dgpo-ops without dependencies ($((SECONDS - start)) s)"
pip_quiet install --no-deps --no-warn-conflicts -e .

"$venv/bin/python" - "${FRAMEWORKS[@]}" <<'PY'
import importlib.metadata as md
import sys

versions = {name: md.version(name) for name in ("torch", "triton", "openrlhf", "skyrl", "areal", "ms-swift")}
print("==", ", ".join(f"{name} {version}" for name, version in versions.items()))
assert versions["torch"].split("+")[0] == "2.13.0", versions
assert versions["triton"] == "3.9.0", versions
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    assert versions[name] == version, (pin, versions)
PY

# The step test's TRL and verl rows run their released code where it is installed: TRL's in the main suite, verl's
# in .ci/verl_cpu.sh's venv; this venv has neither (their skips would fail the run)
STEP_ROWS=tests/frameworks/test_data_parallel_steps.py::test_a_rows_step_over_two_ranks_is_the_frameworks
run_tests tests/frameworks --deselect "$STEP_ROWS[trl:" --deselect "$STEP_ROWS[verl:"
