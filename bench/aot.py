"""Ahead-of-time compile report: every kernel specialisation for real GPUs, without one.

    python -m bench.aot [--arch 80 90] [--full] [--jobs 2]

Compiles each specialisation with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch,
32))`` using the specialisation hints the JIT would give on real tensors (16-byte aligned
pointers, a vocabulary and row strides divisible by 16, a unit vocabulary stride) and the launch
shape the launchers use, reads registers, shared and local memory from ``cuobjdump
--dump-resource-usage`` (shipped in the triton wheel) and reads the SASS (every kernel of one architecture in one
``nvdisasm`` run: ``sass_of_many``): 128-bit global loads and
stores, and the special-function (MUFU) instructions per vocabulary element of the row kernels'
hot loop. Exits non-zero if any specialisation fails to compile, spills to local memory, takes more
shared memory than a block may on its architecture, or runs more than one MUFU instruction per
element in the backward's hot loop.

The default covers every method (and sapo gate) x logits dtype with all epilogue inputs present,
every combination of the epilogue flags for dgpo, the forward without epilogue (GSPO and forward
only), the backward with and without the entropy term and with the objective's scaled
coefficients, the prologue and the finalize kernel, the fused-linear backward's scale-and-cast (bf16 and fp16
out, with 128-bit loads and stores: a copy's traffic), and the on-chip fused-linear kernels
(``linear_logits.py``, ``linear_grad.py``) for bf16 weights and for fp32 weights rounded to bf16 in
registers (autocast), with the tensor-core instructions (HGMMA on sm_90, HMMA on sm_80) their
products compile to. A method id without a Triton branch fails
to compile (``tl.static_assert``), so this report catches it. ``--full`` compiles the whole
method x dtype x flag product.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import os
import re
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import triton
import triton.language as tl
from dgpo_ops.kernels.finalize import FINALIZE_WARPS, finalize_kernel
from dgpo_ops.kernels.finalize import MAX_BLOCK as FINALIZE_BLOCK
from dgpo_ops.kernels.interface import Denominator, Gate, MethodId, Normalizer
from dgpo_ops.kernels.linear_grad import linear_grad_kernel
from dgpo_ops.kernels.linear_logits import (
    LINEAR_GRAD_SHAPES,
    PARTIALS_SHAPE,
    linear_partials_kernel,
    linear_rows_kernel,
)
from dgpo_ops.kernels.logits_grad import logits_grad_kernel
from dgpo_ops.kernels.logprob_entropy import BACKWARD_SHAPE, FORWARD_SHAPE, logprob_entropy_fwd_kernel
from dgpo_ops.kernels.prologue import prologue_warps, token_prologue_kernel
from dgpo_ops.kernels.scale_cast import BLOCK as SCALE_CAST_BLOCK
from dgpo_ops.kernels.scale_cast import NUM_WARPS as SCALE_CAST_WARPS
from dgpo_ops.kernels.scale_cast import scale_cast_kernel
from triton.backends.compiler import GPUTarget

KERNELS = {"forward": logprob_entropy_fwd_kernel, "backward": logits_grad_kernel, "prologue": token_prologue_kernel,
           "finalize": finalize_kernel, "linear_partials": linear_partials_kernel, "linear_rows": linear_rows_kernel,
           "linear_grad": linear_grad_kernel, "scale_cast": scale_cast_kernel}
# The production tiles (vocabularies at least that wide) and the launchers' shapes.
LAUNCH = {"forward": dict(num_warps=FORWARD_SHAPE.num_warps, num_stages=FORWARD_SHAPE.num_stages),
          "backward": dict(num_warps=BACKWARD_SHAPE.num_warps, num_stages=BACKWARD_SHAPE.num_stages),
          "prologue": dict(num_warps=prologue_warps(False)), "finalize": dict(num_warps=FINALIZE_WARPS),
          "linear_partials": dict(num_warps=PARTIALS_SHAPE.num_warps, num_stages=PARTIALS_SHAPE.num_stages),
          "linear_rows": dict(num_warps=1), "scale_cast": dict(num_warps=SCALE_CAST_WARPS)}
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# pointers of the spec's dtype
LOGITS_LIKE = ("logits_ptr", "grad_logits_ptr", "hidden_ptr", "weight_ptr", "bias_ptr", "out_ptr")
DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
POINTER_TYPES = {"target_ids_ptr": "*i64", "mask_ptr": "*i64", "target_index_ptr": "*i64",
                 "sequence_stats_ptr": "*i64", "status_ptr": "*i64"}
FLOAT_SCALARS = ("inv_temperature", "beta", "entropy_coef", "normalizer", "tanh_scale", "out_scale")
DIVISIBLE_INTS = ("vocab", "n_elements", "stride_b", "stride_t", "grad_stride_b", "grad_stride_t", "hidden_dim",
                  "stride_hn", "stride_wv", "split_width")
UNIT_STRIDES = ("stride_v", "grad_stride_v", "stride_hk", "stride_wk", "stride_bias")
FORWARD_FLAGS = ("HAS_OLD_LOGPS", "HAS_KL", "KL_TIMES_RATIO", "HAS_ROLLOUT_WEIGHTS")
METHOD_VARIANTS = [(m.name.lower(), m, Gate.SIGMOID) for m in MethodId if m != MethodId.SAPO] + [
    (f"sapo_{g.name.lower()}", MethodId.SAPO, g) for g in Gate
]
MMA_OF_ARCH = {"sm_80": "HMMA", "sm_90": "HGMMA"}  # what the on-chip fused-linear products must use
# The most shared memory one block may take (cudaDevAttrMaxSharedMemoryPerBlockOptin): 163 KiB on the A100,
# 227 KiB on the H100
MAX_SHARED_OF_ARCH = {"sm_80": 166912, "sm_90": 232448}
# The backward is bound by memory only while the SFU keeps up: one exp per element, 1 - p of the target once per row
MAX_BACKWARD_MUFU_PER_ELEMENT = 1.0
# The bf16 forward is bound by HBM only while the schedulers issue its loop faster than the logits arrive. On an
# H200 (132 SMs x 4 schedulers x 1.98 GHz, one warp instruction each per clock; 4.2-4.3 TB/s read) 2 bytes per
# element allow about 15.6 instructions per element; at 19.2 (run 21) the forward read about 3.05 TB/s. Kept under 14.
MAX_FORWARD_BF16_OPS_PER_ELEMENT = 14.0


@dataclass(frozen=True)
class Specialisation:
    kernel: str  # "forward" | "backward" | "prologue" | "finalize"
    dtype: str  # the logits' dtype ("-" for kernels that read no logits)
    constexprs: tuple  # sorted (name, value) pairs

    @property
    def launch(self) -> dict:
        if self.kernel == "prologue":
            return dict(num_warps=prologue_warps(dict(self.constexprs)["HAS_FINALIZE"]))
        if self.kernel == "linear_grad":  # the tile of the operands' width, as the launcher picks it
            shape = LINEAR_GRAD_SHAPES[BYTES[self.dtype]]
            return dict(num_warps=shape.num_warps, num_stages=shape.num_stages)
        return LAUNCH[self.kernel]

    @property
    def label(self) -> str:
        c = dict(self.constexprs)
        if self.kernel == "backward":
            per_token = " per-token" if c["ENTROPY_GRAD_PER_TOKEN"] else ""
            return (f"backward {self.dtype} entropy={int(c['HAS_ENTROPY_GRAD'])}{per_token} "
                    f"scaled={int(c['COEF_IS_SCALED'])}")
        if self.kernel == "prologue":
            finalizes = f" +finalize kl={int(c['HAS_KL'])}" if c["HAS_FINALIZE"] else ""
            return f"prologue mask={int(c['HAS_MASK'])} old/ref/w={int(c['HAS_OLD_LOGPS'])}{int(c['HAS_REF_LOGPS'])}" \
                   f"{int(c['HAS_ROLLOUT_WEIGHTS'])} norm={Normalizer(c['NORMALIZER']).name.lower()}{finalizes}"
        if self.kernel == "finalize":
            return f"finalize kl={int(c['HAS_KL'])}"
        if self.kernel in ("linear_partials", "linear_grad"):
            operand = "bf16 operands" if self.dtype == "bf16" else f"{self.dtype}->bf16 (autocast)"
            grads = f" entropy={int(c['HAS_ENTROPY_GRAD'])}" if self.kernel == "linear_grad" else ""
            return f"{self.kernel} {self.dtype} {operand}{grads}"
        if self.kernel == "linear_rows":
            return "linear_rows - dgpo epilogue old/kl/klr/w=1111"
        if self.kernel == "scale_cast":
            return f"scale_cast fp32->{self.dtype}"
        if c["WRITES_PARTIALS"]:
            return f"forward  {self.dtype} partials (split vocabulary)"
        if not c["HAS_EPILOGUE"]:
            return f"forward  {self.dtype} no-epilogue"
        method = next(n for n, m, g in METHOD_VARIANTS if m == c["METHOD"] and (m != MethodId.SAPO or g == c["GATE"]))
        flags = "".join("1" if c[f] else "0" for f in FORWARD_FLAGS)
        return f"forward  {self.dtype} {method:<22} old/kl/klr/w={flags}"


ALL_FLAGS = (True,) * len(FORWARD_FLAGS)


def _forward(dtype, method=MethodId.DGPO, gate=Gate.SIGMOID, epilogue=True, flags=ALL_FLAGS, partials=False):
    # HAS_MASK on: TRL passes a completion mask; without one the kernel only loses a load.
    constexprs = dict(METHOD=int(method), GATE=int(gate), HAS_EPILOGUE=epilogue, HAS_MASK=True,
                      WRITES_PARTIALS=partials, BLOCK_V=FORWARD_SHAPE.block_v)
    constexprs.update(zip(FORWARD_FLAGS, flags if epilogue else (False,) * len(FORWARD_FLAGS)))
    return Specialisation("forward", dtype, tuple(sorted(constexprs.items())))


def _backward(dtype, entropy=False, scaled=False, per_token_entropy=False):
    # per_token_entropy: d loss / d entropy read per token (a loss outside the package: verl's)
    constexprs = dict(BLOCK_V=BACKWARD_SHAPE.block_v, HAS_ENTROPY_GRAD=entropy, COEF_IS_SCALED=scaled, HAS_GRAD_LOSS=True,
                      ENTROPY_GRAD_PER_TOKEN=per_token_entropy)
    return Specialisation("backward", dtype, tuple(sorted(constexprs.items())))


def _prologue(everything: bool, finalize: bool = False):
    # finalize: the logits op's prologue, which also reduces the loss and metrics (with the KL
    # when everything is on); the fused-linear op launches the plain prologue and finalize_kernel.
    constexprs = dict(HAS_MASK=everything, CHECK_MASK_VALUES=everything, HAS_OLD_LOGPS=everything,
                      HAS_REF_LOGPS=everything, HAS_ROLLOUT_WEIGHTS=everything,
                      NORMALIZER=int(Normalizer.TENSOR if everything else Normalizer.ABSENT),
                      PER_RESPONSE=everything, DENOMINATOR=int(Denominator.TOKENS), BLOCK_T=1024, BLOCK_B=1024,
                      HAS_FINALIZE=finalize, HAS_KL=finalize and everything,
                      FINALIZE_BLOCK=FINALIZE_BLOCK if finalize else 16)
    return Specialisation("prologue", "-", tuple(sorted(constexprs.items())))


def _finalize(kl: bool):
    return Specialisation("finalize", "-", (("BLOCK", FINALIZE_BLOCK), ("HAS_KL", kl)))


def _linear(kernel: str, stored: str, entropy: bool = False):
    """An on-chip fused-linear kernel reading ``stored`` hidden/weight and multiplying bf16 operands."""
    shape = PARTIALS_SHAPE if kernel == "linear_partials" else LINEAR_GRAD_SHAPES[BYTES[stored]]
    constexprs = dict(OPERAND=tl.bfloat16, HAS_BIAS=False, HAS_SOFTCAP=False, DOT_PRECISION="tf32", DOT_IN_FP32=False,
                      BLOCK_N=shape.block_n, BLOCK_V=shape.block_v, BLOCK_K=shape.block_k)
    if kernel == "linear_partials":
        constexprs["HAS_MASK"] = True
    else:
        constexprs.update(COEF_IS_SCALED=False, HAS_ENTROPY_GRAD=entropy, HAS_GRAD_HIDDEN=True, HAS_GRAD_WEIGHT=True,
                          HAS_GRAD_BIAS=False)
    return Specialisation(kernel, stored, tuple(sorted(constexprs.items())))


def _linear_rows():
    constexprs = dict(METHOD=int(MethodId.DGPO), GATE=int(Gate.SIGMOID), HAS_EPILOGUE=True, HAS_MASK=True,
                      BLOCK_S=8, **dict(zip(FORWARD_FLAGS, ALL_FLAGS)))
    return Specialisation("linear_rows", "-", tuple(sorted(constexprs.items())))


def _scale_cast(out: str):
    """The fused-linear backward's scale-and-cast of an fp32 gradient into ``out``."""
    return Specialisation("scale_cast", out, (("BLOCK", SCALE_CAST_BLOCK), ("ROUND_IN_FP32", False)))


