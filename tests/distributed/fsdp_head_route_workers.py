"""One process of one case of ``tests/distributed/test_fsdp_head_routes.py``: the route the README gives for calling the
fused-linear op after the model's forward under FSDP2, ``fused_linear_dgpo_loss(hidden, model.lm_head, ...)``
with ``hidden = model(input_ids, output_hidden_states=True).hidden_states[-1]``, on this process's share of
one global batch, two steps (``two_steps``); each step's loss, log-probs and whole gradients (or the
``ValueError`` and where it came) are written to ``<out_dir>/<case>/rank<rank>.pt``.

Each process (``run_logged``, started by ``tests/worlds.py``) runs one or more cases in turn, each case in a
gloo world of its own (a process group made from ``<init_dir>/<case>.init`` and destroyed after it: nothing of
one case's collectives reaches the next), its output in ``<out_dir>/rank<rank>.log``. Starting the processes
takes longer than a case, so the test starts one pair for all cases; it kills the pair when a case runs past
its deadline, so that a hang fails that case instead of stalling the run, and starts a new pair for the cases
after it.

The model, batch and gradient gathering are ``tests/distributed/fsdp_workers.py``'s (a tiny Qwen2 built in-process).
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import fsdp_workers as workers
import torch

COMPLETION = workers.COMPLETION

# name -> (tied embeddings, wrapping). Decoder layers are their own units in every wrapping but root_only.
CASES = {
    "root_only": (False, "root_only"),
    "root_only_tied": (True, "root_only"),
    # the head its own unit; tied, the unit that holds the shared weight is [embedding, lm_head]
    # (torch >= 2.13 refuses a shared parameter in two units: see head_alone_tied)
    "head_unit": (False, "head_unit"),
    "head_unit_tied": (True, "head_unit"),
    # accelerate 1.15's fsdp2_prepare_model: untied, the embedding alone and the tail [final norm, lm_head];
    # tied, the tail [final norm, embedding, lm_head]; the tail with reshard_after_forward=False
    "accelerate_norm_head": (False, "norm_head"),
    "accelerate_norm_embedding_head_tied": (True, "norm_embedding_head"),
    # the other combinations of those tails with tied and untied embeddings
    "norm_embedding_head": (False, "norm_embedding_head"),
    "norm_head_tied": (True, "norm_head"),
    # beyond the eight: the tail resharding after forward (the call gathers it again), the tied head alone
    # in a unit, and the root resharding after forward (the head's weight stays a shard: refused)
    "norm_head_resharding": (False, "norm_head_resharding"),
    "head_alone_tied": (True, "head_alone"),
    "root_resharding": (False, "root_resharding"),
}


def wrap(model, wrapping: str, mesh):
    from torch.distributed.fsdp import fully_shard

    backbone, head, tied = model.model, model.lm_head, model.config.tie_word_embeddings
    if not wrapping.startswith("root_"):
        for layer in backbone.layers:
            fully_shard(layer, mesh=mesh)
    if wrapping == "head_unit":
        fully_shard([backbone.embed_tokens, head] if tied else head, mesh=mesh)
    elif wrapping == "head_alone":
        fully_shard(head, mesh=mesh)
    elif wrapping in ("norm_head", "norm_head_resharding"):
        if not tied:
            fully_shard(backbone.embed_tokens, mesh=mesh)
        fully_shard([backbone.norm, head], mesh=mesh, reshard_after_forward=wrapping == "norm_head_resharding")
    elif wrapping == "norm_embedding_head":  # accelerate's order: the embedding before the head
        fully_shard([backbone.norm, backbone.embed_tokens, head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, **({"reshard_after_forward": True} if wrapping == "root_resharding" else {}))
    return model


def last_hidden_state(model, batch: dict) -> torch.Tensor:
    """As the README tells users: the model's own forward, its last hidden state (in transformers' Qwen2
    after the final norm), at the positions that predict the completion."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    return out.hidden_states[-1][:, -COMPLETION - 1:-1]


def loss_call(model, batch: dict):
    import dgpo_ops

    return dgpo_ops.fused_linear_dgpo_loss(last_hidden_state(model, batch), model.lm_head, batch["targets"],
                                           batch["advantages"], batch["mask"], batch["old_logps"], method="dgpo",
                                           aggregation="seq_mean_token_mean")


def two_steps(model, batch: dict, on_step_end=lambda step: None) -> list[dict]:
    """Step 1: the model's forward, the loss through the head module, backward (where the crash was).
    Step 2, the gradients cleared: old log-probs through the head module without gradients after a forward
    of their own first, as an RL step takes them, then the same loss and backward. Each step's loss,
    log-probs and gradients (``on_step_end`` reads the gradients: whole, on every process)."""
    import dgpo_ops

    steps = []
    out = loss_call(model, batch)
    out.loss.backward()
    steps.append({"loss": out.loss.detach(), "logps": out.logps.detach(), "grads": on_step_end(1)})
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logps, _ = dgpo_ops.fused_linear_logprobs(last_hidden_state(model, batch), model.lm_head, batch["targets"],
                                                  batch["mask"])
    out = loss_call(model, batch)
    out.loss.backward()
    steps.append({"loss": out.loss.detach(), "logps": logps, "grads": on_step_end(2)})
    return steps


def one_process_result(tied: bool) -> dict:
    """The first step on one process, no wrapping, the whole global batch."""
    model = workers.build_model(tied)
    out = loss_call(model, workers.global_batch())
    out.loss.backward()
    return {"loss": out.loss.detach(), "logps": out.logps.detach(), "grads": workers.whole_gradients(model)}


def run(case: str, rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One case in a gloo world of its own: made from ``init_file``, destroyed at the end."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    result, phase = {}, "wrap"
    try:
        tied, wrapping = CASES[case]
        model = wrap(workers.build_model(tied), wrapping, init_device_mesh("cpu", (world,)))
        phase = "step 1"

        def on_step_end(step):
            nonlocal phase
            phase = f"step {step}, gathering the gradients"
            grads = workers.whole_gradients(model)
            phase = f"step {step + 1}"
            return grads

        result = {"steps": two_steps(model, workers.rows(workers.global_batch(), rank, world), on_step_end)}
    except ValueError as error:
        result = {"value_error": str(error), "phase": phase, "traceback": traceback.format_exc()}
    except Exception:  # noqa: BLE001 -- any other failure is reported to the test with its traceback
        result = {"error": traceback.format_exc(), "phase": phase}
    path = os.path.join(out_dir, case, f"rank{rank}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(result, path + ".part")
    os.replace(path + ".part", path)  # whole or absent: the test reads a case's progress from these files
    dist.destroy_process_group()


def run_cases(cases: list[str], rank: int, world: int, init_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    for case in cases:
        print(f"case {case}", flush=True)  # the test's log names the case a hang or crash came in
        run(case, rank, world, os.path.join(init_dir, f"{case}.init"), out_dir)


def run_logged(rank: int, cases: list[str], world: int, init_dir: str, out_dir: str) -> None:
    """A process of the pair: its output (the case it is in, any crash) to ``<out_dir>/rank<rank>.log``, which
    the test shows when a case hangs or the process dies."""
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
        os.dup2(log, stream.fileno())
    run_cases(cases, rank, world, init_dir, out_dir)
