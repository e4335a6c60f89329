"""Runs several ```python blocks of the docs in this one interpreter, each as a script (``__main__``) in a
folder of its own: ``python snippet_runner.py BLOCKS.json RESULTS.json``, where BLOCKS.json maps a block's id
to its code, and RESULTS.json gets each id's traceback, or None where the block ran to its end. A block that
fails does not stop the others. tests/package/test_snippets.py says which blocks run here and which alone."""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import sys
import tempfile
import traceback


def run_blocks(blocks: dict[str, str]) -> dict[str, str | None]:
    import torch

    results: dict[str, str | None] = {}
    start = os.getcwd()
    for block_id, code in blocks.items():
        # what a block may change for the ones after it, checked (not restored): a block that leaves any of
        # these otherwise fails here, since it would not run as written beside the others
        before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads())
        with tempfile.TemporaryDirectory() as folder:
            script = pathlib.Path(folder) / "snippet.py"
            script.write_text(code)
            os.chdir(folder)
            try:
                runpy.run_path(str(script), run_name="__main__")
                results[block_id] = None
            except SystemExit as exit_:
                results[block_id] = None if exit_.code in (None, 0) else f"SystemExit({exit_.code!r})"
            except BaseException:  # noqa: BLE001 - reported as the block's result
                results[block_id] = traceback.format_exc()
            finally:
                os.chdir(start)
        after = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads())
        if after != before and results[block_id] is None:
            results[block_id] = f"the block left torch's global state changed: {before} -> {after}"
    return results


if __name__ == "__main__":
    blocks_path, results_path = sys.argv[1:]
    outcome = run_blocks(json.loads(pathlib.Path(blocks_path).read_text()))
    pathlib.Path(results_path).write_text(json.dumps(outcome))