def _flag_sets():
    """Every combination of the epilogue flags the launcher can pass (the KL ratio needs the KL)."""
    combos = itertools.product((False, True), repeat=len(FORWARD_FLAGS))
    return [c for c in combos if not (c[FORWARD_FLAGS.index("KL_TIMES_RATIO")] and not c[FORWARD_FLAGS.index("HAS_KL")])]


def specialisations(full: bool = False) -> list[Specialisation]:
    specs = [_prologue(False), _prologue(True), _prologue(False, finalize=True), _prologue(True, finalize=True),
             _finalize(False), _finalize(True)]
    specs += [_linear("linear_partials", stored) for stored in ("bf16", "fp32")] + [_linear_rows()]
    specs += [_linear("linear_grad", stored, entropy) for stored in ("bf16", "fp32") for entropy in (False, True)]
    specs += [_scale_cast(out) for out in ("bf16", "fp16")]  # an fp32 gradient is scaled in place
    for dtype in DTYPES:
        specs += [_forward(dtype, epilogue=False), _forward(dtype, epilogue=False, partials=True)]
        for _, method, gate in METHOD_VARIANTS:
            flag_sets = _flag_sets() if full else [ALL_FLAGS]
            specs += [_forward(dtype, method, gate, flags=flags) for flags in flag_sets]
        if not full:
            specs += [_forward(dtype, flags=flags) for flags in _flag_sets() if flags != ALL_FLAGS]
        specs += [_backward(dtype, entropy) for entropy in (False, True)] + [_backward(dtype, True, scaled=True),
                                                                            _backward(dtype, True, True, True)]
    return specs


