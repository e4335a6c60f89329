#!/usr/bin/env bash
# The frameworks' venv suites, each in a venv of its own built by its script: vLLM on a CPU, verl, the PyPI
# frameworks as oracles (OpenRLHF, SkyRL, AReaL, ms-swift) and SkyRL's registry. .ci/run runs them after the
# main suite; the README gives this as its own command, with its time (docs/timing/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/vllm_cpu.sh && bash .ci/verl_cpu.sh && bash .ci/frameworks_cpu.sh && bash .ci/skyrl_cpu.sh
