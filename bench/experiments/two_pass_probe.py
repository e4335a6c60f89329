"""GPU probe: can a row split across co-resident programs beat three passes over the logits?

    python bench/experiments/two_pass_probe.py [--out DIR] [--quick]

Standalone (torch + triton only): bare kernels, no method epilogue, bf16 logits, N=8192 rows,
gradient g (onehot - p) in bf16, as the first H100 session's bare-kernel experiments (csrc_notes.md's
GPU run log, run 1). It times

* copy: a device-to-device copy (the bandwidth every floor below is taken at);
* 3pass: a log-sum-exp kernel, then a gradient kernel with one exp per element and 1 - p of the
  target once per row (the design of dgpo-ops' row kernels);
* coop: one launch in which SPLIT programs share each row, each holding its CHUNK of the row in
  registers; they exchange (max, sum-exp, target logit) through global memory and an arrival
  counter per row, then write the gradient from registers (one read, one write per element).
  The grid is at most what is resident at once, so every program of a row runs concurrently; the
  wait is bounded (a program that waits too long writes NaN and counts a timeout) so a wrong
  occupancy estimate shows up as NaN, never as a hang;
* gemm: the fused-linear GEMMs (logits tile with an fp32 output, dH, dW) at the fused linear's
  sizes (N = 8192, V = 151,936, H = 1,536 and 4,096), per token chunk size.

Every variant's gradient is checked against torch before it is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

SPIN_LIMIT = 1 << 22


@triton.jit
def lse_kernel(x_ptr, row_max_ptr, log_norm_ptr, vocab, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m = -float("inf")
    s = 0.0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_row + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
        m = new_m
    tl.store(row_max_ptr + row, m)
    tl.store(log_norm_ptr + row, tl.log(s))


@triton.jit
def grad_kernel(x_ptr, grad_ptr, target_ptr, coef_ptr, row_max_ptr, log_norm_ptr, vocab, stride_row,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    g = tl.load(coef_ptr + row)
    shift = tl.load(row_max_ptr + row)
    log_norm = tl.load(log_norm_ptr + row)
    x_t = tl.load(x_ptr + row * stride_row + target).to(tl.float32)
    logp_t = (x_t - shift) - log_norm
    one_minus_p_t = -(tl.exp(logp_t) - 1.0)  # the probe does not need expm1's digits
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_row + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32)
        p = tl.exp((x - shift) - log_norm)
        grad = tl.where(offs == target, g * one_minus_p_t, -g * p)
        tl.store(grad_ptr + row * stride_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=offs < vocab)


@triton.jit
def coop_kernel(x_ptr, grad_ptr, target_ptr, coef_ptr, partial_ptr, arrive_ptr, timeout_ptr, n_rows, vocab,
                stride_row, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, CHUNK: tl.constexpr,
                SPIN: tl.constexpr):
    pid = tl.program_id(0)
    part = pid % SPLIT
    n_groups = tl.num_programs(0) // SPLIT
    offs = part * CHUNK + tl.arange(0, CHUNK)
    inside = offs < vocab
    parts = tl.arange(0, SPLIT_P2)
    for row in range(pid // SPLIT, n_rows, n_groups):
        row64 = (pid * 0 + row).to(tl.int64)  # the interpreter hands range() values over as Python ints
        x = tl.load(x_ptr + row64 * stride_row + offs, mask=inside, other=-float("inf")).to(tl.float32)
        target = tl.load(target_ptr + row64)
        m = tl.max(x, 0)
        shift = tl.where(m == -float("inf"), 0.0, m)
        s = tl.sum(tl.exp(x - shift), 0)
        x_t = tl.sum(tl.where(offs == target, x, 0.0), 0)
        slot = partial_ptr + (row64 * SPLIT + part) * 3
        tl.store(slot, m)
        tl.store(slot + 1, s)
        tl.store(slot + 2, x_t)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrive_ptr + row64, 1, sem="acq_rel") + 1
        spins = 0
        while (arrived < SPLIT) & (spins < SPIN):
            arrived = tl.atomic_add(arrive_ptr + row64, 0, sem="acquire")
            spins += 1
        tl.debug_barrier()
        base = partial_ptr + (row64 * SPLIT + parts) * 3
        pm = tl.load(base, mask=parts < SPLIT, other=-float("inf"), cache_modifier=".cg")
        ps = tl.load(base + 1, mask=parts < SPLIT, other=0.0, cache_modifier=".cg")
        pxt = tl.load(base + 2, mask=parts < SPLIT, other=0.0, cache_modifier=".cg")
        big_m = tl.max(pm, 0)
        total = tl.sum(tl.where(pm == -float("inf"), 0.0, ps * tl.exp(pm - big_m)), 0)
        log_norm = tl.log(total)
        x_target = tl.sum(tl.where(parts == target // CHUNK, pxt, 0.0), 0)
        logp_t = (x_target - big_m) - log_norm
        g = tl.load(coef_ptr + row64)
        p = tl.exp((x - big_m) - log_norm)
        grad = tl.where(offs == target, -g * (tl.exp(logp_t) - 1.0), -g * p)
        timed_out = arrived < SPLIT
        grad = tl.where(timed_out, float("nan"), grad)
        tl.store(grad_ptr + row64 * stride_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=inside)
        if timed_out:
            tl.atomic_add(timeout_ptr, 1)


@triton.jit
def coop_prefetch_kernel(x_ptr, grad_ptr, target_ptr, coef_ptr, partial_ptr, arrive_ptr, timeout_ptr, n_rows, vocab,
                         stride_row, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, CHUNK: tl.constexpr,
                         SPIN: tl.constexpr):
    """coop_kernel with the next row's chunk loaded before the wait, so the memory system stays busy
    while a row's programs exchange their partials (twice the registers for the row data)."""
    pid = tl.program_id(0)
    part = pid % SPLIT
    n_groups = tl.num_programs(0) // SPLIT
    offs = part * CHUNK + tl.arange(0, CHUNK)
    inside = offs < vocab
    parts = tl.arange(0, SPLIT_P2)
    # Rows past the end are clamped to the last one: a redundant load, never an out-of-bounds one.
    first = tl.minimum(pid * 0 + pid // SPLIT, n_rows - 1).to(tl.int64)
    x_next = tl.load(x_ptr + first * stride_row + offs, mask=inside, other=-float("inf"))
    for row in range(pid // SPLIT, n_rows, n_groups):
        row64 = (pid * 0 + row).to(tl.int64)
        x = x_next.to(tl.float32)
        target = tl.load(target_ptr + row64)
        m = tl.max(x, 0)
        shift = tl.where(m == -float("inf"), 0.0, m)
        s = tl.sum(tl.exp(x - shift), 0)
        x_t = tl.sum(tl.where(offs == target, x, 0.0), 0)
        slot = partial_ptr + (row64 * SPLIT + part) * 3
        tl.store(slot, m)
        tl.store(slot + 1, s)
        tl.store(slot + 2, x_t)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrive_ptr + row64, 1, sem="acq_rel") + 1
        following = tl.minimum(row64 + n_groups, n_rows - 1)
        x_next = tl.load(x_ptr + following * stride_row + offs, mask=inside, other=-float("inf"))
        spins = 0
        while (arrived < SPLIT) & (spins < SPIN):
            arrived = tl.atomic_add(arrive_ptr + row64, 0, sem="acquire")
            spins += 1
        tl.debug_barrier()
        base = partial_ptr + (row64 * SPLIT + parts) * 3
        pm = tl.load(base, mask=parts < SPLIT, other=-float("inf"), cache_modifier=".cg")
        ps = tl.load(base + 1, mask=parts < SPLIT, other=0.0, cache_modifier=".cg")
        pxt = tl.load(base + 2, mask=parts < SPLIT, other=0.0, cache_modifier=".cg")
        big_m = tl.max(pm, 0)
        total = tl.sum(tl.where(pm == -float("inf"), 0.0, ps * tl.exp(pm - big_m)), 0)
        log_norm = tl.log(total)
        x_target = tl.sum(tl.where(parts == target // CHUNK, pxt, 0.0), 0)
        logp_t = (x_target - big_m) - log_norm
        g = tl.load(coef_ptr + row64)
        p = tl.exp((x - big_m) - log_norm)
        grad = tl.where(offs == target, -g * (tl.exp(logp_t) - 1.0), -g * p)
        timed_out = arrived < SPLIT
        grad = tl.where(timed_out, float("nan"), grad)
        tl.store(grad_ptr + row64 * stride_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=inside)
        if timed_out:
            tl.atomic_add(timeout_ptr, 1)


def resident_programs(compiled, num_warps: int, device) -> int:
    """CTAs per SM from registers, shared memory and warps (H100: 64K registers, 228 KB shared)."""
    compiled._init_handles()
    props = torch.cuda.get_device_properties(device)
    regs = max(compiled.n_regs, 1)
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * num_warps)
    shared = compiled.metadata.shared
    by_shared = (props.shared_memory_per_multiprocessor // (shared + 1024)) if shared else 32
    by_warps = 64 // num_warps
    per_sm = max(0, min(by_regs, by_shared, by_warps, 32))
    return per_sm, props.multi_processor_count, dict(n_regs=compiled.n_regs, n_spills=compiled.n_spills,
                                                     shared=shared)


def reference_grad(x, target, coef):
    p = torch.softmax(x.float(), -1)
    onehot = torch.zeros_like(p).scatter_(1, target[:, None], 1.0)
    return (coef[:, None] * (onehot - p)).to(x.dtype)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def probe_rows(V, N, results, quick):
    dev = "cuda"
    torch.manual_seed(V)
    x = (torch.randn(N, V, device=dev) * 2).to(torch.bfloat16)
    target = torch.randint(0, V, (N,), device=dev)
    coef = torch.randn(N, device=dev)
    grad = torch.empty_like(x)
    want = reference_grad(x[:256], target[:256], coef[:256])
    nbytes = x.numel() * x.element_size()
    copy_ms = do_bench(lambda: grad.copy_(x), return_mode="median")
    bw = 2 * nbytes / copy_ms / 1e6  # GB/s, read + write
    entry = {"V": V, "N": N, "copy_ms": copy_ms, "copy_GBps": bw,
             "floor_3pass_ms": 3 * nbytes / bw / 1e6, "floor_2pass_ms": 2 * nbytes / bw / 1e6, "variants": []}
    row_max = torch.empty(N, device=dev)
    log_norm = torch.empty(N, device=dev)
    for block, warps, stages in ([(4096, 4, 3)] if quick else [(4096, 4, 3), (4096, 8, 1), (2048, 4, 3), (8192, 8, 3)]):
        def three_pass():
            lse_kernel[(N,)](x, row_max, log_norm, V, x.stride(0), BLOCK=block, num_warps=warps, num_stages=stages)
            grad_kernel[(N,)](x, grad, target, coef, row_max, log_norm, V, x.stride(0), BLOCK=block,
                              num_warps=warps, num_stages=stages)
        three_pass()
        err = rel_err(grad[:256], want)
        ms = do_bench(three_pass, return_mode="median")
        lse_ms = do_bench(lambda: lse_kernel[(N,)](x, row_max, log_norm, V, x.stride(0), BLOCK=block,
                                                   num_warps=warps, num_stages=stages), return_mode="median")
        entry["variants"].append(dict(kind="3pass", block=block, warps=warps, stages=stages, ms=ms, lse_ms=lse_ms,
                                      grad_ms=ms - lse_ms, rel_err=err))
        print(f"V={V} 3pass block={block} warps={warps} stages={stages}: {ms:.3f} ms (lse {lse_ms:.3f}) err {err:.1e}",
              flush=True)
    chunks = {32000: [4096, 8192, 16384], 151936: [8192, 16384, 32768], 262144: [8192, 16384, 32768]}[V]
    partial = torch.empty(N * 64 * 3, device=dev)
    arrive = torch.zeros(N, dtype=torch.int32, device=dev)
    timeouts = torch.zeros(1, dtype=torch.int32, device=dev)
    variants = [(coop_kernel, chunk, warps) for chunk in chunks for warps in (4, 8, 16)]
    variants += [(coop_prefetch_kernel, chunk, warps) for chunk in (4096, 8192) for warps in (4, 8)]
    if quick:
        variants = [v for v in variants if v[0] is coop_prefetch_kernel]
    for kernel, chunk, warps in variants:
        split = triton.cdiv(V, chunk)
        split_p2 = triton.next_power_of_2(split)
        kind = "coop" if kernel is coop_kernel else "coop_prefetch"
        if chunk // (32 * warps) > 128:  # more than 128 values per thread: spills for sure
            continue
        args = (x, grad, target, coef, partial, arrive, timeouts, N, V, x.stride(0))
        meta = dict(SPLIT=split, SPLIT_P2=split_p2, CHUNK=chunk, SPIN=SPIN_LIMIT, num_warps=warps, num_stages=1)
        try:
            compiled = kernel.warmup(*args, grid=(1,), **meta)
            per_sm, sms, resources = resident_programs(compiled, warps, dev)
        except Exception as error:  # noqa: BLE001 - report and go on
            entry["variants"].append(dict(kind=kind, chunk=chunk, split=split, warps=warps,
                                          error=f"{type(error).__name__}: {error}"[:300]))
            continue
        groups = (per_sm * sms) // split
        if groups == 0:
            entry["variants"].append(dict(kind=kind, chunk=chunk, split=split, warps=warps, resident=0, **resources))
            continue
        grid = (min(groups, N) * split,)

        def coop():
            arrive.zero_()
            kernel[grid](*args, **meta)

        timeouts.zero_()
        grad.fill_(float("nan"))
        coop()
        torch.cuda.synchronize()
        n_timeouts = int(timeouts.item())
        err = rel_err(grad[:256], want)
        finite = bool(torch.isfinite(grad).all().item())
        ms = do_bench(coop, return_mode="median") if n_timeouts == 0 and finite else None
        zero_ms = do_bench(lambda: arrive.zero_(), return_mode="median")
        entry["variants"].append(dict(kind=kind, chunk=chunk, split=split, warps=warps, per_sm=per_sm, grid=grid[0],
                                      rows_in_flight=grid[0] // split, ms=ms, memset_ms=zero_ms, rel_err=err,
                                      timeouts=n_timeouts, finite=finite, **resources))
        print(f"V={V} {kind} chunk={chunk} split={split} warps={warps} regs={resources['n_regs']} "
              f"spills={resources['n_spills']} per_sm={per_sm} grid={grid[0]}: "
              f"{'%.3f ms' % ms if ms else 'n/a'} err {err:.1e} timeouts {n_timeouts}", flush=True)
    results["rows"].append(entry)


def probe_gemm(results, quick):
    dev = "cuda"
    N, V = 8192, 151936
    for H in (1536, 4096):
        torch.manual_seed(H)
        hidden = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
        weight = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.02
        entry = {"H": H, "N": N, "V": V, "chunks": []}
        full_bf16 = do_bench(lambda: torch.mm(hidden, weight.t()), return_mode="median")
        entry["logits_gemm_bf16_out_ms"] = full_bf16
        for rows in ((2048,) if quick else (1024, 2048, 4096, 8192)):
            tile = torch.empty(rows, V, device=dev, dtype=torch.float32)
            gtile = torch.empty(rows, V, device=dev, dtype=torch.bfloat16).normal_()
            gh = torch.empty(rows, H, device=dev, dtype=torch.float32)
            gw = torch.zeros(V, H, device=dev, dtype=torch.float32)

            def logits():
                for start in range(0, N, rows):
                    torch.mm(hidden[start:start + rows], weight.t(), out_dtype=torch.float32, out=tile)

            def logits_bf16():
                for start in range(0, N, rows):
                    torch.mm(hidden[start:start + rows], weight.t())

            def grad_hidden():
                for start in range(0, N, rows):
                    torch.mm(gtile, weight, out_dtype=torch.float32, out=gh)

            def grad_weight():
                for start in range(0, N, rows):
                    torch.addmm(gw, gtile.t(), hidden[start:start + rows], out_dtype=torch.float32, out=gw)

            timings = {name: do_bench(fn, return_mode="median") for name, fn in
                       (("logits_fp32_out", logits), ("logits_bf16_out", logits_bf16), ("grad_hidden", grad_hidden),
                        ("grad_weight", grad_weight))}
            timings["three_gemms_ms"] = timings["logits_fp32_out"] + timings["grad_hidden"] + timings["grad_weight"]
            entry["chunks"].append({"rows": rows, **timings})
            print(f"H={H} rows={rows}: " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()), flush=True)
            del tile, gtile, gh, gw
        results["gemm"].append(entry)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-gemm", action="store_true")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    results = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
               "triton": triton.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "rows": [], "gemm": []}
    for V in (32000, 151936, 262144):
        probe_rows(V, 8192, results, args.quick)
        torch.cuda.empty_cache()
    if not args.no_gemm:
        probe_gemm(results, args.quick)
    with open(os.path.join(args.out, "two_pass_probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\nV        floor3  floor2  best-3pass  best-coop (chunk/split/warps)")
    for entry in results["rows"]:
        three = min((v for v in entry["variants"] if v["kind"] == "3pass"), key=lambda v: v["ms"])
        coops = [v for v in entry["variants"] if v["kind"].startswith("coop") and v.get("ms")]
        best = min(coops, key=lambda v: v["ms"]) if coops else None
        coop_text = f"{best['ms']:.3f} ({best['kind']} {best['chunk']}/{best['split']}/{best['warps']})" if best else "none ran"
        print(f"{entry['V']:<8} {entry['floor_3pass_ms']:.3f}   {entry['floor_2pass_ms']:.3f}   {three['ms']:.3f}       {coop_text}")


if __name__ == "__main__":
    main()