def _source(spec: Specialisation, constexpr_overrides: dict | None = None):
    fn = KERNELS[spec.kernel]
    signature, attrs = {}, {}
    constexprs = {**dict(spec.constexprs), **(constexpr_overrides or {})}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in UNIT_STRIDES:
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif name.endswith("_ptr"):
            signature[name] = DTYPES[spec.dtype] if name in LOGITS_LIKE else POINTER_TYPES.get(name, "*fp32")
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


BRANCH = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+0x([0-9a-f]+)")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
INSTRUCTION_ADDRESS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+\S")


def sass_loops(sass: str) -> list[tuple[int, int]]:
    """(start, end) addresses of every loop of a SASS listing: a backward branch's target to the
    branch (the trailing `BRA self` trap has target == address and is not a loop)."""
    loops = []
    for match in BRANCH.finditer(sass):
        at, target = int(match.group(1), 16), int(match.group(2), 16)
        if target < at:
            loops.append((target, at))
    return loops


def hot_loop_mufu(sass: str) -> dict:
    """MUFU instructions, and all instructions, in the loop that issues the most 128-bit loads (the vocabulary
    loop)."""
    loops = sass_loops(sass)
    instructions = [(int(m.group(1), 16), m.group(2)) for m in INSTRUCTION.finditer(sass)]
    best = None
    for lo, hi in loops:
        body = [op for at, op in instructions if lo <= at <= hi]
        loads = sum(op.startswith("LDG.E.128") for op in body)
        if loads and (best is None or loads > best["ldg128"]):
            mufu = [op for op in body if op.startswith("MUFU")]
            best = {"ldg128": loads, "mufu": len(mufu), "mufu_ops": sorted(set(mufu)), "instructions": len(body)}
    return best or {"ldg128": 0, "mufu": 0, "mufu_ops": [], "instructions": 0}


