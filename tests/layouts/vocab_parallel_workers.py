"""What each process of tests/layouts/test_vocab_parallel.py runs: the same tokens on every process, this
process's equal share of the vocabulary columns, ``fused_dgpo_loss(..., vocab_parallel_group=...)``, on both
kernel sets (``BACKENDS``: the Triton kernels in the interpreter, and their torch twins)."""

from __future__ import annotations

import os
import traceback

import interpreted_triton
import torch
from helpers import ROUTE_VARIANTS, for_method, logits_batch, value_error_message

from dgpo_ops.corrections import ArealCorrection, TrlCorrection, VerlCorrection

if os.environ.get("TRITON_INTERPRET") == "1":  # the world's processes run the Triton kernels interpreted too
    interpreted_triton.patch_the_language_once_per_launch()

VOCAB = 60  # divisible by 2 and 3 processes
BACKENDS = ("torch", "triton")
# The kernel sets each world runs. The Triton kernels see the split only as their shard's offset and the
# vocabulary's total (any rank but the first of two has both nonzero); what a third rank adds is in the
# merge of the row partials, torch code the same for both kernel sets: three processes running the
# interpreted kernels, the costliest part of the module, would check nothing more.
WORLD_BACKENDS = {2: BACKENDS, 3: ("torch",)}
OPTION_SETS = {
    "plain": dict(),
    "kl_entropy_temperature_nll": dict(aggregation="seq_mean_token_mean", beta=0.05, entropy_coef=0.01, temperature=0.7,
                                       positive_nll_coef=0.1),
}
EXTRA_JOBS = {  # name -> (method, params, options, per-token advantages, dtype, flat)
    "gspo": ("grpo", {}, dict(importance_sampling_level="sequence", aggregation="seq_mean_token_mean", beta=0.02),
             False, torch.float32, False),
    "seq_sum_norm_per_token_adv": ("dgpo", {}, dict(aggregation="seq_mean_token_sum_norm", loss_normalizer=5.0),
                                   True, torch.float32, False),
    "seq_sum_token_mean": ("cispo", {}, dict(aggregation="seq_sum_token_mean"), False, torch.float32, False),
    "flat_rollout_weights": ("dgpo", {}, dict(), True, torch.float32, True),
    "bf16": ("dgpo", {}, dict(entropy_coef=0.01), False, torch.bfloat16, False),
    # response 1's logits -inf beyond column 30: some processes hold only -inf there
    "minus_inf_columns": ("dgpo", {}, dict(entropy_coef=0.01), False, torch.float32, False),
    # the rollout-correction stage: computed from per-token inputs every process holds whole
    "verl_rollout_correction": ("grpo", {}, dict(rollout_correction=VerlCorrection(
        rollout_is="sequence", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")), False, torch.float32, False),
    "flat_trl_rollout_correction": ("dgpo", {}, dict(rollout_correction=TrlCorrection("token_mask", 0.5, 2.0)),
                                    True, torch.float32, True),
    # logits[:, :-1] of a longer sequence: not viewable as (N, V / P), read per response
    "strided": ("grpo", {}, dict(aggregation="seq_mean_token_mean"), False, torch.float32, False),
}


def jobs() -> dict:
    """name -> (method, params, options, per-token advantages, dtype, flat)"""
    every = {}
    for name, params in ROUTE_VARIANTS:  # the split reaches a method's math only through its route
        for option_name, options in OPTION_SETS.items():
            label = name + "".join(f"-{k}={v}" for k, v in params.items())
            every[f"{label}/{option_name}"] = (name, params, options, False, torch.float32, False)
    return {**every, **EXTRA_JOBS}


def inference_logps(old_logps: torch.Tensor) -> torch.Tensor:
    """An inference engine's log-probs, a nat or so from the trainer's."""
    drift = torch.randn(old_logps.shape, generator=torch.Generator().manual_seed(5))
    return (old_logps + drift).clamp(max=0.0)  # log-probs: <= 0


def inputs_of(job) -> tuple[dict, dict]:
    """(the whole-vocabulary inputs, the loss keywords) of a job, the same in every process."""
    method, params, options, per_token_adv, dtype, flat = job
    batch = logits_batch(3, 7, VOCAB, seed=11, dtype=dtype, per_token_adv=per_token_adv, ref_logps=True)
    if flat:
        batch = {name: value.reshape(-1, *value.shape[2:]) if value.dim() >= 2 else value
                 for name, value in batch.items()}
        batch["rollout_weights"] = torch.rand(batch["target_ids"].shape, generator=torch.Generator().manual_seed(3))
    if not options.get("beta"):
        batch.pop("ref_logps", None)
    if "rollout_correction" in options:
        batch.pop("rollout_weights", None)
        batch["rollout_logps"] = inference_logps(batch["old_logps"])
    if job is EXTRA_JOBS["minus_inf_columns"]:
        batch["logits"][1, :, 30:] = float("-inf")
        batch["target_ids"][1] = batch["target_ids"][1].remainder(30)
    if job is EXTRA_JOBS["strided"]:  # the same values, read through a view that skips a last position
        longer = torch.zeros(batch["logits"].shape[0], batch["logits"].shape[1] + 1, VOCAB)
        longer[:, :-1] = batch["logits"]
        batch["logits"] = longer[:, :-1]
    # scores for topr and the positive-example NLL (logits_batch's 3 responses)
    return batch, dict(method=method, **params, **for_method(method, options, responses=3))


HIDDEN = 12
LINEAR_JOBS = {  # name -> loss keywords; the weight split by rows, hidden states the same everywhere (float64)
    "linear": dict(method="dgpo"),
    "linear_softcap_kl_entropy_temperature": dict(method="dgpo", softcap=4.0, logit_scale=0.9, temperature=0.8,
                                                  beta=0.05, entropy_coef=0.01, aggregation="seq_mean_token_mean"),
    "linear_gspo": dict(method="grpo", importance_sampling_level="sequence", aggregation="seq_mean_token_mean"),
    "linear_dtensor": dict(method="cispo"),  # the weight a Shard(0) DTensor on a 1-D mesh
    "linear_packed": dict(method="dgpo", aggregation="seq_mean_token_mean"),  # and cu_seqlens
    # AReaL's decoupled PPO with M2PO, packed: the correction's sequence statistics per packed segment
    "linear_packed_areal": dict(method="grpo", dual_clip=3.0, rollout_correction=ArealCorrection(
        level="sequence", lower=0.5, upper=2.0, m2_threshold=0.5)),
}
PACKED_LENGTHS = [4, 7, 1, 9]


def linear_dtype(backend: str) -> torch.dtype:
    """float64 for the twins (nothing but summation order to tolerate); the Triton kernels take float32."""
    return torch.float64 if backend == "torch" else torch.float32


def linear_inputs(name: str, backend: str = "torch") -> tuple[dict, dict, dict]:
    """(hidden/weight/bias, loss inputs, keywords) of a linear job, the same in every process."""
    keywords = dict(LINEAR_JOBS[name], backend=backend)
    batch = logits_batch(3, 7, VOCAB, seed=13, ref_logps=True)
    batch.pop("logits")
    if not keywords.get("beta"):
        batch.pop("ref_logps", None)
    generator = torch.Generator().manual_seed(17)
    float64 = dict(generator=generator, dtype=linear_dtype(backend))
    tensors = dict(hidden=torch.randn(3, 7, HIDDEN, **float64), weight=torch.randn(VOCAB, HIDDEN, **float64) * 0.5,
                   bias=torch.randn(VOCAB, **float64))
    if "rollout_correction" in keywords:
        batch["rollout_logps"] = inference_logps(batch["old_logps"])
    if name.startswith("linear_packed"):  # 21 tokens in 4 packed sequences
        n = sum(PACKED_LENGTHS)
        tensors["hidden"] = tensors["hidden"].reshape(-1, HIDDEN)[:n]
        batch = {key: value.reshape(-1)[:n] for key, value in batch.items() if key != "advantages"}
        batch["advantages"] = torch.tensor([0.5, -1.0, 0.3, 1.2])
        keywords["cu_seqlens"] = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()])
    return tensors, batch, keywords


# Entropy accuracy against an exact answer: logits shifted by a large constant, and peaked rows (one logit far above
# the rest: the entropy is tiny but not 0); hidden states scaled up for linear_logprob_entropy.
ACCURACY_CASES = {"shift100": dict(shift=100.0), "shift500": dict(shift=500.0), "peaked25": dict(peak=25.0),
                  "peaked40": dict(peak=40.0)}


def accuracy_logits(case: str) -> torch.Tensor:
    spec = ACCURACY_CASES[case]
    logits = torch.randn(4, 6, VOCAB, generator=torch.Generator().manual_seed(21), dtype=torch.float64)
    if "peak" in spec:
        logits[..., 7] += spec["peak"]  # column 7: held by process 0 in every split
    return (logits + spec.get("shift", 0.0)).float()


def accuracy_targets() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(22))


