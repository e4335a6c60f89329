"""What each process of tests/integrations/test_verl.py's split-vocabulary test runs: the same hidden states and labels
on every process, this process's half of the lm_head's rows, verl's ``linear_cross_entropy`` contract with
``dist_process_group``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from worlds import gloo_rank

H, VOCAB, TEMPERATURE = 16, 38, 0.7  # VOCAB divisible by the 2 processes


def split_inputs():
    """(hidden, whole weight, labels, incoming gradients of log-probs and entropies), fp64, the same everywhere."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 8, H, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, H, generator=g, dtype=torch.float64) / 2
    labels = torch.randint(0, VOCAB, (3, 8), generator=g)
    return hidden, weight, labels, torch.randn(2, 3, 8, generator=g, dtype=torch.float64)


def split_vocabulary_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    gloo_rank(rank, world, init_file, out_dir, lambda: split_vocabulary(rank, world))


def split_vocabulary(rank: int, world: int) -> dict:
    from dgpo_ops.integrations.verl import linear_cross_entropy

    hidden, weight, labels, grads = split_inputs()
    rows = VOCAB // world
    shard = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
    hidden = hidden.clone().requires_grad_(True)
    logp, entropy = linear_cross_entropy(hidden, shard, labels, TEMPERATURE, "none",
                                         dist_process_group=dist.group.WORLD)
    (logp * grads[0].reshape(-1) + entropy * grads[1].reshape(-1)).sum().backward()
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad_hidden": hidden.grad,
            "grad_weight": shard.grad}