def _compile(job: tuple[Specialisation, int]) -> tuple[dict, bytes | None]:
    """The row of one specialisation without its SASS counts (registers, memory, the PTX's bf16 rounding), and its
    cubin (None where it failed to compile)."""
    spec, arch = job
    row = {"label": spec.label, "arch": f"sm_{arch}", "kernel": spec.kernel}
    try:
        compiled = triton.compile(_source(spec), target=GPUTarget("cuda", arch, 32), options=spec.launch)
    except Exception as error:  # report every failure, not just the first
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return row, None
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        match = re.search(rf"\b{key}:(\d+)", usage)
        row[key.lower()] = int(match.group(1)) if match else None
    # cuobjdump shows static shared memory only; the reductions' scratch is Triton's dynamic shared memory.
    row["shared"] = max(row["shared"] or 0, compiled.metadata.shared)
    ptx = compiled.asm["ptx"]
    if spec.kernel == "backward" and spec.dtype == "bf16":
        row["bf16_round"] = "cvt.rn" if re.search(r"cvt\.rn(\.satfinite)?\.bf16", ptx) else "other"
    return row, compiled.asm["cubin"]


def _count_sass(row: dict, spec: Specialisation, sass: str) -> dict:
    """``row`` with the counts read from the SASS listing of its kernel."""
    row["ldg128"] = len(re.findall(r"LDG\.E\.128", sass))
    row["stg128"] = len(re.findall(r"STG\.E\.128", sass))
    mma = re.findall(r"\b(H[G]?MMA)\.", sass)  # tensor-core products: HGMMA (sm_90 wgmma), HMMA (mma.sync)
    row["mma"] = len(mma)
    row["mma_ops"] = sorted(set(mma))
    if spec.kernel in ("forward", "backward"):
        loop = hot_loop_mufu(sass)
        elements_per_thread = dict(spec.constexprs)["BLOCK_V"] / (32 * spec.launch["num_warps"])
        row["mufu_per_element"] = loop["mufu"] / elements_per_thread
        row["mufu_ops"] = loop["mufu_ops"]
        row["ops_per_element"] = loop["instructions"] / elements_per_thread
    return row


