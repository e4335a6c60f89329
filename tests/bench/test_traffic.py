"""The traffic model (``bench/traffic.py``) reads each kernel's loads and stores from its source,
helpers included: the row forward's planes are stored by ``finish_row``, which it calls. It reads
the compiled kernels' source, so it runs without the interpreter, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dgpo_ops.kernels.interface import NUM_PLANES

CODE = ("import json\nfrom bench import traffic\n"
        "print(json.dumps({label: traffic.derived(kind, spec, method) "
        "for kind, label, spec, method in traffic._specs()}))")


# The tests read one traffic model run (a subprocess): they run on one xdist worker.
pytestmark = pytest.mark.xdist_group("traffic_rows")


@pytest.fixture(scope="module")
def rows():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    return json.loads(out)


def test_the_forward_planes_and_parameters_are_counted_where_the_helper_stores_them(rows):
    plain = rows["bf16 forward, no epilogue (GSPO, forward only)"]
    dgpo = rows["bf16 forward + dgpo epilogue, old log-probs (the benchmark's call)"]
    assert plain["row_read_units"] == dgpo["row_read_units"] == 1.0  # one read of the row
    assert plain["side_writes"]["per token"] == 4 * 4  # max, log S, log p, entropy
    assert dgpo["side_writes"]["per token"] == 4 * NUM_PLANES  # every plane, the epilogue's too
    assert plain["param_bytes"] == 0 and dgpo["param_bytes"] > 0  # kernel_token_terms only behind HAS_EPILOGUE
    assert dgpo["side_reads"]["old logps"] == 4 and "old logps" not in plain["side_reads"]


def test_the_backward_reads_the_row_and_writes_the_gradient_once(rows):
    backward = rows["bf16 backward (the benchmark's call)"]
    assert (backward["row_read_units"], backward["row_write_units"]) == (1.0, 1.0)
