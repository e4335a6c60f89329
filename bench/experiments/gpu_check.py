"""One GPU session's checks of the sync-free pipeline, printed as a short table.

    python bench/experiments/gpu_check.py [--out DIR] [--skip-linear] [--timing-only] [--vocab V ...] [--tokens N]
                                          [--device cpu]

* correctness on CUDA: every method variant of the tests, fp32 and bf16 logits, against an fp64
  reference; GSPO, KL + entropy + temperature, inplace, flat and strided logits, a large vocabulary;
* no host synchronisation: forward + backward of both fused ops under
  ``torch.cuda.set_sync_debug_mode("error")`` (a synchronising CUDA call raises), and the number
  of CUDA kernels one forward + backward launches (torch.profiler);
* deferred validation on CUDA: a bad target id gives a NaN loss at once and a ValueError naming
  ``target_ids`` from ``raise_deferred_errors()``;
* timings at N = 8192 bf16 logits (``--tokens``, ``--vocab``: V = 32,000, 151,936 and 262,144 by default): ours,
  Liger's triton_grpo_loss and TRL's kernel + loss, forward + backward and forward only, each as the median ms
  of ``triton.testing.do_bench`` (calls back to back), the wall time per call of a loop that synchronises once at
  its end, and the median of 50 calls each followed by a synchronisation (``sync_ms``; every call's time in
  ``sync_calls_ms``); one such call of ours and of Liger's under ``torch.profiler`` (``call_traces``: each event's
  host and device interval, the host time before the first kernel, the device's idle time between kernels,
  ``--trace-vocab``); the fused-linear op against TRL's
  ChunkedLogProbFunction + loss, under bf16 autocast with fp32 parameters and with bf16 parameters,
  with peak memory.

Writes ``gpu_check.json`` under ``--out``. ``--device cpu`` runs the timing section on the CPU at whatever size
is asked (the torch twins; Liger's and TRL's Triton kernels record why they did not run): the dry run of
``gpu_session.sh``, so that the script breaks in CI rather than on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from helpers import METHOD_VARIANTS, logits_batch, variant_id  # noqa: E402

import dgpo_ops  # noqa: E402

DEV = "cuda"
RESULTS: dict = {}


def section(name):
    def wrap(fn):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                RESULTS[name] = fn(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - a failed section is reported, the others still run
                RESULTS[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-3000:]}
                print(f"[{name}] FAILED: {type(error).__name__}: {error}", flush=True)
            RESULTS.setdefault("section_seconds", {})[name] = time.perf_counter() - started
        return run
    return wrap


def to_device(inputs):
    return {k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in inputs.items()}


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@section("correctness")
def correctness():
    worst = {}
    bundles = {
        "plain": {},
        "kl_entropy_temperature": dict(beta=0.05, entropy_coef=0.01, temperature=0.7),
        "gspo": dict(importance_sampling_level="sequence", aggregation="seq_mean_token_mean", entropy_coef=0.02),
    }
    for dtype in (torch.float32, torch.bfloat16):
        for variant in METHOD_VARIANTS:
            name, params = variant
            for bundle, options in bundles.items():
                inputs = logits_batch(3, 6, 300, seed=1, dtype=dtype)
                logits = inputs.pop("logits")
                ref_logits = logits.double().requires_grad_(True)
                ref = dgpo_ops.reference_loss(ref_logits, **inputs, method=name, **params, **options)
                ref.loss.backward()
                x = logits.to(DEV).requires_grad_(True)
                out = dgpo_ops.fused_dgpo_loss(x, **to_device(inputs), method=name, **params, **options)
                out.loss.backward()
                key = f"{variant_id(variant)}/{bundle}/{str(dtype)[6:]}"
                worst[key] = dict(loss=abs(float(out.loss) - float(ref.loss)),
                                  logps=float((out.logps.cpu() - ref.logps).abs().max()),
                                  grad=rel(x.grad.cpu(), ref_logits.grad))
    # large vocabulary, bf16, inplace, strided and flat logits
    extra = {}
    inputs = logits_batch(2, 64, 151936, seed=2, dtype=torch.bfloat16)
    logits = inputs.pop("logits")
    ref_logits = logits.double().requires_grad_(True)
    ref = dgpo_ops.reference_loss(ref_logits, **inputs)
    ref.loss.backward()
    x = logits.to(DEV).requires_grad_(True)
    produced = x * 1.0
    out = dgpo_ops.fused_dgpo_loss(produced, **to_device(inputs), inplace=True)
    (grad,) = torch.autograd.grad(out.loss, produced)
    extra["V151936_bf16_inplace"] = dict(loss=abs(float(out.loss) - float(ref.loss)), grad=rel(grad.cpu(), ref_logits.grad))
    base = torch.randn(2, 7, 50, device=DEV).requires_grad_(True)
    small = logits_batch(2, 6, 50, seed=3)
    small.pop("logits")
    strided = base[:, :-1]
    ref_s = dgpo_ops.reference_loss(strided.detach().cpu().double(), **small)
    out_s = dgpo_ops.fused_dgpo_loss(strided, **to_device(small))
    extra["strided"] = abs(float(out_s.loss) - float(ref_s.loss))
    flat = {k: v.reshape(12, *v.shape[2:]) for k, v in logits_batch(2, 6, 50, seed=4, per_token_adv=True).items()}
    ref_f = dgpo_ops.reference_loss(**flat)
    out_f = dgpo_ops.fused_dgpo_loss(**to_device(flat))
    extra["flat"] = abs(float(out_f.loss) - float(ref_f.loss))
    largest = {metric: max(worst.items(), key=lambda kv: kv[1][metric]) for metric in ("loss", "logps", "grad")}
    print("[correctness] cases:", len(worst), "largest:",
          {m: (k, round(v[m], 9)) for m, (k, v) in largest.items()}, "extra:", extra, flush=True)
    return {"cases": worst, "extra": extra}


def logits_inputs(N, V, dtype=torch.bfloat16, seed=0):
    B = max(1, N // 1024)
    T = N // B
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = (torch.randn(B, T, V, device=DEV, generator=g, dtype=torch.float32) * 2).to(dtype).requires_grad_(True)
    target = torch.randint(0, V, (B, T), device=DEV, generator=g)
    mask = torch.rand(B, T, device=DEV, generator=g) > 0.12
    old = -torch.rand(B, T, device=DEV, generator=g) * 5
    adv = torch.randn(B, device=DEV, generator=g)
    return logits, target, mask, old, adv


@section("no_sync")
def no_sync():
    out = {}
    logits, target, mask, old, adv = logits_inputs(2048, 32000)
    normalizer = mask.sum().float()

    def logits_step(**kwargs):
        res = dgpo_ops.fused_dgpo_loss(logits, target, adv, mask.int(), old, loss_normalizer=normalizer, **kwargs)
        res.loss.backward()
        return res

    logits_step()  # compile outside the check
    logits_step(importance_sampling_level="sequence", aggregation="seq_mean_token_mean")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, kwargs in (("token", {}), ("token_entropy_kl", dict(entropy_coef=0.01)),
                             ("sequence", dict(importance_sampling_level="sequence", aggregation="seq_mean_token_mean"))):
            logits.grad = None
            logits_step(**kwargs)
            out[name] = "no sync"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # kernel launches of one forward + backward
    logits.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        logits_step()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    out["cuda_kernels_per_fwd_bwd"] = len(kernels)
    out["kernel_names"] = sorted(set(kernels))
    # fused linear under autocast
    hidden = torch.randn(2, 512, 256, device=DEV, requires_grad=True)
    weight = (torch.randn(32000, 256, device=DEV) * 0.02).requires_grad_(True)
    t2 = torch.randint(0, 32000, (2, 512), device=DEV)

    def linear_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            res = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, t2, adv[:2], old_logps=old[:2, :512],
                                                  loss_normalizer=normalizer)
        res.loss.backward()

    linear_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        linear_step()
        out["linear_autocast"] = "no sync"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print("[no_sync]", {k: v for k, v in out.items() if k != "kernel_names"}, flush=True)
    return out


@section("deferred")
def deferred():
    out = {}
    logits, target, mask, old, adv = logits_inputs(1024, 1000)
    bad = target.clone()
    bad[0, 5] = 1000
    res = dgpo_ops.fused_dgpo_loss(logits, bad, adv, mask, old)
    out["loss_is_nan"] = bool(torch.isnan(res.loss).item())
    try:
        dgpo_ops.raise_deferred_errors()
        out["raised"] = None
    except ValueError as error:
        out["raised"] = str(error)
    nan_adv = adv.clone()
    nan_adv[0] = float("nan")
    dgpo_ops.fused_dgpo_loss(logits, target, nan_adv, mask, old)
    torch.cuda.synchronize()
    try:
        dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old)  # the next call raises the earlier error
        out["next_call_raised"] = None
    except ValueError as error:
        out["next_call_raised"] = str(error)
    print("[deferred]", out, flush=True)
    return out


def synchronize():
    if DEV == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn, iters=20):
    fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize()
    return (time.perf_counter() - start) / iters * 1e3


SYNC_CALLS = 50  # synchronised calls per timing on CUDA, each call's time kept


def sync_ms(fn, iters=SYNC_CALLS):
    """Calls each followed by a synchronisation (the host's time before the first launch counts): their median, and
    every call's time in milliseconds."""
    times = []
    for _ in range(iters):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2], times


