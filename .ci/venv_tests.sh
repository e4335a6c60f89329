# Shared by .ci/vllm_cpu.sh and .ci/verl_cpu.sh (sourced): a framework's tests in a venv of its own.
#
# The caller sets VENV_KIND (the variable prefix: VLLM_CPU or VERL_CPU) and NAME, then sources this file, which
# sets venv (from ${VENV_KIND}_VENV, else a temporary directory removed at exit) and defines pip_quiet and
# run_tests. run_tests exits non-zero if a test fails or if any was skipped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS
PYTHON=${PYTHON:-python3}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/dgpo-$NAME.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
venv_override="${VENV_KIND}_VENV"
venv=${!venv_override:-$tmp/venv}
log=$tmp/pip.log

pip_quiet() {  # pip -q, without the "Location ... is ignored" lines this machine's pip config prints
    local status=0
    "$venv/bin/pip" -q "$@" >"$log" 2>&1 || status=$?
    grep -v "^WARNING: Location '" "$log" || true
    return $status
}

run_tests() {  # run_tests TEST_FILE...: pytest in the venv; skipped tests count as a failure there
    echo "== tests ($((SECONDS - start)) s)"
    local out=$tmp/pytest.log status=0
    # -p no:xdist: the file runs in this one process (tests/conftest.py spreads the main suite over workers
    # where pytest-xdist is installed; the vLLM venv has it from the dev extra)
    "$venv/bin/python" -m pytest "$@" -q -rs -p no:cacheprovider -p no:xdist 2>&1 | tee "$out" || status=$?
    if [[ $status -eq 0 ]] && grep -Eq "[0-9]+ skipped" "$out"; then
        echo "$NAME tests were skipped in the $NAME venv" >&2
        status=1
    fi
    echo "== .ci/$NAME.sh: exit $status after $((SECONDS - start)) s"
    return $status
}
