"""What the fused-linear op moves outside its GEMMs and its row kernels: every other aten op of one forward +
backward, by the largest tensor it reads or writes.

    python -m bench.outside_gemms [--out bench/results/outside_gemms-cpu.md]

The floor of a fused-linear forward + backward (csrc_notes.md, "Memory traffic per token") is the three GEMMs
(logits tile, d hidden, d weight), the row kernels' read of each logits tile and their read and write of its
gradient, and one write of each gradient in its input's dtype. Everything else is overhead: a zero-fill of an
accumulator, a copy of the weight, a cast of a tile, a scale applied in a pass of its own. ``OutsideGemmCounter``
(a ``TorchDispatchMode``) sees every aten op of one call on the CPU with the torch twins (each twin wrapped, so
that its ops are counted as the row kernels', not as overhead) and sorts the others by the largest tensor among
their arguments and outputs:

* ``weight``: the whole ``V x H`` weight or a gradient of its size; the floor is one pass per weight-sized
  gradient, the backward's scale-and-cast (``kernels/scale_cast.py``);
* ``weight block``: a cast of one vocabulary block of the weight (``TileProjection.weight_blocks``): where the
  weight is not in the GEMMs' dtype (autocast over fp32 weights; on the CPU also bf16 weights, multiplied in
  fp32), twice per token chunk, in place of a copy of the whole weight;
* ``tile``: a ``rows x V`` logits or gradient tile, or its columns of one vocabulary block; none on the floor.
  On the CPU, where fp32 products of bf16 operands stand in for a GPU's tensor cores, a bf16 tile costs two
  more: each block's fp32 product rounded into the tile (``copy_``: a GPU's GEMM writes bf16 itself) and the
  gradient tile cast to fp32 for the products that read it (``_to_copy``, one per tile);
* ``hidden``: an ``n x H`` slice of the hidden states or their gradient: the masking of the hidden states not
  scored before ``G^T H`` (one per tile), the scale-and-cast of d hidden (one), the operands' cast to the
  compute dtype under autocast (one per tile in each of the two GEMMs that read them);
* ``small``: per-token and per-call vectors (O(N)).

``tests/bench/test_outside_gemms.py`` pins the counts, so a pass that comes back fails a test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# B x T tokens, hidden size, vocabulary, tile rows: every size distinct, so the largest tensor an op touches
# tells which kind it is.
SHAPE = dict(B=2, T=24, N=48, H=40, V=700, tile_rows=16)
SETTINGS = {  # name -> (parameter dtype, autocast dtype or None)
    "fp32 weights": (torch.float32, None),
    "bf16 weights": (torch.bfloat16, None),
    "autocast over fp32 weights": (torch.float32, torch.bfloat16),
}
GEMMS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "addbmm"}
# ops that make a view or read metadata: no bytes move
VIEWS = {"view", "_unsafe_view", "t", "transpose", "slice", "select", "as_strided", "detach", "alias", "expand",
         "unsqueeze", "squeeze", "permute", "reshape", "_reshape_alias", "split", "unbind", "lift_fresh",
         "empty", "empty_like", "empty_strided", "new_empty", "resize_", "_local_scalar_dense", "is_same_size",
         "set_", "_has_compatible_shallow_copy_type", "result_type"}
KINDS = ("weight", "weight block", "tile", "hidden", "small")


class OutsideGemmCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it by phase and kind (``KINDS``), leaving out GEMMs, views and the
    ops of the row kernels (``in_kernel``)."""

    def __init__(self, shape: dict):
        super().__init__()
        self.shape, self.phase, self.in_kernel = shape, "forward", 0
        self.counts: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}
        self.ops: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}

    def kind(self, tensors) -> str:
        H, V, N, rows = (self.shape[k] for k in ("H", "V", "N", "tile_rows"))
        shapes = [tuple(t.shape) for t in tensors if t.dim() == 2]
        if any(t.numel() == V * H for t in tensors):
            return "weight"
        if any(s[1] == H and s[0] > rows and s[0] != N for s in shapes):  # a vocabulary block of the weight
            return "weight block"
        if any(s[1] > H and s[0] <= rows for s in shapes):  # a tile, or the columns of one vocabulary block
            return "tile"
        if any(t.dim() >= 2 and t.shape[-1] == H for t in tensors):
            return "hidden"
        return "small"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.in_kernel or name in GEMMS or name in VIEWS:
            return out
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        kind = self.kind(tensors)
        self.counts[self.phase][kind] += 1
        if kind != "small":
            self.ops[self.phase][f"{kind}: {name}"] += 1
        return out


