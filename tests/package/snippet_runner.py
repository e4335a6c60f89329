"""Runs several ```python blocks of the docs in this one interpreter, each as a script (``__main__``) in a
folder of its own: ``python snippet_runner.py BLOCKS.json RESULTS.json``, where BLOCKS.json maps a block's id
to its code, and RESULTS.json gets each id's ``{"error": traceback or None where the block ran to its end,
"output": what it printed}``. A block that fails does not stop the others. tests/package/test_snippets.py says which blocks run here and which alone."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import runpy
import sys
import tempfile
import traceback


def run_blocks(blocks: dict[str, str]) -> dict[str, dict]:
    import torch

    results: dict[str, dict] = {}
    start = os.getcwd()
    for block_id, code in blocks.items():
        # what a block may change for the ones after it, checked (not restored): a block that leaves any of
        # these otherwise fails here, since it would not run as written beside the others
        before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads())
        printed = io.StringIO()
        with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(printed):
            script = pathlib.Path(folder) / "snippet.py"
            script.write_text(code)
            os.chdir(folder)
            try:
                runpy.run_path(str(script), run_name="__main__")
                error = None
            except SystemExit as exit_:
                error = None if exit_.code in (None, 0) else f"SystemExit({exit_.code!r})"
            except BaseException:  # noqa: BLE001 - reported as the block's result
                error = traceback.format_exc()
            finally:
                os.chdir(start)
        after = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads())
        if after != before and error is None:
            error = f"the block left torch's global state changed: {before} -> {after}"
        results[block_id] = {"error": error, "output": printed.getvalue()}
    return results


if __name__ == "__main__":
    blocks_path, results_path = sys.argv[1:]
    outcome = run_blocks(json.loads(pathlib.Path(blocks_path).read_text()))
    pathlib.Path(results_path).write_text(json.dumps(outcome))