def bench(fn):
    if DEV != "cuda":  # the dry run: one call of each kind, so that every code path runs
        median, calls = sync_ms(fn, iters=1)
        return {"do_bench_ms": None, "wall_ms": wall_ms(fn, iters=1), "sync_ms": median, "sync_calls_ms": calls}
    from triton.testing import do_bench

    median, calls = sync_ms(fn)
    return {"do_bench_ms": do_bench(fn, return_mode="median"), "wall_ms": wall_ms(fn), "sync_ms": median,
            "sync_calls_ms": calls}


def logits_steps(logits, target, mask, old, adv) -> dict:
    """impl -> a forward + backward (or forward only) of the logits op at these inputs, or the error that kept a
    competitor from running: ours (dgpo, grpo, dgpo forward only), Liger's triton_grpo_loss, TRL's kernel + loss."""
    V = logits.shape[-1]
    steps = {}
    for method in ("dgpo", "grpo"):
        def step(method=method):
            logits.grad = None
            dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old, method=method).loss.backward()

        steps[f"ours-{method}"] = step

    def forward_only():
        with torch.no_grad():
            dgpo_ops.fused_dgpo_loss(logits, target, adv, mask, old, method="dgpo")

    steps["ours-forward-no_grad"] = forward_only
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        padded = torch.zeros(logits.shape[0], logits.shape[1] + 1, V, dtype=logits.dtype, device=DEV)
        padded[:, :-1] = logits.detach()
        padded.requires_grad_(True)
        cmask = mask.int()

        def liger():
            padded.grad = None
            loss, _ = triton_grpo_loss(padded, old, None, target, adv, completion_mask=cmask, temperature=1.0,
                                       beta=0.0, eps_low=0.2, eps_high=0.2, inplace=False, loss_type="bnpo",
                                       reduce=True)
            loss.backward()

        steps["liger-grpo"] = liger
    except Exception as error:  # noqa: BLE001
        steps["liger-grpo"] = str(error)[:200]
    try:
        from trl.kernels import selective_log_softmax_and_entropy

        def trl_step():
            logits.grad = None
            logp, _ = selective_log_softmax_and_entropy(logits, target, 1.0, mask)
            ratio = torch.exp(logp - old)
            a = adv[:, None]
            per_token = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
            loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
            loss.backward()

        steps["trl-grpo"] = trl_step
    except Exception as error:  # noqa: BLE001
        steps["trl-grpo"] = str(error)[:200]
    return steps


