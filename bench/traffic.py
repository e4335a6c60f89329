"""Memory-traffic model of the two row kernels, cross-checked against their SASS (no GPU needed).

    python -m bench.traffic [--out bench/results/traffic.md]     (TRITON_INTERPRET must be unset)

For each kernel specialisation the benchmark's path uses, the bytes read and written per token are
derived from the kernel source (what ``kernels/logprob_entropy.py`` and ``kernels/logits_grad.py``
load and store, csrc_notes.md, "Memory traffic") and counted again from the SASS that
``bench/aot.py`` builds for sm_90: every LDG/STG instruction, its width, and whether it sits in
the vocabulary loop (executed by all ``num_warps * 32`` threads once per ``BLOCK_V`` tile) or outside
it (one scalar per token). The last stdout line is a JSON summary for ``bench.report``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

H100_TBS, H200_TBS = 3.35, 4.8  # HBM3 / HBM3e bandwidth, TB/s (1e12 bytes/s)
SIZES = [(n, v) for n in (1024, 4096, 8192) for v in (32000, 151936, 262144)]
ARCH = 90
ELEM = {"bf16": 2, "fp16": 2, "fp32": 4}
# The Triton function of kernels/method_table.py that each method's epilogue runs. The words of the fp32 parameter
# vector it loads (``param_words``) are the same for every token of a launch, so they come from L2 after the first
# token; listed apart from per-token bytes.
METHOD_TERMS = {"dgpo": "_dgpo_terms", "grpo": "_ppo_clip_terms"}


def param_words(method: str) -> int:
    """The ``tl.load``s of ``params_ptr`` in the method's Triton function, read from its source."""
    import inspect

    from dgpo_ops.kernels import method_table

    tree = ast.parse(inspect.getsource(method_table))
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                    and node.name == METHOD_TERMS[method])
    return sum(1 for node in ast.walk(function) if _is_tl_call(node, "load")
               and any(isinstance(name, ast.Name) and name.id == "params_ptr" for name in ast.walk(node.args[0])))
ACCESS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?(LDG|STG)(\.[A-Z0-9.]+)?\s")


def _flags(*names: str) -> tuple:
    """Epilogue flags by name (bench/aot.FORWARD_FLAGS order); flags not named are off."""
    from bench import aot

    unknown = set(names) - set(aot.FORWARD_FLAGS)
    if unknown:
        raise ValueError(f"unknown forward flags {unknown}; aot has {aot.FORWARD_FLAGS}")
    return tuple(flag in names for flag in aot.FORWARD_FLAGS)


def _specs():
    from dgpo_ops.kernels.interface import Gate, MethodId

    from bench import aot

    def backward(dtype, entropy):
        return aot._backward(dtype, entropy)

    def forward(dtype, method=None, *flags):
        if method is None:
            return aot._forward(dtype, epilogue=False)
        return aot._forward(dtype, method, Gate.SIGMOID, flags=_flags(*flags))

    return [
        ("forward", "bf16 forward, no epilogue (GSPO, forward only)", forward("bf16"), None),
        ("forward", "bf16 forward + dgpo epilogue, old log-probs (the benchmark's call)",
         forward("bf16", MethodId.DGPO, "HAS_OLD_LOGPS"), "dgpo"),
        ("forward", "bf16 forward + grpo epilogue, old log-probs",
         forward("bf16", MethodId.PPO_CLIP, "HAS_OLD_LOGPS"), "grpo"),
        ("forward", "bf16 forward + dgpo epilogue, every per-token input and flag",
         forward("bf16", MethodId.DGPO, *aot.FORWARD_FLAGS), "dgpo"),
        ("backward", "bf16 backward (the benchmark's call)", backward("bf16", False), None),
        ("backward", "bf16 backward with the entropy term", backward("bf16", True), None),
        ("forward", "fp32 forward, no epilogue", forward("fp32"), None),
        ("backward", "fp32 backward", backward("fp32", False), None),
    ]


TYPE_BYTES = {"*fp32": 4, "*bf16": 2, "*fp16": 2, "*i64": 8, "*i32": 4, "*i8": 1, "*i1": 1}


