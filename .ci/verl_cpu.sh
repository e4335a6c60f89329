#!/usr/bin/env bash
# dgpo-ops inside verl 0.9.1 on CPU: tests/test_verl.py in a venv of its own.
#
# verl 0.9.1 requires transformers >= 5.5.3, < 5.11 (the main suite runs a newer one) and ray; torch comes from
# its extras, so the venv takes torch 2.13.0 (CPU) and triton first (the version the main environment pins through
# torch), then verl 0.9.1 with its requirements, then this package without dependencies.
#
# VERL_CPU_VENV=DIR reuses (or creates, and keeps) the venv in DIR; by default it is made in a temporary directory
# and removed at exit. Exits non-zero if an install or a test fails, or if the verl tests were skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
PYTHON=${PYTHON:-python3}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/dgpo-verl-cpu.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
venv=${VERL_CPU_VENV:-$tmp/venv}
log=$tmp/pip.log

pip_quiet() {  # pip -q, without the "Location ... is ignored" lines this machine's pip config prints
    local status=0
    "$venv/bin/pip" -q "$@" >"$log" 2>&1 || status=$?
    grep -v "^WARNING: Location '" "$log" || true
    return $status
}

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

echo "== tests ($((SECONDS - start)) s)"
out=$tmp/pytest.log
status=0
"$venv/bin/python" -m pytest tests/test_verl.py -q -rs -p no:cacheprovider 2>&1 | tee "$out" || status=$?
if [[ $status -eq 0 ]] && grep -Eq "[0-9]+ skipped" "$out"; then
    echo "verl tests were skipped in the verl venv" >&2
    status=1
fi
echo "== .ci/verl_cpu.sh: exit $status after $((SECONDS - start)) s"
exit $status