def accuracy_hidden() -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden (24, HIDDEN) scaled by 30, weight (VOCAB, HIDDEN)): peaked rows from hidden states."""
    generator = torch.Generator().manual_seed(23)
    return torch.randn(24, HIDDEN, generator=generator) * 30, torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5


def exact_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy in float64 without cancellation for peaked rows: log1p(s) + sum e^(x - m) (m - x) / (1 + s),
    s the sum over everything but the max."""
    x = logits.double()
    m = x.amax(-1, keepdim=True)
    e = torch.exp(x - m)
    top = x == m
    rest = torch.where(top, 0.0, e).sum(-1) + top.sum(-1) - 1  # ties at the max count as rest
    return torch.log1p(rest) + (e * (m - x)).sum(-1) / (1 + rest)


DEFERRED_CASES = ("mask", "target", "advantages", "uneven")


def deferred_case(name: str, rank: int, world: int, group, backend: str) -> dict:
    """One bad input under deferred validation: whether the loss and gradient are NaN, and the error
    ``raise_deferred_errors()`` raises afterwards."""
    import dgpo_ops

    batch, _ = inputs_of(EXTRA_JOBS["seq_sum_norm_per_token_adv"])  # no ref_logps (no KL)
    logits = batch.pop("logits")
    batch["mask"] = batch["mask"].float()
    columns = columns_of(rank, world)
    if name == "mask":
        batch["mask"][1, 2] = 0.5
    elif name == "target":
        batch["target_ids"][0, 3] = VOCAB + 5
    elif name == "advantages":
        batch["advantages"][2, 1] = float("inf")
    elif name == "uneven":  # process 0 one column short
        columns = slice(columns.start, columns.stop - (1 if rank == 0 else 0))
    shard = logits[..., columns].clone().requires_grad_(True)
    dgpo_ops.raise_deferred_errors()
    out = dgpo_ops.fused_dgpo_loss(shard, **batch, aggregation="seq_mean_token_mean", validation="deferred",
                                   backend=backend, vocab_parallel_group=group)
    (grad,) = torch.autograd.grad(out.loss, [shard])
    return dict(loss=out.loss.detach(), grad_has_nan=bool(grad.isnan().any()),
                error=value_error_message(dgpo_ops.raise_deferred_errors))