def _is_tl_call(node, name: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl")


def derived(kind: str, spec, method: str | None) -> dict:
    """Bytes per token read from the kernel's source: walk the Triton function's AST with the
    specialisation's constexprs (``if FLAG:`` takes the branch the flag selects), and count every
    ``tl.load``/``tl.store``: inside the ``for`` over vocabulary tiles with an ``offsets`` address it is
    row traffic (the pointer's element size per vocabulary entry), otherwise one scalar per token. The
    element size comes from the pointer's type in the AOT signature. The method's parameter words are
    loaded by ``method_table.kernel_token_terms`` (``param_words``), called with ``method_params_ptr``. A helper of
    the kernel's own module called as a statement (``finish_row``) is walked as part of the kernel."""
    import triton

    from bench import aot

    source = aot._source(spec)
    signature, consts = source.signature, dict(spec.constexprs)
    pointers = {name for name, kind_ in signature.items() if kind_.startswith("*")}
    aliases: dict[str, str] = {}
    out = {"row_read_units": 0.0, "row_write_units": 0.0, "side_reads": {}, "side_writes": {}, "param_bytes": 0}

    def base(expr) -> str | None:
        for node in ast.walk(expr):
            if isinstance(node, ast.Name) and (node.id in pointers or node.id in aliases):
                return aliases.get(node.id, node.id)
        return None

    def names(expr) -> set:
        return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}

    loop_rows, tail_rows = set(), set()  # (pointer, op) of the row accesses in the loop / in a last-tile branch

    def account(call, op: str, in_loop: bool, tail: bool = False) -> None:
        ptr = base(call.args[0])
        if ptr is None:
            raise ValueError(f"cannot tell which pointer {ast.unparse(call)} uses")
        size = TYPE_BYTES[signature[ptr]]
        label = ptr.removesuffix("_ptr").replace("_", " ")
        if tail and "offsets" in names(call.args[0]):
            tail_rows.add((ptr, op))  # the row's last tile: its elements are the loop's per-element units
            return
        if in_loop and "offsets" in names(call.args[0]):
            loop_rows.add((ptr, op))
            out["row_read_units" if op == "load" else "row_write_units"] += size / 2
            return
        if "target" in names(call.args[0]) and ptr == "logits_ptr":
            label = "target logit"
        side = out["side_reads" if op == "load" else "side_writes"]
        side[label] = side.get(label, 0) + size

    def scan(node, in_loop: bool, tail: bool = False) -> None:
        for sub in ast.walk(node):
            if _is_tl_call(sub, "load"):
                account(sub, "load", in_loop, tail)
            elif _is_tl_call(sub, "store"):
                account(sub, "store", in_loop, tail)
            elif isinstance(sub, ast.Call) and any(isinstance(a, ast.Name) and a.id == "method_params_ptr"
                                                   for a in sub.args):
                out["param_bytes"] += 4 * param_words(method)
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "read_targets":
                # kernels/tokens.read_targets: one target id, and the mask value when HAS_MASK
                reads = out["side_reads"]
                reads["target ids"] = reads.get("target ids", 0) + TYPE_BYTES[signature["target_ids_ptr"]]
                if consts.get("HAS_MASK"):
                    reads["mask"] = reads.get("mask", 0) + TYPE_BYTES[signature["mask_ptr"]]

    kernel_globals = source.fn.fn.__globals__

    def inlined(st, in_loop: bool) -> bool:
        """A statement that calls a @triton.jit helper of the kernel's own module (the row forward's
        ``finish_row``): its loads and stores are the kernel's, so walk its body with its parameters
        bound to the caller's pointers and constexprs."""
        call = st.value if isinstance(st, ast.Expr) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            return False
        helper = kernel_globals.get(call.func.id)
        if not isinstance(helper, triton.JITFunction) or helper.fn.__module__ != source.fn.fn.__module__:
            return False
        for param, arg in zip(helper.arg_names, call.args):
            if isinstance(arg, ast.Name) and arg.id in consts:
                consts[param] = consts[arg.id]
            elif base(arg) is not None:
                aliases[param] = base(arg)
        visit(ast.parse(helper.src).body[0].body, in_loop)
        return True

    def visit(stmts, in_loop: bool, tail: bool = False) -> None:
        for st in stmts:
            if inlined(st, in_loop):
                continue
            if isinstance(st, ast.If):
                test = st.test
                if isinstance(test, ast.Name) and test.id in consts:
                    visit(st.body if consts[test.id] else st.orelse, in_loop, tail)
                    continue
                if in_loop or st.orelse:
                    raise ValueError(f"non-constexpr branch in the kernel: {ast.unparse(test)}")
                # A runtime branch after the loop: the row's last, partial tile (the loop reads the full ones
                # without a mask). Its row accesses are elements the per-element units already count.
                visit(st.body, False, tail=True)
                continue
            if isinstance(st, (ast.For, ast.While)):
                visit(st.body, True, tail)
                continue
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                ptr = base(st.value)
                if ptr is not None and st.targets[0].id.endswith("_ptr"):
                    aliases[st.targets[0].id] = ptr
            scan(st, in_loop, tail)

    function = ast.parse(source.fn.src).body[0]
    visit(function.body, False)
    if not tail_rows <= loop_rows:
        raise ValueError(f"a runtime branch accesses rows the vocabulary loop does not: {tail_rows - loop_rows}")
    out["last_tile_rows"] = bool(tail_rows)
    out["side_read_bytes"] = sum(out["side_reads"].values())
    out["side_write_bytes"] = sum(out["side_writes"].values())
    return out


