"""What each process of the FSDP2 (and DDP) tests runs (``tests/distributed/test_fsdp.py``): a tiny Qwen2 causal LM wrapped
with ``fully_shard`` as a training job wraps it, the fused-linear policy loss computed as
``DGPOTrainer._compute_loss`` computes it (inside the model's forward, the op as the lm_head's
forward), on this process's share of one global batch; the whole gradients are written to a file.

The wrappings follow accelerate 1.15's ``fsdp2_prepare_model`` (accelerate/utils/fsdp_utils.py):
decoder layers bottom-up, an untied input embedding alone, then the tail ``[final norm, (embedding,)
lm_head]`` with ``reshard_after_forward=False``, then the root; and the custom policies users write.
"""

from __future__ import annotations

import os
import traceback

import torch
from helpers import value_error_message

import dgpo_ops

VOCAB, HIDDEN, GLOBAL_BATCH, PROMPT, COMPLETION = 96, 32, 6, 5, 6
METHODS = {"dgpo": dict(method="dgpo"), "gspo": dict(method="grpo", importance_sampling_level="sequence", beta=0.05)}

# name -> (tied embeddings, mixed precision, wrapping)
CASES = {
    "accelerate": (False, False, "accelerate"),
    "accelerate_tied": (True, False, "accelerate"),
    "head_unit_reshard": (False, False, "head_unit_reshard"),
    "head_unit_keep": (False, False, "head_unit_keep"),
    "tied_embedding_head_unit": (True, False, "embedding_head_unit"),
    "root_only": (False, False, "root_only"),
    "bf16_params_head_unit": (False, True, "head_unit_reshard"),
    "bf16_params_accelerate": (False, True, "accelerate"),
    "ddp": (False, False, "ddp"),
    "ddp_tied": (True, False, "ddp"),
}


def build_model(tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, attn_implementation="eager")
    return Qwen2ForCausalLM(config).float()


def global_batch(seed: int = 1) -> dict:
    """One global batch of left-padded prompts and right-padded completions, with old log-probs near
    the policy's own (ratios around 1, some outside the trust region) and a reference for the KL."""
    generator = torch.Generator().manual_seed(seed)
    length = PROMPT + COMPLETION
    input_ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, length), generator=generator)
    attention_mask = torch.ones(GLOBAL_BATCH, length, dtype=torch.long)
    for row in range(GLOBAL_BATCH):
        attention_mask[row, : row % 3] = 0  # left padding of the prompt
        if row % 2:
            attention_mask[row, length - 1 - row % 3:] = 0  # completions that ended early
    completion_mask = attention_mask[:, PROMPT:]
    targets = input_ids[:, PROMPT:].masked_fill(completion_mask == 0, -100)
    noise = torch.randn(GLOBAL_BATCH, COMPLETION, generator=generator)
    return dict(input_ids=input_ids, attention_mask=attention_mask, targets=targets, mask=completion_mask.bool(),
                advantages=torch.randn(GLOBAL_BATCH, generator=generator),
                old_logps=-torch.log(torch.tensor(float(VOCAB))) + 0.3 * noise,
                ref_logps=-torch.log(torch.tensor(float(VOCAB))) - 0.2 * noise)


def rows(batch: dict, rank: int, world: int) -> dict:
    share = GLOBAL_BATCH // world
    return {name: value[rank * share:(rank + 1) * share] for name, value in batch.items()}