def _cubin_sass(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([_nvidia_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def _text_sections(cubin: bytes) -> list[bytes]:
    """The contents of the executable ``.text.*`` sections of a cubin (an ELF64, little-endian)."""
    (section_table,) = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(index):  # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, ...
        return struct.unpack_from("<IIQQQQ", cubin, section_table + index * entry_size)

    names = header(names_index)[4]
    texts = []
    for index in range(count):
        name, _, _, _, offset, size = header(index)
        if cubin[names + name:cubin.index(b"\0", names + name)].startswith(b".text."):
            texts.append(cubin[offset:offset + size])
    return texts


def sass_of_many(cubins: list[bytes], arch: int) -> list[str]:
    """The SASS listing of each cubin (its instruction lines, as ``cuobjdump -sass`` prints them but without the
    encodings), from one disassembler run for all of them: each cuobjdump run spends about 0.3-0.4 s starting the
    disassembler whatever the kernel, most of a report's time. The kernels' code, each one function in one
    ``.text`` section, is laid end to end in one raw instruction binary; each listing keeps the addresses of that
    binary, so its branches still point into itself. A cubin of several code sections goes through cuobjdump
    alone."""
    texts = [_text_sections(cubin) for cubin in cubins]
    blob, spans = bytearray(), {}
    for index, sections in enumerate(texts):
        if len(sections) == 1:
            spans[index] = (len(blob), len(blob) + len(sections[0]))
            blob += sections[0]
    listings = [[] for _ in cubins]
    if spans:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernels.bin")
            with open(path, "wb") as f:
                f.write(blob)
            # SM90a: the sm_90 cubins are sm_90a code (wgmma); the same decoding is the superset of sm_90's
            target = f"SM{arch}a" if arch == 90 else f"SM{arch}"
            listing = subprocess.run([_nvidia_tool("nvdisasm"), "--binary", target, path], capture_output=True,
                                     text=True, check=True).stdout
        starts = sorted((start, end, index) for index, (start, end) in spans.items())
        bounds = [start for start, _, _ in starts]
        for line in listing.splitlines():
            address = INSTRUCTION_ADDRESS.match(line)
            if address:
                at = int(address.group(1), 16)
                start, end, index = starts[bisect.bisect_right(bounds, at) - 1]
                if start <= at < end:
                    listings[index].append(line)
    return ["\n".join(listings[index]) if index in spans else _cubin_sass(cubin)
            for index, cubin in enumerate(cubins)]


def compile_one(job: tuple[Specialisation, int]) -> dict:
    row, cubin = _compile(job)
    return row if cubin is None else _count_sass(row, job[0], _cubin_sass(cubin))


def run(archs=(80, 90), full=False, jobs=2) -> list[dict]:
    work = [(spec, arch) for arch in archs for spec in specialisations(full)]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            compiled = list(pool.map(_compile, work))
    else:
        compiled = [_compile(job) for job in work]
    rows = [row for row, _ in compiled]
    for arch in archs:
        done = [index for index, ((_, of), (_, cubin)) in enumerate(zip(work, compiled)) if of == arch and cubin]
        for index, sass in zip(done, sass_of_many([compiled[index][1] for index in done], arch)):
            _count_sass(rows[index], work[index][0], sass)
    return rows


def format_report(rows: list[dict]) -> str:
    header = (f"{'arch':<6} {'specialisation':<58} {'regs':>4} {'smem':>6} {'local':>5} {'stack':>5} "
              f"{'LDG.128':>7} {'STG.128':>7} {'MUFU/elt':>8} {'ops/elt':>7} {'MMA':>5}")
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['arch']:<6} {row['label']:<58} FAILED {row['error']}")
            continue
        mufu = f"{row['mufu_per_element']:.2f}" if "mufu_per_element" in row else "-"
        ops = f"{row['ops_per_element']:.1f}" if "ops_per_element" in row else "-"
        lines.append(f"{row['arch']:<6} {row['label']:<58} {row['reg']:>4} {row['shared']:>6} {row['local']:>5} "
                     f"{row['stack']:>5} {row['ldg128']:>7} {row['stg128']:>7} {mufu:>8} {ops:>7} {row['mma']:>5}")
    return "\n".join(lines)


def problems(rows: list[dict]) -> list[str]:
    found = []
    for row in rows:
        where = f"{row['arch']} {row['label']}"
        if "error" in row:
            found.append(f"{where}: failed to compile ({row['error']})")
        elif row["local"] or row["stack"]:
            found.append(f"{where}: spills (local {row['local']} B, stack {row['stack']} B)")
        elif row["shared"] > MAX_SHARED_OF_ARCH[row["arch"]]:
            found.append(f"{where}: {row['shared']} B of shared memory, over the {MAX_SHARED_OF_ARCH[row['arch']]} "
                         f"B a block may take on {row['arch']}: it would not launch")
        elif row["label"].startswith(("forward  bf16", "backward bf16")) and row["ldg128"] == 0:
            found.append(f"{where}: no 128-bit global loads in a bf16 row kernel")
        elif row["kernel"] == "scale_cast" and (row["ldg128"] == 0 or row["stg128"] == 0):
            found.append(f"{where}: the scale-and-cast moves its elements without 128-bit loads and stores")
        elif row["kernel"] in ("linear_partials", "linear_grad") and row["mma_ops"] != [MMA_OF_ARCH[row["arch"]]]:
            found.append(f"{where}: products compiled to {row['mma_ops'] or 'no tensor-core instructions'}, "
                         f"expected {MMA_OF_ARCH[row['arch']]}")
        elif row["kernel"] == "backward" and row["mufu_per_element"] > MAX_BACKWARD_MUFU_PER_ELEMENT:
            found.append(f"{where}: {row['mufu_per_element']:.2f} MUFU instructions per element in the hot loop "
                         f"({', '.join(row['mufu_ops'])}); the backward must stay at one exp")
        elif row["label"].startswith("forward  bf16") and row["ops_per_element"] > MAX_FORWARD_BF16_OPS_PER_ELEMENT:
            found.append(f"{where}: {row['ops_per_element']:.1f} instructions per element in the hot loop, over "
                         f"{MAX_FORWARD_BF16_OPS_PER_ELEMENT:g}: the forward would be bound by instruction issue, not "
                         "by HBM")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--full", action="store_true", help="the whole method x dtype x flag product")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--notes", metavar="PATH",
                        help="also write the report between the aot markers of this markdown file (docs/aot_report.md)")
    args = parser.parse_args(argv)
    if not isinstance(logprob_entropy_fwd_kernel, triton.JITFunction):
        sys.exit("bench.aot compiles real kernels: unset TRITON_INTERPRET")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    rows = run(args.arch, args.full, args.jobs)
    found = problems(rows)
    bf16 = sorted({row["bf16_round"] for row in rows if "bf16_round" in row})
    report = "\n".join([
        f"triton {triton.__version__}, row forward {FORWARD_SHAPE}, row backward {BACKWARD_SHAPE}; "
        f"{len(rows)} specialisations",
        format_report(rows),
        f"bf16 gradient stores convert with: {', '.join(bf16)} (cvt.rn: round to nearest even)",
        "MUFU/elt: special-function instructions per vocabulary element in the row kernels' hot loop "
        f"(the backward must stay at {MAX_BACKWARD_MUFU_PER_ELEMENT:g}); ops/elt: all its instructions per element "
        f"(the bf16 forward must stay under {MAX_FORWARD_BF16_OPS_PER_ELEMENT:g}: issue faster than HBM delivers)",
        "MMA: tensor-core instructions in the SASS (the on-chip fused-linear products: "
        + ", ".join(f"{arch} {op}" for arch, op in MMA_OF_ARCH.items()) + ")",
        f"{len(rows) - len(found)} of {len(rows)} specialisations compiled without problems",
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