def _width(suffix: str | None) -> int:
    parts = (suffix or "").split(".")
    for part, width in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if part in parts:
            return width
    return 4


def sass_traffic(sass: str, spec) -> dict:
    """LDG/STG of the SASS, split into the vocabulary loop (back-edge of a backward branch) and the rest."""
    from bench import aot

    loops = aot.sass_loops(sass)
    threads = spec.launch["num_warps"] * 32
    block_v = dict(spec.constexprs)["BLOCK_V"]
    inventory = {"loop": {}, "last tile": {}, "outside": {}}
    loop_bytes = {"LDG": 0, "STG": 0}
    side_bytes = {"LDG": 0, "STG": 0}
    for match in ACCESS.finditer(sass):
        at, op, suffix = int(match.group(1), 16), match.group(3), match.group(4)
        name = op + (suffix or "")
        in_loop = any(lo <= at <= hi for lo, hi in loops)
        # a 128-bit access outside the loop is a vector of the row's last, partial tile (the loop reads the full
        # ones without a mask): elements the loop's per-entry bytes count; the per-token scalars are narrower
        where = "loop" if in_loop else "last tile" if _width(suffix) == 16 else "outside"
        inventory[where][name] = inventory[where].get(name, 0) + 1
        if in_loop:
            loop_bytes[op] += _width(suffix) * threads  # per tile of BLOCK_V entries
        elif where == "outside":
            side_bytes[op] += _width(suffix)  # a scalar: one address per token
    per_entry = {op: b / block_v for op, b in loop_bytes.items()}  # bytes per vocabulary entry
    return {"loops": len(loops), "row_read_units": per_entry["LDG"] / 2, "row_write_units": per_entry["STG"] / 2,
            "side_read_bytes": side_bytes["LDG"], "side_write_bytes": side_bytes["STG"], "inventory": inventory}