@section("logits_timing")
def logits_timing(vocabularies=(32000, 151936, 262144), tokens=8192):
    rows = []
    for V in vocabularies:
        steps = logits_steps(*logits_inputs(tokens, V))
        for impl, step in steps.items():
            rows.append({"V": V, "impl": impl, **(bench(step) if callable(step) else {"error": step})})
            print("[logits]", {k: v for k, v in rows[-1].items() if k != "sync_calls_ms"}, flush=True)
        del steps
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


PROFILER_OWN_EVENTS = ("Activity Buffer Request",)  # the profiler's work, not the op's


@section("call_traces")
def call_traces(V=151936, tokens=8192, impls=("ours-dgpo", "ours-grpo", "liger-grpo")):
    """One synchronised forward + backward of each of ``impls`` under ``torch.profiler`` (after warm-up calls): every
    event with its host (CPU) and device interval, relative to the call's start, and the host time before the first
    device kernel and the device's idle time between kernels."""
    from torch.profiler import ProfilerActivity, profile

    steps = logits_steps(*logits_inputs(tokens, V))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    traces = {}
    for impl in impls:
        step = steps[impl]
        if not callable(step):
            traces[impl] = {"error": step}
            continue
        for _ in range(3):
            step()
        synchronize()
        # A first profiled call takes the profiler's own start-up (in run 21 a 2.1-2.3 ms "Activity Buffer
        # Request" before the op's first event, read as the op's host time): that one is thrown away.
        for _ in range(2):
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                step()
                synchronize()
                wall = (time.perf_counter() - start) * 1e3
        events = sorted((e for e in prof.events() if e.name not in PROFILER_OWN_EVENTS),
                        key=lambda e: e.time_range.start)
        origin = events[0].time_range.start if events else 0
        rows = [{"name": e.name[:80], "device": str(e.device_type).split(".")[-1],
                 "start_us": e.time_range.start - origin, "end_us": e.time_range.end - origin} for e in events]
        kernels = [r for r in rows if r["device"] == "CUDA"]
        idle = sum(max(0.0, b["start_us"] - a["end_us"]) for a, b in zip(kernels, kernels[1:]))
        traces[impl] = {"wall_ms": wall, "events": rows, "device_kernels": len(kernels),
                        "host_before_first_kernel_us": kernels[0]["start_us"] if kernels else None,
                        "device_idle_between_kernels_us": idle if kernels else None}
        print(f"[trace] {impl}: {wall:.3f} ms, {len(kernels)} kernels, host before the first "
              f"{traces[impl]['host_before_first_kernel_us']} us, idle between {idle:.0f} us", flush=True)
    return traces


