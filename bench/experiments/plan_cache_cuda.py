"""The logits op's plan cache on CUDA, where Triton compiles and binds every launch (the CPU tests run the
interpreter): the cached call, its replayed launches and the uncached call give the same bits, deferred validation
still names a bad input of a cached call, and the synchronised time per call with and without the cache.

    TRITON_INTERPRET=0 python bench/experiments/plan_cache_cuda.py [--out FILE.json]

Per case: the first call of a signature (its template made, its launches recorded), a second (replayed), a third
with other logits of the same signature, each compared bit for bit (loss, gradient, log-probs, entropies, metrics)
with the call planned without the cache. Then the median of 50 synchronised forward + backward calls at N = 8192,
V = 32,000 bf16, where the call is host-bound, with the cache and without it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import dgpo_ops
import dgpo_ops.ops.logits as logits_op
from dgpo_ops.ops.plan_cache import LOGITS_PLANS

DEV = "cuda"
CASES = {  # name: (inputs' shape, dtype, strided logits), options
    "dgpo bf16 8x1024x151936": ((8, 1024, 151936), torch.bfloat16, False, {}),
    "grpo fp32 2x100x50257 temperature": ((2, 100, 50257), torch.float32, False, dict(method="grpo", temperature=0.7)),
    "dgpo bf16 strided logits": ((2, 64, 32000), torch.bfloat16, True, {}),
    "dgpo kl, rollout weights, entropy": ((3, 50, 32000), torch.bfloat16, False, dict(beta=0.04, entropy_coef=0.01)),
    "cispo fp16 seq_mean_token_mean": ((4, 77, 32000), torch.float16, False,
                                       dict(method="cispo", aggregation="seq_mean_token_mean")),
}


def make_inputs(shape, dtype, strided=False, seed=0, kl=False) -> dict:
    B, T, V = shape
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = (torch.randn(B, T, V, device=DEV, generator=g) * 2).to(dtype)
    if strided:
        logits = logits.transpose(1, 2).contiguous().transpose(1, 2)
    target = torch.randint(0, V, (B, T), device=DEV, generator=g)
    target[0, -1] = -100
    inputs = dict(logits=logits.requires_grad_(True), target_ids=target, advantages=torch.randn(B, device=DEV,
                  generator=g), mask=torch.rand(B, T, device=DEV, generator=g) > 0.1,
                  old_logps=-torch.rand(B, T, device=DEV, generator=g) * 3)
    if kl:
        inputs.update(ref_logps=inputs["old_logps"] - 0.1,
                      rollout_weights=torch.rand(B, T, device=DEV, generator=g) + 0.5)
    return inputs


def call(inputs: dict, options: dict) -> list[torch.Tensor]:
    inputs["logits"].grad = None
    out = dgpo_ops.fused_dgpo_loss(**inputs, **options)
    out.loss.backward()
    torch.cuda.synchronize()
    return [out.loss.detach().clone(), inputs["logits"].grad.clone(), out.logps.clone(), out.entropy.clone(),
            out.metrics.as_tensor().clone()]


def uncached(fn):
    """``fn()`` with every call planned from scratch (no signature, so no template and no replay)."""
    signature = logits_op.input_signature
    logits_op.input_signature = lambda *args: None
    try:
        return fn()
    finally:
        logits_op.input_signature = signature


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def same(got: list, want: list) -> bool:
    return all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True))


def bitwise_cases() -> list[dict]:
    rows = []
    for name, (shape, dtype, strided, options) in CASES.items():
        inputs = make_inputs(shape, dtype, strided, kl="beta" in options)
        other = dict(inputs, logits=(inputs["logits"].detach() * 1.3).requires_grad_(True))
        LOGITS_PLANS.clear()
        first, second, third = call(inputs, options), call(inputs, options), call(other, options)
        template = next(iter(LOGITS_PLANS._templates.values()))
        bound = [launch.replay is not None for launch in (template.kernels.forward, template.kernels.prologue,
                                                          template.kernels.backward)]
        plain, plain_other = uncached(lambda: (call(inputs, options), call(other, options)))
        rows.append(dict(case=name, hits=LOGITS_PLANS.hits, misses=LOGITS_PLANS.misses, launches_bound=bound,
                         recorded_call_equal=same(first, plain), replayed_call_equal=same(second, plain),
                         other_logits_equal=same(third, plain_other), loss=float(first[0])))
        print(rows[-1], flush=True)
    return rows


def deferred_error_of_a_cached_call() -> dict:
    inputs = make_inputs((2, 16, 1000), torch.bfloat16, seed=5)
    call(inputs, {})
    bad = dict(inputs, target_ids=inputs["target_ids"].clone())
    bad["target_ids"][1, 3] = 5000
    out = dgpo_ops.fused_dgpo_loss(**bad)
    try:
        dgpo_ops.raise_deferred_errors()
        raised = None
    except ValueError as error:
        raised = str(error)
    return dict(nan_loss=bool(torch.isnan(out.loss)), raised=raised, hits=LOGITS_PLANS.hits)


def synchronised_ms(calls: int = 50) -> dict:
    inputs = make_inputs((8, 1024, 32000), torch.bfloat16, seed=6)

    def median():
        times = []
        for _ in range(calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            inputs["logits"].grad = None
            dgpo_ops.fused_dgpo_loss(**inputs).loss.backward()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[calls // 2]

    median()  # compile, fill the caches
    return dict(cached=median(), uncached=uncached(median), cached_again=median())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="plan_cache_cuda.json")
    args = parser.parse_args(argv)
    from dgpo_ops.trainer.app.environment import describe

    results = dict(env=describe(torch.device(DEV)), bitwise=bitwise_cases(),
                   deferred=deferred_error_of_a_cached_call(), sync_ms_N8192_V32000=synchronised_ms())
    print(results["deferred"], results["sync_ms_N8192_V32000"], flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0 if all(row["recorded_call_equal"] and row["replayed_call_equal"] and row["other_logits_equal"]
                    for row in results["bitwise"]) and results["deferred"]["raised"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