def _compile_sass(spec) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    from bench import aot

    compiled = triton.compile(aot._source(spec), target=GPUTarget("cuda", ARCH, 32), options=spec.launch)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([aot._nvidia_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout


def analyse() -> list[dict]:
    from bench import aot

    rows = []
    for kind, label, spec, method in _specs():
        row = {"kind": kind, "label": label, "spec": spec.label, "dtype": spec.dtype,
               "derived": derived(kind, spec, method)}
        try:
            resource = aot.compile_one((spec, ARCH))  # the AOT report's own row: registers, LDG/STG.128 counts
            row["aot"] = {k: resource.get(k) for k in ("reg", "local", "ldg128", "stg128", "error") if k in resource}
            row["sass"] = sass_traffic(_compile_sass(spec), spec)
        except Exception as error:  # noqa: BLE001 - report, do not hide: the derived model still stands
            row["sass_error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            rows.append(row)
            continue
        d, s = row["derived"], row["sass"]
        loop, last = s["inventory"]["loop"], s["inventory"]["last tile"]
        row["checks"] = {
            "row read (x V*2)": (d["row_read_units"], s["row_read_units"]),
            "row write (x V*2)": (d["row_write_units"], s["row_write_units"]),
            "side read B": (d["side_read_bytes"] + d["param_bytes"], s["side_read_bytes"]),
            "side write B": (d["side_write_bytes"], s["side_write_bytes"]),
            "aot LDG.E.128 == loop + last tile LDG.E.128": (row["aot"].get("ldg128"),
                                                            loop.get("LDG.E.128", 0) + last.get("LDG.E.128", 0)),
            "aot STG.E.128 == loop + last tile STG.E.128": (row["aot"].get("stg128"),
                                                            loop.get("STG.E.128", 0) + last.get("STG.E.128", 0)),
            "a last-tile branch": (d["last_tile_rows"], bool(last)),
        }
        row["agree"] = all(a == b for a, b in row["checks"].values())
        rows.append(row)
    return rows


def linear_bytes(rows, dtype: str) -> float:
    """Bytes per logit element of the fused-linear tile: the GEMM's write plus the row kernels' reads
    and write (derived units of the forward without epilogue and the backward, of ``dtype`` tiles)."""
    element = ELEM[dtype]
    forward = next(r for r in rows if r["kind"] == "forward" and r["dtype"] == dtype)
    backward = next(r for r in rows if r["kind"] == "backward" and r["dtype"] == dtype)
    units = (forward["derived"]["row_read_units"] + backward["derived"]["row_read_units"]
             + backward["derived"]["row_write_units"])
    return element + units * 2  # derived units are V * 2 bytes per token, i.e. 2 bytes per element


def _fmt_units(x: float) -> str:
    return f"{x:g}"


def _pick(rows, label_start):
    return next(r for r in rows if r["label"].startswith(label_start))


def render(rows: list[dict]) -> tuple[str, dict]:
    import triton

    from bench import aot

    fwd = _pick(rows, "bf16 forward + dgpo epilogue, old log-probs")
    bwd = _pick(rows, "bf16 backward (the benchmark's call)")
    units = fwd["derived"]["row_read_units"] + bwd["derived"]["row_read_units"] + bwd["derived"]["row_write_units"]
    side = (fwd["derived"]["side_read_bytes"] + fwd["derived"]["side_write_bytes"]
            + bwd["derived"]["side_read_bytes"] + bwd["derived"]["side_write_bytes"])
    agree = all(r.get("agree") for r in rows)
    v_min = min(v for _, v in SIZES)
    lines = [
        "# Memory traffic of the fused policy loss (generated by `python -m bench.report`; do not edit)",
        "",
        (f"Kernels compiled for sm_{ARCH} with triton {triton.__version__} with the launchers' shapes (row "
        f"forward {aot.FORWARD_SHAPE}, row backward {aot.BACKWARD_SHAPE}), as in `bench/aot.py`. "
        "Per token, traffic is counted in units of `V * 2` bytes (one read of a bf16 logits row) for the "
        "vocabulary loop and in bytes for everything else."),
        "",
        ("* **derived**: from the kernel source (its AST, with the specialisation's constexpr branches "
        "taken): every `tl.load`/`tl.store` in the loop over vocabulary tiles moves one element per "
        "vocabulary entry; the others are the per-token scalars listed below."),
        ("* **SASS**: every `LDG`/`STG` of `cuobjdump -sass`; those between a backward branch's target "
        "and the branch are the loop (each executed by all threads once per `BLOCK_V` tile: bytes per "
        "vocabulary entry = width x threads / BLOCK_V), the others are per-token scalars (width bytes). "
        "`aot` is `bench.aot.compile_one`'s own `LDG.E.128`/`STG.E.128` count of the same build."),
        "",
        ("| kernel | row read derived / SASS | row write derived / SASS | side read B derived (+params) / SASS "
        "| side write B derived / SASS | aot LDG.128, STG.128 | regs | agree |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["derived"]
        if "sass" not in r:
            lines.append(f"| {r['label']} | {_fmt_units(d['row_read_units'])} / - | "
                         f"{_fmt_units(d['row_write_units'])} / - | {d['side_read_bytes']} (+{d['param_bytes']}) / - "
                         f"| {d['side_write_bytes']} / - | - | - | SASS unavailable: {r['sass_error']} |")
            continue
        s, a = r["sass"], r["aot"]
        lines.append(
            f"| {r['label']} | {_fmt_units(d['row_read_units'])} / {_fmt_units(s['row_read_units'])} "
            f"| {_fmt_units(d['row_write_units'])} / {_fmt_units(s['row_write_units'])} "
            f"| {d['side_read_bytes']} (+{d['param_bytes']}) / {s['side_read_bytes']} "
            f"| {d['side_write_bytes']} / {s['side_write_bytes']} | {a.get('ldg128')}, {a.get('stg128')} "
            f"| {a.get('reg')} | {'yes' if r['agree'] else '**NO**'} |")
    lines += ["", "SASS inventory (instruction: count), loop | outside:", ""]
    for r in rows:
        if "sass" in r:
            inv = r["sass"]["inventory"]
            fmt = lambda d: ", ".join(f"`{k}` {v}" for k, v in sorted(d.items())) or "none"
            lines.append(f"* {r['label']}: {fmt(inv['loop'])} | {fmt(inv['outside'])}")
    lines += ["", "Per-token scalars of the benchmark's two calls (derived):", ""]
    for r in (fwd, bwd):
        d = r["derived"]
        reads = ", ".join(f"{k} {v}" for k, v in d["side_reads"].items())
        writes = ", ".join(f"{k} {v}" for k, v in d["side_writes"].items()) or "none"
        extra = f"; plus {d['param_bytes']} B of method parameters, the same for every token (L2)" if d["param_bytes"] else ""
        lines.append(f"* {r['label']}: reads {reads}; writes {writes}{extra}.")
    lines += [
        "",
        f"**Where we are.** bf16 logits, the benchmark's call (dgpo epilogue with old log-probs, backward "
        f"without entropy term): forward {_fmt_units(fwd['derived']['row_read_units'])} + backward "
        f"{_fmt_units(bwd['derived']['row_read_units'] + bwd['derived']['row_write_units'])} = "
        f"**{_fmt_units(units)} passes** of `V * 2` bytes per token, plus {side} B of per-token scalars. "
        "The floor for an exact loss that needs `lse` before the first gradient element and keeps no "
        "V-sized softmax is 3 passes (read for `lse`; read and write for the gradient), so the kernels "
        f"sit on the floor; the scalars add {side} / (3 * 2V) to it ({100 * side / (6 * v_min):.3f}% at "
        f"V = {v_min}, less above). A masked "
        "token costs 0 in the forward and 1 (a zero store) in the backward. "
        + ("The SASS count agrees with the derivation for every kernel above."
           if agree else "**The SASS count disagrees with the derivation somewhere above: see the table.**"),
        "",
        "**Fused linear** (`fused_linear_dgpo_loss`, a token-level method): the GEMM writes each logits tile "
        "once in the tile dtype, the forward row kernel reads it, and the backward row kernel reads it and "
        "writes the gradient over it in the GEMMs' operand dtype, which the dH and dW GEMMs read as their "
        "operand. Per logit element, besides those GEMM operand reads: "
        + "; ".join(f"{label} tiles {linear_bytes(rows, dtype):g} B" for label, dtype in (("bf16", "bf16"),
                                                                                      ("fp32", "fp32")))
        + " (the forward's and backward's derived row units above, in bytes, plus the GEMM's write). "
        "The bf16 case is every bf16 run: autocast over fp32 weights, or bf16 weights. With a softcap the "
        "tile is fp32 and tanh and its chain rule add passes; not counted here.",
        "",
        ("For comparison, from their sources (not compiled here): TRL 1.16's `trl.kernels` log-prob kernel "
        "and Liger-Kernel 0.8.5's `triton_grpo_loss` also read each row once in the forward and read and "
        "write it once in the backward (3 passes); Liger additionally zero-fills the extra last position "
        "of its `(B, T+1, V)` gradient."),
        "",
        ("Implied time if the kernels ran at the full HBM bandwidth (a lower bound, not a measurement: no GPU "
        f"here; real kernels reach a fraction of peak): bytes / bandwidth, H100 {H100_TBS} TB/s, "
        f"H200 {H200_TBS} TB/s."),
        "",
        "| N | V | logits (MiB) | traffic (MiB) | traffic / 3-pass floor | H100 (ms) | H200 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    table = []
    for n, v in SIZES:
        total = n * (units * 2 * v + side)
        floor = n * 3 * 2 * v
        row = {"N": n, "V": v, "bytes": total, "floor_bytes": floor,
               "h100_ms": total / (H100_TBS * 1e12) * 1e3, "h200_ms": total / (H200_TBS * 1e12) * 1e3}
        table.append(row)
        lines.append(f"| {n} | {v} | {n * v * 2 / 2**20:.0f} | {total / 2**20:.0f} | {total / floor:.5f} "
                     f"| {row['h100_ms']:.3f} | {row['h200_ms']:.3f} |")
    summary = {"passes": units, "side_bytes_per_token": side, "sass_agrees": agree,
               "kernels": len(rows), "sass_available": all("sass" in r for r in rows), "table": table}
    return "\n".join(lines) + "\n", summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.traffic", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "traffic.md"))
    args = parser.parse_args(argv)
    import triton
    from dgpo_ops.kernels.logprob_entropy import logprob_entropy_fwd_kernel

    if not isinstance(logprob_entropy_fwd_kernel, triton.JITFunction):
        sys.exit("bench.traffic compiles real kernels: unset TRITON_INTERPRET")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    rows = analyse()
    text, summary = render(rows)
    # The summary rides along as a comment, for `python -m bench.report --no-traffic`.
    Path(args.out).write_text(text + f"\n<!-- traffic-summary {json.dumps({k: v for k, v in summary.items() if k != 'table'})} -->\n")
    print(text)
    print(json.dumps(summary))
    return 0 if summary["sass_agrees"] or not summary["sass_available"] else 1


if __name__ == "__main__":
    sys.exit(main())
