"""What each process of the DeepSpeed ZeRO-3 tests runs (``tests/distributed/test_deepspeed.py``): the tiny Qwen2
causal LM of the FSDP2 tests (``tests/distributed/fsdp_workers.py``) wrapped by ``deepspeed.initialize`` with ZeRO
stage 3 (every parameter partitioned, none kept whole), the fused-linear policy loss computed as
``DGPOTrainer._compute_loss`` computes it (inside the engine's forward, the op as the lm_head's
forward), on this process's share of one global batch; the whole gradients are written to a file.

CPU only: DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) with gloo.
"""

from __future__ import annotations

import os
import sys
import traceback
import types
from datetime import timedelta

import fsdp_workers
import torch
from fsdp_workers import COMPLETION, GLOBAL_BATCH, HIDDEN, build_model, global_batch, policy_loss, rows
from helpers import value_error_message

CASES = {"untied": False, "tied": True}  # name -> tied embeddings
UNSHARDED_CASES = {"untied": "accelerate", "tied": "accelerate_tied"}  # fsdp_workers' cases with that model
JOBS = [("untied", "dgpo"), ("tied", "dgpo"), ("tied", "gspo")]


def ds_config(world: int) -> dict:
    micro = GLOBAL_BATCH // world
    return {
        "train_batch_size": micro * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        # Every parameter partitioned, none kept whole between forwards (the threshold's default keeps
        # small ones, this model's included, unpartitioned, which would test nothing).
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},  # ZeRO-3 partitions gradients only with one
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
    }


def unsharded_result(case: str, method: str) -> dict:
    """One process, no DeepSpeed, the whole global batch."""
    return fsdp_workers.unsharded_result(UNSHARDED_CASES[case], method)


def init_deepspeed(rank: int, world: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import deepspeed
    import deepspeed.comm.torch

    # Time only, nothing the tests check: DeepSpeed's CPU backend compiles a shared-memory collective
    # op when it starts (about 2 minutes cold; gloo does the collectives here without it), and ZeRO
    # imports its Muon optimizer module to compare the optimizer's class with it, which imports
    # torch._inductor (5 s a process, then 5 s more at exit); this job never uses Muon.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    muon = "deepspeed.runtime.zero.muon.muon_optimizer"
    if muon not in sys.modules:
        sys.modules[muon] = types.ModuleType(muon)
        sys.modules[muon].MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})  # no optimizer is one
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120), verbose=False)
    return deepspeed


def deepspeed_worker(rank: int, world: int, port: int, out_dir: str, jobs: list):
    """``jobs``: (case, method) pairs, run in order; results keyed by the pair."""
    torch.set_num_threads(1)
    results = {}
    deepspeed = None
    try:
        deepspeed = init_deepspeed(rank, world, port)
        from deepspeed.utils import safe_get_full_grad

        from dgpo_ops import fused_linear_dgpo_loss

        batch = rows(global_batch(), rank, world)
        for case, method in jobs:
            model = build_model(CASES[case])
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(world))
            out, logps = policy_loss(engine, batch, method, False, engine.backward)
            loss = out.loss.detach().clone()
            grads = {}  # safe_get_full_grad all-gathers the partitions: every process, the same order
            for name, param in engine.module.named_parameters():
                grad = safe_get_full_grad(param)
                grads[name] = None if grad is None else grad.detach().float().clone()
            results[case, method] = {"loss": loss, "logps": logps, "grads": grads,
                                     "head_numel": engine.module.lm_head.weight.numel()}
            if (case, method) == jobs[-1]:
                # A bare partitioned weight (outside the head's forward: 0 elements) is refused.
                weight = engine.module.lm_head.weight
                results["bare_weight_numel"] = weight.numel()
                hidden = torch.randn(2, COMPLETION, HIDDEN, requires_grad=True)
                results["bare_weight_error"] = value_error_message(lambda: fused_linear_dgpo_loss(
                    hidden, weight, batch["targets"][:2], batch["advantages"][:2]))
            engine.destroy()
    except Exception:  # noqa: BLE001 (reported by the test, with the traceback)
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        if deepspeed is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # The results are on disk (errors included); skip the interpreter's teardown, seconds here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
