#!/usr/bin/env bash
# dgpo-ops inside verl 0.9.1 on CPU: tests/integrations/test_verl.py and test_verl_corrections.py in a venv of their own,
# and tests/frameworks/test_data_parallel_steps.py's verl rows (its step on verl's own agg_loss).
#
# verl 0.9.1 requires transformers >= 5.5.3, < 5.11 (the main suite runs a newer one) and ray; torch comes from
# its extras, so the venv takes torch 2.13.0 (CPU) and triton 3.9.0 first (the Triton the main environment runs
# on), then verl 0.9.1 with its requirements, then this package without dependencies.
#
# VERL_CPU_VENV=DIR reuses (or creates, and keeps) the venv in DIR; by default it is made in a temporary directory
# and removed at exit. Exits non-zero if an install or a test fails, or if the verl tests were skipped.
VENV_KIND=VERL_CPU NAME=verl_cpu
source "$(dirname "$0")/venv_tests.sh"

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import verl, triton" >/dev/null 2>&1; then
    echo "== creating $venv"
    "$PYTHON" -m venv "$venv"
    pip_quiet install torch==2.13.0 triton==3.9.0
    pip_quiet install verl==0.9.1 pytest
fi
echo "== installing dgpo-ops without dependencies ($((SECONDS - start)) s)"
pip_quiet install --no-deps -e .

"$venv/bin/python" - <<'PY'
import importlib.metadata as md

from packaging.version import Version

versions = {name: md.version(name) for name in ("torch", "triton", "verl", "transformers", "ray")}
print("==", ", ".join(f"{name} {version}" for name, version in versions.items()))
assert Version(versions["torch"]).base_version == "2.13.0", versions
assert versions["verl"] == "0.9.1", versions
assert Version("5.5.3") <= Version(versions["transformers"]) < Version("5.11"), versions
entry_points = [ep.value for ep in md.entry_points(group="verl.plugins")]
assert "dgpo_ops.integrations.verl" in entry_points, entry_points
PY

run_tests tests/integrations/test_verl.py tests/integrations/test_verl_corrections.py
run_tests tests/frameworks/test_data_parallel_steps.py -k verl  # its verl rows: no other framework is installed here
