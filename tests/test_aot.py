"""Every kernel specialisation compiles ahead of time for sm_80 and sm_90, without spills."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "dgpo_ops.kernels.aot", "--arch", "80", "90"], env=env,
                            capture_output=True, text=True)
    return result


def test_aot_report_exits_zero(report):
    assert report.returncode == 0, report.stderr[-4000:]


def test_every_specialisation_compiled_for_both_architectures(report):
    from dgpo_ops.kernels.aot import specialisations

    rows = [line for line in report.stdout.splitlines() if re.match(r"sm_\d+ ", line)]
    expected = len(specialisations())
    assert sum(line.startswith("sm_80 ") for line in rows) == expected
    assert sum(line.startswith("sm_90 ") for line in rows) == expected
    assert not [line for line in rows if "FAILED" in line]


def test_no_local_memory_and_vectorised_bf16_loads(report):
    for line in report.stdout.splitlines():
        match = re.match(r"(sm_\d+)\s+(forward|backward)\s+(\w+)\s.*?\s(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", line)
        if not match:
            continue
        _, kernel, dtype, regs, smem, local, stack, ldg128, _ = match.groups()
        assert int(local) == 0 and int(stack) == 0, line
        assert 0 < int(regs) <= 255, line
        if dtype == "bf16":
            assert int(ldg128) > 0, f"no LDG.E.128 in {line}"
    assert "cvt.rn" in report.stdout


def test_aot_refuses_to_run_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "dgpo_ops.kernels.aot"], env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "unset TRITON_INTERPRET" in result.stderr