def columns_of(rank: int, world: int) -> slice:
    share = VOCAB // world
    return slice(rank * share, (rank + 1) * share)


def vocab_parallel_worker(rank: int, world: int, init_file: str, out_dir: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        group = dist.new_group(list(range(world)))
        for backend in WORLD_BACKENDS[world]:
            run_jobs(results, rank, world, group, backend)
        run_bad_input(results, rank, world, group)
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_jobs(results: dict, rank: int, world: int, group, backend: str):
    import dgpo_ops

    for name, job in jobs().items():
        batch, keywords = inputs_of(job)
        logits = batch.pop("logits")
        if name == "strided":  # this process's columns of logits[:, :-1], as a view (no copy)
            leaf = logits._base[..., columns_of(rank, world)].clone().requires_grad_(True)
            shard = leaf[:, :-1]
        else:
            leaf = shard = logits[..., columns_of(rank, world)].detach().clone().requires_grad_(True)
        out = dgpo_ops.fused_dgpo_loss(shard, **batch, **keywords, backend=backend, vocab_parallel_group=group)
        out.loss.backward()
        results[f"{backend}/{name}"] = dict(loss=out.loss.detach(), logps=out.logps, entropy=out.entropy,
                                            metrics=out.metrics.as_tensor().detach(),
                                            grad=leaf.grad[:, :-1] if name == "strided" else leaf.grad)
    for name in LINEAR_JOBS:
        tensors, batch, keywords = linear_inputs(name, backend)
        rows = columns_of(rank, world)
        hidden = tensors["hidden"].requires_grad_(True)
        weight = tensors["weight"][rows].clone().requires_grad_(True)
        bias = tensors["bias"][rows].clone().requires_grad_(True)
        leaf, weight_group = weight, group
        if name == "linear_dtensor":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (world,))
            leaf = distribute_tensor(tensors["weight"].clone(), mesh, [Shard(0)]).requires_grad_(True)
            weight, weight_group = leaf, mesh.get_group(0)
        out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **batch, bias=bias, **keywords,
                                              vocab_parallel_group=weight_group)
        out.loss.backward()
        weight_grad = leaf.grad.to_local() if hasattr(leaf.grad, "to_local") else leaf.grad
        results[f"{backend}/{name}"] = dict(loss=out.loss.detach(), logps=out.logps, entropy=out.entropy,
                                            metrics=out.metrics.as_tensor().detach(), hidden=hidden.grad,
                                            weight=weight_grad, bias=bias.grad)
    for case in ACCURACY_CASES:
        shard = accuracy_logits(case)[..., columns_of(rank, world)]
        out = dgpo_ops.fused_dgpo_loss(shard, accuracy_targets(), torch.ones(4), backend=backend,
                                       vocab_parallel_group=group)
        results[f"{backend}/accuracy/{case}"] = out.entropy
    hidden, weight = accuracy_hidden()
    targets = torch.arange(hidden.shape[0]).remainder(VOCAB)
    logp, entropy = dgpo_ops.linear_logprob_entropy(hidden, weight[columns_of(rank, world)], targets,
                                                    backend=backend, vocab_parallel_group=group)
    results[f"{backend}/accuracy/linear"] = dict(logp=logp.detach(), entropy=entropy.detach())
    for case in DEFERRED_CASES:
        results[f"{backend}/deferred/{case}"] = deferred_case(case, rank, world, group, backend)


