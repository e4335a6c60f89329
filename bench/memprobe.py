"""Peak memory of one forward+backward, in a fresh process (CPU):

    python -m bench.memprobe COMPETITOR METHOD N V

prints one JSON line: ``peak_bytes`` (peak resident set during the call minus the resident set just
before it), ``logits_bytes`` and how it was measured. See ``common.CPU_MEMORY_METHOD``.
"""

from __future__ import annotations

import json
import sys

import torch


def main(argv=None) -> int:
    from bench.common import (
        cpu_peak_bytes,
        cuda_peak_bytes,
        device,
        make_inputs,
        prepare,
        step,
        unavailable,
    )

    competitor, method, n, v = (argv or sys.argv[1:])[:4]
    n, v = int(n), int(v)
    dev = device()
    reasons = unavailable(competitor, method, dev)
    if reasons:
        print(json.dumps({"error": f"unavailable: {'; '.join(reasons)}"}))
        return 1
    inputs = make_inputs(n, v, dev)
    prepared = prepare(competitor, method, inputs)
    if dev.type == "cuda":
        step(prepared)  # warm-up (and compile): the CUDA benchmark measures memory in process instead
        result = cuda_peak_bytes(prepared)
    else:
        # torch.compile warms up on the measured inputs (a new shape would compile again); the others
        # on a 64-token batch of the same vocabulary, which is cheap and touches the same code.
        warm_up = prepared if competitor == "compile" else prepare(competitor, method, make_inputs(64, v, dev))
        result = cpu_peak_bytes(prepared, warm_up=warm_up)
        del warm_up
    result.update(logits_bytes=inputs.logits_bytes, competitor=competitor, method=method, N=n, V=v)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(True)
    sys.exit(main())
