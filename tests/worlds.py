"""The process worlds of the distributed tests: real processes (torch.multiprocessing), each a gloo rank,
started by ``start_world`` from multiprocessing's forkserver rather than spawned.

A spawned rank is a new interpreter that imports torch, dgpo_ops and, for the FSDP and DeepSpeed worlds,
transformers' Qwen2 model before it does anything: 2-5 s of CPU a rank, most of a world's time. The forkserver
is a process of its own, started by the first world of a test process from a new interpreter that imports
``PRELOAD`` once; every rank after that is a fork of it. A rank still shares nothing with the test process (no
threads, no process group, no patched state): it is what spawn gives, with the imports already done. The
forkserver reads the environment and ``sys.path`` of the test process when it starts (after collection, so the
test folders are on the path)."""

from __future__ import annotations

import multiprocessing
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The xdist group of every test that starts a world: one worker runs them all, so that one forkserver starts (its
# imports, about 5 s, once a run rather than once a worker) and no two worlds run side by side on two cores.
XDIST_GROUP = "forkserver_worlds"

# What a rank of the suite's worlds imports before its work (a module that fails to import is left out, as
# multiprocessing does: the rank then imports it itself and fails as it would have)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.device_mesh",
           "transformers.models.qwen2.modeling_qwen2", "dgpo_ops", "dgpo_ops.kernels", "dgpo_ops.corrections",
           "dgpo_ops.distributed.head", "interpreted_triton", "helpers"]


def start_world(worker, args: tuple, nprocs: int, join: bool = True):
    """``torch.multiprocessing.start_processes`` from the forkserver: ``worker(rank, *args)`` in each of
    ``nprocs`` processes; with ``join=False``, the ``ProcessContext``, to join (or kill) as the caller sees
    fit."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts
    return mp.start_processes(worker, args=args, nprocs=nprocs, join=join, start_method="forkserver")


def gloo_rank(rank: int, world: int, init_file: str, out_dir: str, work) -> None:
    """One rank of a gloo world: ``work()`` in the process group, its dict saved to ``out_dir/rank<rank>.pt``, or
    ``{"error": traceback}`` for the parent to fail the test with."""
    result = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        result = work()
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        result = {"error": traceback.format_exc()}
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()