@contextlib.contextmanager
def counted_kernels(counter: OutsideGemmCounter):
    """The torch twins of the row kernels, each wrapped so that the counter skips the ops they dispatch."""
    from dgpo_ops.ops import backends

    original = backends._kernel_set

    def wrap(function):
        def wrapped(*args, **kwargs):
            counter.in_kernel += 1
            try:
                return function(*args, **kwargs)
            finally:
                counter.in_kernel -= 1
        return wrapped

    def kernel_set(name):
        kernels = original(name)
        # the backward's scale-and-cast is the gradients' one write, counted as the pass it is
        fields = {f.name: wrap(getattr(kernels, f.name)) for f in dataclasses.fields(kernels)
                  if f.name not in ("name", "scale_cast")}
        return dataclasses.replace(kernels, **fields)

    backends._kernel_set = kernel_set
    try:
        yield
    finally:
        backends._kernel_set = original


def count_setting(setting: str, level: str = "token", bias: bool = False) -> dict:
    """``{phase: {kind: ops}}`` and the ops by name of one forward + backward of grpo under ``SETTINGS[setting]``
    (``level="sequence"``: GSPO's ratio, whose gradients come in a second sweep of the tiles)."""
    import dgpo_ops
    from dgpo_ops.ops import linear

    dtype, autocast = SETTINGS[setting]
    B, T, H, V = (SHAPE[k] for k in ("B", "T", "H", "V"))
    assert SHAPE["N"] == B * T
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(B, T, H, generator=g) / H**0.5).to(dtype).requires_grad_(True)
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_(True)
    bias_t = torch.randn(V, generator=g).to(dtype).requires_grad_(True) if bias else None
    target = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) * 5
    advantages = torch.randn(B, generator=g)
    tile_bytes = 4 if dtype == torch.float32 and autocast is None else 2
    counter = OutsideGemmCounter(SHAPE)
    made = []  # the tile buffers' rows: the op halves them where it pipelines the sweep (ops/linear.py)
    original_tiles = linear.Tiles.__init__

    def recording_tiles(self, *args, **kwargs):
        original_tiles(self, *args, **kwargs)
        made.append(self.rows)

    linear.Tiles.__init__ = recording_tiles
    try:
        with counted_kernels(counter), counter:
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, target, advantages, None, old, bias=bias_t,
                                                      method="grpo", importance_sampling_level=level,
                                                      backend="torch", memory_budget=SHAPE["tile_rows"] * V * tile_bytes)
            counter.phase = "backward"
            out.loss.backward()
    finally:
        linear.Tiles.__init__ = original_tiles
    return {"counts": {phase: dict(c) for phase, c in counter.counts.items()},
            "ops": {phase: dict(c) for phase, c in counter.ops.items()},
            "tiles": -(-B * T // made[0])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS_DIR / "outside_gemms-cpu.md"))
    args = parser.parse_args()
    results = {setting: count_setting(setting) for setting in SETTINGS}
    lines = ["# The fused-linear op outside its GEMMs and row kernels (generated by `python -m bench.outside_gemms`;"
             " do not edit)", "",
             f"One forward + backward of grpo, {SHAPE}, torch twins on the CPU; ops by the largest tensor they "
             "touch (bench/outside_gemms.py says what each kind is).", "",
             "| setting | phase | " + " | ".join(KINDS) + " | ops (not small) |", "|---|---|" + "---|" * len(KINDS) + "---|"]
    for setting, result in results.items():
        for phase in ("forward", "backward"):
            counts = result["counts"][phase]
            ops = ", ".join(f"{name} x{n}" for name, n in sorted(result["ops"][phase].items()))
            lines.append(f"| {setting} | {phase} | " + " | ".join(str(counts.get(k, 0)) for k in KINDS)
                         + f" | {ops} |")
    lines += ["", f"<!-- outside-gemms {json.dumps(results)} -->", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines[:-2]))


if __name__ == "__main__":
    main()