def wrap(model, wrapping: str, mesh, mixed_precision: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if wrapping == "ddp":  # DistributedDataParallel: whole parameters, gradients all-reduced (averaged)
        return torch.nn.parallel.DistributedDataParallel(model)
    kwargs = dict(mesh=mesh)
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    backbone, head, tied = model.model, model.lm_head, model.config.tie_word_embeddings
    if wrapping != "root_only":
        for layer in backbone.layers:
            fully_shard(layer, **kwargs)
    if wrapping == "accelerate":
        if not tied:
            fully_shard(backbone.embed_tokens, **kwargs)
        tail = [backbone.norm, backbone.embed_tokens, head] if tied else [backbone.norm, head]
        fully_shard(tail, **kwargs, reshard_after_forward=False)
    elif wrapping in ("head_unit_reshard", "head_unit_keep"):
        fully_shard(head, **kwargs, reshard_after_forward=wrapping == "head_unit_reshard")
    elif wrapping == "embedding_head_unit":
        fully_shard([backbone.embed_tokens, head], **kwargs)
    fully_shard(model, **kwargs)
    return model


def policy_loss(model, batch: dict, method: str, on_chip: bool, backward=None):
    """The loss and the old-policy log-probs as DGPOTrainer computes them (``fused='linear'``); ``model``
    may be wrapped (DDP, FSDP2, a DeepSpeed engine: ``backward`` is then ``engine.backward``)."""
    from dgpo_ops.api import fused_linear_logprobs, policy_loss
    from dgpo_ops.core.inputs import LossInputs
    from dgpo_ops.core.options import LossOptions
    from dgpo_ops.core.output import PolicyLossOutput
    from dgpo_ops.distributed.head import add_hidden_state_output, fused_linear_on_model

    method, _, route = method.partition("@")  # "dgpo@module": fused_linear_dgpo_loss(hidden, model.lm_head, ...)
    inner = getattr(model, "module", model)
    add_hidden_state_output(inner)  # as DGPOTrainer: on the model inside a DDP wrapper
    backend = "triton" if on_chip else "auto"
    options = LossOptions.build(aggregation="seq_mean_token_mean", backend=backend, logits_on_chip=on_chip,
                                **METHODS[method])
    loss_batch = LossInputs(batch["targets"], batch["advantages"], batch["mask"], batch["old_logps"],
                           batch["ref_logps"] if options.beta else None)

    def loss_fn(hidden, weight, bias):
        return policy_loss(loss_batch, options, hidden=hidden, weight=weight, bias=bias).tensors()

    def logprobs_fn(hidden, weight, bias):
        return fused_linear_logprobs(hidden, weight, batch["targets"], bias=bias, logits_on_chip=on_chip,
                                     backend=backend)

    if route == "module":  # the public call, after the model's forward, with the head module as the weight
        def on_head(fn):
            hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           dgpo_head_fn=lambda hidden, head: hidden)[:, -COMPLETION - 1:-1]
            return fn(hidden, inner.get_output_embeddings(), None)
    else:  # as DGPOTrainer: inside the model's forward
        def on_head(fn):
            return fused_linear_on_model(model, batch["input_ids"], batch["attention_mask"], COMPLETION, fn)

    with torch.no_grad():
        logps, _ = on_head(logprobs_fn)
    out = PolicyLossOutput.from_tensors(on_head(loss_fn))
    (backward or torch.Tensor.backward)(out.loss)
    return out, logps


def whole_gradients(model) -> dict:
    """Every parameter's gradient, whole (DTensor shards gathered: a collective, same order everywhere)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name.removeprefix("module.")] = None if grad is None else grad.detach().float().clone()
    return grads


def unsharded_result(case: str, method: str, on_chip: bool = False, world: int = 1, rank: int = 0) -> dict:
    """One process, no wrapping: ``world`` shares of the global batch, gradients averaged over them as
    data parallelism averages them (``world=1``: the whole batch at once)."""
    tied, _, _ = CASES[case]
    model = build_model(tied)
    batch = global_batch()
    out, logps = policy_loss(model, rows(batch, rank, world) if world > 1 else batch, method, on_chip)
    return dict(loss=out.loss.detach(), logps=logps, grads=whole_gradients(model))


def fsdp_worker(rank: int, world: int, init_file: str, out_dir: str, jobs: list):
    """``jobs``: (case, method, on_chip) triples, run in order; results keyed by the triple."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        batch = rows(global_batch(), rank, world)
        for case, method, on_chip in jobs:
            tied, mixed_precision, wrapping = CASES[case]
            model = wrap(build_model(tied), wrapping, mesh, mixed_precision)
            out, logps = policy_loss(model, batch, method, on_chip)
            results[case, method, on_chip] = dict(loss=out.loss.detach(), logps=logps, grads=whole_gradients(model),
                                 metrics=out.metrics.as_tensor().clone())
        # A bare sharded weight (the head's own unit, outside its forward) is refused, never gathered by guess.
        model = wrap(build_model(False), "head_unit_reshard", mesh, False)
        hidden = torch.randn(2, COMPLETION, HIDDEN, requires_grad=True)
        results["bare_dtensor_error"] = value_error_message(lambda: dgpo_ops.fused_linear_dgpo_loss(
            hidden, model.lm_head.weight, batch["targets"], batch["advantages"]))
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
