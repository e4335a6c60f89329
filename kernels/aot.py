"""Ahead-of-time compile report: every kernel specialisation for real GPUs, without one.

    python -m dgpo_ops.kernels.aot [--arch 80 90] [--full] [--jobs 2]

Compiles each specialisation with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch,
32))`` using the specialisation hints the JIT would give on real tensors (16-byte aligned
pointers, a vocabulary and row strides divisible by 16, a unit vocabulary stride), reads
registers, shared and local memory from ``cuobjdump --dump-resource-usage`` (shipped in the
triton wheel) and checks the hot loop's SASS for 128-bit global loads. Exits non-zero if any
specialisation fails to compile or spills to local memory.

The default covers every method (and sapo gate) x logits dtype with all epilogue inputs present,
every combination of the epilogue flags for dgpo, the forward without epilogue (GSPO and forward
only) and the backward with and without the entropy term. ``--full`` compiles the whole
method x dtype x flag product.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget

from dgpo_ops.methods import Gate, MethodId

from .logits_grad import logits_grad_kernel
from .logprob_entropy import logprob_entropy_fwd_kernel

BLOCK_V = 4096  # the production tile (vocabularies >= 4096); smaller vocabularies use a smaller power of 2
NUM_WARPS = 8
DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
POINTER_TYPES = {"target_ids_ptr": "*i64", "mask_ptr": "*i1", "region_ptr": "*i8"}
FLOAT_SCALARS = ("inv_temperature", "beta")
DIVISIBLE_INTS = ("vocab", "stride_b", "stride_t", "grad_stride_b", "grad_stride_t")
UNIT_STRIDES = ("stride_v", "grad_stride_v")
FORWARD_FLAGS = ("HAS_OLD_LOGPS", "HAS_KL", "KL_TIMES_RATIO", "HAS_ROLLOUT_WEIGHTS")
METHOD_VARIANTS = [(m.name.lower(), m, Gate.SIGMOID) for m in MethodId if m != MethodId.SAPO] + [
    (f"sapo_{g.name.lower()}", MethodId.SAPO, g) for g in Gate
]


@dataclass(frozen=True)
class Specialisation:
    kernel: str  # "forward" | "backward"
    dtype: str
    constexprs: tuple  # sorted (name, value) pairs

    @property
    def label(self) -> str:
        c = dict(self.constexprs)
        if self.kernel == "backward":
            return f"backward {self.dtype} entropy={int(c['HAS_ENTROPY_GRAD'])}"
        if not c["HAS_EPILOGUE"]:
            return f"forward  {self.dtype} no-epilogue"
        method = next(n for n, m, g in METHOD_VARIANTS if m == c["METHOD"] and (m != MethodId.SAPO or g == c["GATE"]))
        flags = "".join("1" if c[f] else "0" for f in FORWARD_FLAGS)
        return f"forward  {self.dtype} {method:<22} old/kl/klr/w={flags}"


ALL_FLAGS = (True,) * len(FORWARD_FLAGS)


def _forward(dtype, method=MethodId.DGPO, gate=Gate.SIGMOID, epilogue=True, flags=ALL_FLAGS):
    constexprs = dict(METHOD=int(method), GATE=int(gate), HAS_EPILOGUE=epilogue, BLOCK_V=BLOCK_V)
    constexprs.update(zip(FORWARD_FLAGS, flags if epilogue else (False,) * len(FORWARD_FLAGS)))
    return Specialisation("forward", dtype, tuple(sorted(constexprs.items())))


def _flag_sets():
    """Every combination of the epilogue flags the launcher can pass (the KL ratio needs the KL)."""
    combos = itertools.product((False, True), repeat=len(FORWARD_FLAGS))
    return [c for c in combos if not (c[FORWARD_FLAGS.index("KL_TIMES_RATIO")] and not c[FORWARD_FLAGS.index("HAS_KL")])]


def specialisations(full: bool = False) -> list[Specialisation]:
    specs = []
    for dtype in DTYPES:
        specs.append(_forward(dtype, epilogue=False))
        for _, method, gate in METHOD_VARIANTS:
            flag_sets = _flag_sets() if full else [ALL_FLAGS]
            specs += [_forward(dtype, method, gate, flags=flags) for flags in flag_sets]
        if not full:
            specs += [_forward(dtype, flags=flags) for flags in _flag_sets() if flags != ALL_FLAGS]
        for entropy in (False, True):
            specs.append(Specialisation("backward", dtype, (("BLOCK_V", BLOCK_V), ("HAS_ENTROPY_GRAD", entropy))))
    return specs


def _source(spec: Specialisation):
    fn = logprob_entropy_fwd_kernel if spec.kernel == "forward" else logits_grad_kernel
    signature, attrs = {}, {}
    constexprs = dict(spec.constexprs)
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in UNIT_STRIDES:
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif name.endswith("_ptr"):
            logits_like = name in ("logits_ptr", "grad_logits_ptr")
            signature[name] = DTYPES[spec.dtype] if logits_like else POINTER_TYPES.get(name, "*fp32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in DIVISIBLE_INTS:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _nvidia_tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_one(job: tuple[Specialisation, int]) -> dict:
    spec, arch = job
    row = {"label": spec.label, "arch": f"sm_{arch}"}
    try:
        compiled = triton.compile(_source(spec), target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": NUM_WARPS})
    except Exception as error:  # report every failure, not just the first
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return row
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        match = re.search(rf"\b{key}:(\d+)", usage)
        row[key.lower()] = int(match.group(1)) if match else None
    # cuobjdump shows static shared memory only; the reductions' scratch is Triton's dynamic shared memory.
    row["shared"] = max(row["shared"] or 0, compiled.metadata.shared)
    row["ldg128"] = len(re.findall(r"LDG\.E\.128", sass))
    row["stg128"] = len(re.findall(r"STG\.E\.128", sass))
    ptx = compiled.asm["ptx"]
    if spec.kernel == "backward" and spec.dtype == "bf16":
        row["bf16_round"] = "cvt.rn" if re.search(r"cvt\.rn(\.satfinite)?\.bf16", ptx) else "other"
    return row


def run(archs=(80, 90), full=False, jobs=2) -> list[dict]:
    work = [(spec, arch) for arch in archs for spec in specialisations(full)]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(compile_one, work))
    return [compile_one(job) for job in work]


def format_report(rows: list[dict]) -> str:
    header = f"{'arch':<6} {'specialisation':<58} {'regs':>4} {'smem':>6} {'local':>5} {'stack':>5} {'LDG.128':>7} {'STG.128':>7}"
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['arch']:<6} {row['label']:<58} FAILED {row['error']}")
            continue
        lines.append(f"{row['arch']:<6} {row['label']:<58} {row['reg']:>4} {row['shared']:>6} {row['local']:>5} "
                     f"{row['stack']:>5} {row['ldg128']:>7} {row['stg128']:>7}")
    return "\n".join(lines)


def problems(rows: list[dict]) -> list[str]:
    found = []
    for row in rows:
        where = f"{row['arch']} {row['label']}"
        if "error" in row:
            found.append(f"{where}: failed to compile ({row['error']})")
        elif row["local"] or row["stack"]:
            found.append(f"{where}: spills (local {row['local']} B, stack {row['stack']} B)")
        elif row["label"].startswith("forward  bf16") and row["ldg128"] == 0:
            found.append(f"{where}: no 128-bit global loads in the bf16 forward")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgpo_ops.kernels.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--full", action="store_true", help="the whole method x dtype x flag product")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--notes", metavar="PATH",
                        help="also write the report between the aot markers of this markdown file (csrc_notes.md)")
    args = parser.parse_args(argv)
    if not isinstance(logprob_entropy_fwd_kernel, triton.JITFunction):
        sys.exit("dgpo_ops.kernels.aot compiles real kernels: unset TRITON_INTERPRET")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    rows = run(args.arch, args.full, args.jobs)
    found = problems(rows)
    bf16 = sorted({row["bf16_round"] for row in rows if "bf16_round" in row})
    report = "\n".join([
        f"triton {triton.__version__}, BLOCK_V={BLOCK_V}, num_warps={NUM_WARPS}, {len(rows)} specialisations",
        format_report(rows),
        f"bf16 gradient stores convert with: {', '.join(bf16)} (cvt.rn: round to nearest even)",
        f"{len(rows) - len(found)} of {len(rows)} specialisations compiled without spills",
    ])
    print(report)
    for problem in found:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    if args.notes:
        _write_between_markers(args.notes, report)
    return 1 if found else 0


def _write_between_markers(path, report):
    start, end = "<!-- aot:start -->", "<!-- aot:end -->"
    with open(path) as f:
        text = f.read()
    if start not in text or end not in text:
        raise SystemExit(f"{path} has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(f"{head}{start}\n```\n{report}\n```\n{end}{tail}")


if __name__ == "__main__":
    sys.exit(main())
