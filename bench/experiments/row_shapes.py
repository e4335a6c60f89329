"""The row kernels alone, across launch shapes: the forward (log-prob and entropy) and the backward
(d loss / d logits) at N x V bf16 logits, each shape timed with ``triton.testing.do_bench`` (median) and
read as HBM bandwidth (the forward reads the scored rows once; the backward reads them and writes the whole
gradient), beside a copy of the same bytes in the same process.

    python bench/experiments/row_shapes.py [--tokens 8192] [--vocab 151936] [--out row_shapes.json]
        [--baseline-forward PATH]

``--baseline-forward``: another version of ``kernels/logprob_entropy.py`` (a file, e.g. ``git show
REV:kernels/logprob_entropy.py``), loaded as a module of ``dgpo_ops.kernels`` and timed at the same shapes, so
that a change to the forward's loop is measured against the version before it in one command. On the CPU
(the dry run) every shape runs once at the sizes given, under the interpreter.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

if not torch.cuda.is_available():  # the dry run: the kernels under the interpreter (set before their import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dgpo_ops.kernels import logits_grad as grad_module
from dgpo_ops.kernels import logprob_entropy as forward_module
from dgpo_ops.kernels.logprob_entropy import LaunchShape
from dgpo_ops.kernels.row_io import RowWorkspace
from dgpo_ops.kernels.torch_twins import token_prologue_torch
from dgpo_ops.trainer.app.environment import describe

from dgpo_ops.core.aggregation import AGGREGATIONS
from dgpo_ops.core.inputs import LossInputs, normalizer_spec, token_inputs
from floors import median_ms  # bench/experiments/floors.py: do_bench's median on CUDA, one call elsewhere

FORWARD_SHAPES = [LaunchShape(*shape) for shape in ((2048, 4, 3), (4096, 4, 2), (4096, 4, 3), (4096, 4, 4),
                                                    (4096, 8, 3), (8192, 8, 2), (8192, 8, 3), (8192, 16, 3),
                                                    (16384, 16, 2))]
BACKWARD_SHAPES = [LaunchShape(*shape) for shape in ((4096, 4, 3), (4096, 8, 3), (8192, 8, 2), (8192, 8, 3),
                                                     (8192, 16, 3), (16384, 16, 2))]


def load_baseline(path: str):
    """``path`` as the module ``dgpo_ops.kernels.baseline_forward`` (its relative imports resolve in the
    package)."""
    spec = importlib.util.spec_from_file_location("dgpo_ops.kernels.baseline_forward", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "dgpo_ops.kernels"
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def inputs(tokens: int, vocab: int, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(8, tokens // 8, vocab, device=device, generator=g) * 2).to(torch.bfloat16)
    target = torch.randint(0, vocab, (8, tokens // 8), device=device, generator=g)
    mask = torch.rand(8, tokens // 8, device=device, generator=g) > 0.1
    loss_batch = LossInputs(target, torch.ones(8, device=device), mask)
    batch = token_inputs(logits.shape, logits.dtype, logits.device, loss_batch)
    workspace = RowWorkspace.allocate(logits.shape[:-1], batch.grid[0], logits.device)
    token_prologue_torch(batch, workspace.sequence_stats, workspace.seq_scale, workspace.status, vocab,
                         AGGREGATIONS["token_mean"], normalizer_spec(None, logits.device))
    return logits, batch, workspace


def with_shape(module, name: str, shape: LaunchShape, launch):
    """``launch()`` with the module's ``name`` launch shape set to ``shape`` (the launchers read it per
    call)."""
    kept = getattr(module, name)
    setattr(module, name, shape)
    try:
        return launch()
    finally:
        setattr(module, name, kept)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--baseline-forward", default=None)
    parser.add_argument("--out", default="row_shapes.json")
    parser.add_argument("--shapes", type=int, default=None,
                        help="only the first SHAPES of each kernel's list (the dry run: every code path, fewer runs)")
    args = parser.parse_args(argv)
    logits, batch, workspace = inputs(args.tokens, args.vocab, args.device)
    grad = torch.empty_like(logits)
    logits_bytes = logits.numel() * logits.element_size()
    # A token not scored (a tenth, masked) is not read: the bandwidths count the scored rows' reads only.
    # every target id is in range: the scored rows are the mask's
    read_bytes = int(batch.mask.sum()) * logits.shape[-1] * logits.element_size()
    copy_ms = median_ms(lambda: grad.copy_(logits), args.device)
    doc = {"machine": describe(torch.device(args.device)), "tokens": args.tokens, "vocab": args.vocab,
           "copy": {"ms": copy_ms, "tb_per_s": 2 * logits_bytes / copy_ms / 1e9}, "rows": []}
    print(f"copy of the logits: {copy_ms:.3f} ms, {doc['copy']['tb_per_s']:.2f} TB/s (read + written)",
          flush=True)
    versions = [("this tree", forward_module)]
    if args.baseline_forward:
        name = os.path.basename(args.baseline_forward)
        versions.append((f"baseline {name}", load_baseline(args.baseline_forward)))
    for version, module in versions:
        for shape in FORWARD_SHAPES[: args.shapes]:
            def launch(module=module, shape=shape):
                module.logprob_entropy(logits, batch, workspace, 1.0, block_v=shape.block_v)
            row = {"kernel": "forward", "version": version, **shape.__dict__}
            try:
                ms = with_shape(module, "FORWARD_SHAPE", shape,
                                lambda launch=launch: median_ms(launch, args.device))
                row.update(ms=ms, tb_per_s=read_bytes / ms / 1e9)
            except Exception as error:  # noqa: BLE001 - a shape that does not compile is a result too
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            doc["rows"].append(row)
            print(row, flush=True)
    forward_module.logprob_entropy(logits, batch, workspace, 1.0)  # the workspace the backward reads
    # Every scored token with a nonzero coefficient: a row whose coefficients are all 0 is not read (run 22's
    # backward rows had none, so they timed the zero-filling of the gradient alone).
    coefficients = torch.full((workspace.n_tokens,), 1e-4, device=args.device)
    for shape, entropy_coef in [(shape, coef) for coef in (0.0, 0.01) for shape in BACKWARD_SHAPES[: args.shapes]]:
        def launch(shape=shape, entropy_coef=entropy_coef):
            grad_module.logits_grad(logits, grad, workspace, batch.grid[1], 1.0, entropy_coef,
                                    dloss_dlogp=coefficients, block_v=shape.block_v)
        kernel = "backward" if entropy_coef == 0.0 else "backward with entropy"
        row = {"kernel": kernel, "version": "this tree", **shape.__dict__}
        try:
            ms = with_shape(grad_module, "BACKWARD_SHAPE", shape,
                            lambda launch=launch: median_ms(launch, args.device))
            row.update(ms=ms, tb_per_s=(read_bytes + logits_bytes) / ms / 1e9)
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        doc["rows"].append(row)
        print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
