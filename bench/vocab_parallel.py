"""Scaling of the vocab-parallel ops over gloo processes on the CPU: the same tokens on every process,
``V / P`` of the vocabulary each (logits columns, or lm_head weight rows), forward + backward.

    python bench/vocab_parallel.py [--processes 1 2 4] [--repeats 3]

Each process runs with one thread, so P processes use P cores where the machine has them (this
project's machines have 2: at P = 4 the processes share them, which the table shows). Time is the
slowest process's median over ``--repeats`` calls after a warm-up, each call starting at a barrier.
P = 1 is the same path over a group of one process. Writes ``bench/results/vocab_parallel-cpu.json``
and the table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Sizes where the passes over the vocabulary dominate (the all-reduces carry 16 bytes per token).
LOGITS_SIZE = dict(N=2048, V=65536)
LINEAR_SIZE = dict(N=1024, H=256, V=32768)


def make_inputs(op: str, rank: int, world: int):
    generator = torch.Generator().manual_seed(0)
    size = LOGITS_SIZE if op == "logits" else LINEAR_SIZE
    N, V = size["N"], size["V"]
    share = slice(rank * V // world, (rank + 1) * V // world)
    target = torch.randint(0, V, (N,), generator=generator)
    old_logps = -torch.rand(N, generator=generator) * 10.0
    advantages = torch.randn(N, generator=generator)
    if op == "logits":
        tensors = [(torch.randn(N, V, generator=generator) * 2.0)[:, share].contiguous()]
    else:
        hidden = torch.randn(N, size["H"], generator=generator) / size["H"] ** 0.5
        tensors = [hidden, (torch.randn(V, size["H"], generator=generator) * 0.5)[share].contiguous()]
    return [t.requires_grad_(True) for t in tensors], dict(target_ids=target, advantages=advantages,
                                                           old_logps=old_logps)


def call(op, tensors, inputs, group):
    import dgpo_ops

    if op == "logits":
        out = dgpo_ops.fused_dgpo_loss(tensors[0], **inputs, method="dgpo", vocab_parallel_group=group)
    else:
        out = dgpo_ops.fused_linear_dgpo_loss(tensors[0], tensors[1], **inputs, method="dgpo",
                                              vocab_parallel_group=group)
    out.loss.backward()
    for t in tensors:
        t.grad = None


def worker(rank, world, init_file, out_dir, repeats):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.group.WORLD  # P = 1 too: the same path, its all-reduces over one process
    results = {}
    for op in ("logits", "linear"):
        tensors, inputs = make_inputs(op, rank, world)
        call(op, tensors, inputs, group)  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            call(op, tensors, inputs, group)
            times.append(time.perf_counter() - start)
        slowest = torch.tensor(times)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[op] = statistics.median(slowest.tolist())
    if rank == 0:
        (Path(out_dir) / "times.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from dgpo_ops.trainer.app.environment import code_commit, describe

    rows = []
    for world in args.processes:
        with tempfile.TemporaryDirectory() as scratch:
            mp.spawn(worker, args=(world, os.path.join(scratch, "init"), scratch, args.repeats), nprocs=world,
                     join=True)
            times = json.loads((Path(scratch) / "times.json").read_text())
        rows.append(dict(processes=world, **{f"{op}_s": value for op, value in times.items()}))
        print(f"P = {world}: " + ", ".join(f"{op} {value * 1e3:.0f} ms" for op, value in times.items()), flush=True)
    commit, dirty = code_commit()
    record = dict(machine=describe(torch.device("cpu")), commit=commit, dirty=dirty, cores=os.cpu_count(),
                  logits_size=LOGITS_SIZE, linear_size=LINEAR_SIZE, repeats=args.repeats, rows=rows)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "vocab_parallel-cpu.json").write_text(json.dumps(record, indent=1) + "\n")
    base = rows[0]
    lines = [f"Vocab-parallel ops on {os.cpu_count()} CPU cores, gloo, one thread per process; dgpo_ops {commit}"
             f"{' (dirty)' if dirty else ''}; `python bench/vocab_parallel.py`. Forward + backward of DGPO's loss; "
             f"logits op N = {LOGITS_SIZE['N']}, V = {LOGITS_SIZE['V']} (fp32); linear op N = {LINEAR_SIZE['N']}, "
             f"H = {LINEAR_SIZE['H']}, V = {LINEAR_SIZE['V']} (fp32). Time: the slowest process, median of "
             f"{args.repeats} calls.", "",
             "| processes | logits op (ms) | speed-up | linear op (ms) | speed-up |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['processes']} | {row['logits_s'] * 1e3:.0f} | {base['logits_s'] / row['logits_s']:.2f} "
                     f"| {row['linear_s'] * 1e3:.0f} | {base['linear_s'] / row['linear_s']:.2f} |")
    (RESULTS_DIR / "vocab_parallel-cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