def linear_inputs(H, N=8192, V=151936, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    hidden = (torch.randn(8, N // 8, H, device=DEV, generator=g) / H**0.5).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, device=DEV, generator=g) * 0.5).to(dtype).requires_grad_(True)
    target = torch.randint(0, V, (8, N // 8), device=DEV, generator=g)
    mask = torch.rand(8, N // 8, device=DEV, generator=g) > 0.12
    old = -torch.rand(8, N // 8, device=DEV, generator=g) * 12
    adv = torch.randn(8, device=DEV, generator=g)
    return hidden, weight, target, mask, old, adv


def measure_linear(step, hidden, weight):
    def run():
        hidden.grad = None
        weight.grad = None
        step()

    run()
    torch.cuda.synchronize()
    hidden.grad = None
    weight.grad = None
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(5):
        hidden.grad = None
        weight.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return {"ms_median": times[len(times) // 2], "ms_min": times[0], "peak_extra_gb": peak / 1e9}


@section("linear_timing")
def linear_timing():
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import utils as trl_utils

    chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 4096)
    rows = []
    for H in (1536, 4096):
        for params_dtype, autocast in ((torch.float32, True), (torch.bfloat16, False)):
            hidden, weight, target, mask, old, adv = linear_inputs(H, dtype=params_dtype)

            def ours():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, target, adv, mask, old, method="grpo")
                out.loss.backward()

            def trl():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    flat_target = target.reshape(-1)
                    logps = ChunkedLogProbFunction.apply(hidden.reshape(-1, H), weight, None, flat_target, 1.0, chunk,
                                                         None, 1.0, ("entropy",))[0].view(target.shape)
                    ratio = torch.exp(logps - old)
                    a = adv[:, None]
                    per_token = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
                    loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
                loss.backward()

            label = f"H={H} {'autocast-bf16 fp32-params' if autocast else 'bf16-params'}"
            for impl, fn in (("ours", ours), ("trl", trl)):
                try:
                    row = {"H": H, "setting": label, "impl": impl, **measure_linear(fn, hidden, weight)}
                except Exception as error:  # noqa: BLE001
                    row = {"H": H, "setting": label, "impl": impl, "error": f"{type(error).__name__}: {error}"[:300]}
                rows.append(row)
                print("[linear]", row, flush=True)
            del hidden, weight
            torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-linear", action="store_true")
    parser.add_argument("--timing-only", action="store_true", help="only the logits timings (and linear unless skipped)")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936, 262144], help="V of the logits timings")
    parser.add_argument("--tokens", type=int, default=8192, help="N of the logits timings")
    parser.add_argument("--trace-vocab", type=int, default=151936,
                        help="V of one profiled synchronised call of ours and Liger's (0: none)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: the timing section only, at the sizes asked (a dry run of the script)")
    args = parser.parse_args()

    global DEV
    DEV = args.device
    from dgpo_ops.trainer.app.environment import describe

    RESULTS["env"] = describe(torch.device(DEV), packages=("trl", "liger-kernel"))
    RESULTS["arguments"] = vars(args)
    if DEV != "cuda" and not (args.timing_only and args.skip_linear):
        parser.error("--device cpu runs the logits timings only: add --timing-only --skip-linear")
    if not args.timing_only:
        correctness()
        no_sync()
        deferred()
    logits_timing(tuple(args.vocab), args.tokens)
    if args.trace_vocab:
        call_traces(args.trace_vocab, args.tokens)
    if not args.skip_linear:
        linear_timing()
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    print("\nsummary")
    for row in RESULTS.get("logits_timing", []) if isinstance(RESULTS.get("logits_timing"), list) else []:
        if "error" not in row:
            back_to_back = "-" if row["do_bench_ms"] is None else f"{row['do_bench_ms']:.3f}"
            print(f"  V={row['V']:<7} {row['impl']:<22} do_bench {back_to_back} ms  wall {row['wall_ms']:.3f} ms  "
                  f"synchronised {row['sync_ms']:.3f} ms")
    for row in RESULTS.get("linear_timing", []) if isinstance(RESULTS.get("linear_timing"), list) else []:
        if "error" not in row:
            print(f"  {row['setting']:<34} {row['impl']:<5} {row['ms_median']:.1f} ms  +{row['peak_extra_gb']:.2f} GB")
    print("sections:", {k: ("FAILED" if isinstance(v, dict) and "error" in v else "ok") for k, v in RESULTS.items()
                         if k not in ("env", "arguments", "section_seconds")})


if __name__ == "__main__":
    main()
