#!/usr/bin/env bash
# dgpo-ops inside SkyRL 0.3.0 on CPU: tests/integrations/test_skyrl_registry.py in a venv of its own.
#
# The tests import SkyRL itself (its PolicyLossRegistry, its losses, its trainer's normalisation, its config parser
# and validate_cfg), and SkyRL's requirements (vllm, flash-attn, jax, ...) cannot install here, so the venv takes
# torch 2.13.0 (CPU) and triton 3.9.0 first, then skyrl 0.3.0 and skyrl-gym 0.4.0 without dependencies, then,
# without dependencies and pinned, exactly the modules that SkyRL's registry, config and validate_cfg import (ray at
# SkyRL's pin; pydantic with its core; omegaconf; loguru; jaxtyping; pandas for skyrl-gym; aiohttp for the inference
# client the top-level config imports; ...), then this package without dependencies. SkyRL runs on Python 3.12 (the
# project's CPU torch is a 3.11 wheel): on 3.11 skyrl-gym goes in past its Requires-Python and the test module sets
# typing_extensions' TypedDict for SkyRL's one pydantic model that needs it.
#
# SKYRL_CPU_VENV=DIR reuses (or creates, and keeps) the venv in DIR; by default it is made in a temporary directory
# and removed at exit. Exits non-zero if an install or a test fails, or if the SkyRL tests were skipped.
VENV_KIND=SKYRL_CPU NAME=skyrl_cpu
source "$(dirname "$0")/venv_tests.sh"

SKYRL_IMPORTS=(
    skyrl==0.3.0 ray==2.56.0 msgpack==1.2.4 protobuf==7.36.2 requests==2.34.2 urllib3==2.8.0
    idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3 pyyaml==6.0.4 jsonschema==4.26.0
    jsonschema-specifications==2025.9.1 attrs==26.1.0 referencing==0.37.0 rpds-py==2026.9.1
    pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 numpy==2.4.6
    jaxtyping==0.3.11 loguru==0.7.3 omegaconf==2.4.0 pandas==3.1.1 python-dateutil==4.0.0 six==1.17.0
    pytz==2026.6 tzdata==2026.6 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4
    aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0
    pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0 packaging==26.4 pygments==2.21.0
)

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import skyrl, ray, triton" >/dev/null 2>&1; then
    echo "== creating $venv"
    "$PYTHON" -m venv "$venv"
    pip_quiet install torch==2.13.0 triton==3.9.0
    # --no-warn-conflicts: SkyRL's own requirements are left out on purpose
    pip_quiet install --no-deps --no-warn-conflicts "${SKYRL_IMPORTS[@]}"
    # skyrl-gym 0.4.0 (SkyRL's config imports two of its dataclasses) declares Python >= 3.12 like SkyRL's code needs,
    # while skyrl 0.3.0 declares >= 3.11; the modules the tests import run on 3.11 (see the test module's TypedDict)
    pip_quiet install --no-deps --no-warn-conflicts --ignore-requires-python skyrl-gym==0.4.0
fi
echo "== installing dgpo-ops without dependencies ($((SECONDS - start)) s)"
pip_quiet install --no-deps --no-warn-conflicts -e .

"$venv/bin/python" - <<'PY'
import importlib.metadata as md

versions = {name: md.version(name) for name in ("torch", "triton", "skyrl", "ray")}
print("==", ", ".join(f"{name} {version}" for name, version in versions.items()))
assert versions["torch"].split("+")[0] == "2.13.0", versions
assert versions["skyrl"] == "0.3.0", versions
PY

run_tests tests/integrations/test_skyrl_registry.py