def run_bad_input(results: dict, rank: int, world: int, group):
    """Immediate validation: unequal shares of the vocabulary, a target outside it, a DTensor over another group."""
    import torch.distributed as dist

    import dgpo_ops

    batch, keywords = inputs_of(EXTRA_JOBS["bf16"])
    logits = batch.pop("logits").float()
    uneven = logits[..., : VOCAB // world - (1 if rank == 0 else 0)]
    for label, call in (
            ("uneven", lambda: dgpo_ops.fused_dgpo_loss(uneven, **batch, vocab_parallel_group=group)),
            ("target", lambda: dgpo_ops.fused_dgpo_loss(
                logits[..., columns_of(rank, world)], **{**batch, "target_ids": batch["target_ids"] + VOCAB},
                vocab_parallel_group=group))):
        results[f"error/{label}"] = value_error_message(call)
    # A Shard(0) DTensor weight over the whole group, with another group stated: refused on every process.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    tensors, batch, keywords = linear_inputs("linear")
    weight = distribute_tensor(tensors["weight"], init_device_mesh("cpu", (world,)), [Shard(0)])
    other_group = dist.new_group([0])  # every process must take part in making it
    results["error/group"] = value_error_message(lambda: dgpo_ops.fused_linear_dgpo_loss(
        tensors["hidden"], weight, **batch, **keywords, vocab_parallel_group=other_group))


def token_count_cases(rank: int, group, backend: str) -> dict:
    """Different token counts across the group under deferred validation (process 0 one response short), through
    the logits op, the fused-linear op (whose backward all-reduces the hidden state's gradient) and
    fused_linear_logprobs: each call's values (NaN expected) and the error raised next; then a call with agreeing
    counts, whose loss must be every process's same finite one (the group's collectives are still in step);
    then the same under immediate validation, which raises."""
    import dgpo_ops

    responses = 2 if rank == 0 else 3
    batch, _ = inputs_of(EXTRA_JOBS["seq_sum_norm_per_token_adv"])
    logits = batch.pop("logits")
    short = {name: value[:responses] for name, value in batch.items()}
    columns = columns_of(rank, torch.distributed.get_world_size(group))
    results = {}
    dgpo_ops.raise_deferred_errors()
    shard = logits[:responses, :, columns].clone().requires_grad_(True)
    out = dgpo_ops.fused_dgpo_loss(shard, **short, aggregation="seq_mean_token_mean", validation="deferred",
                                   backend=backend, vocab_parallel_group=group)
    (grad,) = torch.autograd.grad(out.loss, [shard])
    results["logits"] = dict(loss=out.loss.detach(), grad_has_nan=bool(grad.isnan().any()),
                             error=value_error_message(dgpo_ops.raise_deferred_errors))
    tensors, linear_batch, keywords = linear_inputs("linear", backend)
    hidden = tensors["hidden"][:responses].clone().requires_grad_(True)
    weight = tensors["weight"][columns].clone().requires_grad_(True)
    out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **{k: v[:responses] for k, v in linear_batch.items()},
                                          **keywords, validation="deferred", vocab_parallel_group=group)
    grad_hidden, grad_weight = torch.autograd.grad(out.loss, [hidden, weight])
    results["linear"] = dict(loss=out.loss.detach(), grad_has_nan=bool(grad_hidden.isnan().any()
                                                                       and grad_weight.isnan().any()),
                             error=value_error_message(dgpo_ops.raise_deferred_errors))
    targets = linear_batch["target_ids"][:responses]
    logp, entropy = dgpo_ops.fused_linear_logprobs(hidden.detach(), weight.detach(), targets, backend=backend,
                                                   validation="deferred", vocab_parallel_group=group)
    scored = targets != -100  # (0 on the others, as documented)
    results["logprobs"] = dict(all_nan=bool(logp[scored].isnan().all() and entropy[scored].isnan().all()),
                               error=value_error_message(dgpo_ops.raise_deferred_errors))
    shard = logits[..., columns]
    results["agreeing"] = dgpo_ops.fused_dgpo_loss(shard, **batch, validation="deferred", backend=backend,
                                                   vocab_parallel_group=group).loss
    results["immediate"] = value_error_message(lambda: dgpo_ops.fused_dgpo_loss(
        logits[:responses, :, columns], **short, validation="immediate", backend=backend, vocab_parallel_group=group))
    return results


def token_count_worker(rank: int, world: int, init_file: str, out_dir: str):
    """``token_count_cases`` on a gloo group as it is, then on a fresh group whose sizes are agreed over the host
    group made for a group that takes no CPU tensors (NCCL's: here a gloo group with that check patched)."""
    from unittest import mock

    import torch.distributed as dist

    from dgpo_ops.layouts import vocab

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        group = dist.new_group(list(range(world)))
        for backend in BACKENDS:
            results[backend] = token_count_cases(rank, group, backend)
        device_only = dist.new_group(list(range(world)))
        with mock.patch.object(vocab, "takes_cpu_tensors", lambda g: g is not device_only):
            results["own host group"] = token_count_cases(rank, device_only, "torch")
        results["host groups"] = len(vocab.HOST_GROUPS)
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
