"""Running the fused-linear op as the lm_head module's own forward, so that a sharding engine
(FSDP2 in any wrapping, DeepSpeed ZeRO-3) hands it the whole weight and reduces its gradient.

The fused-linear op replaces ``lm_head(hidden)``: the head module's forward never runs, so neither do
the hooks an engine registers on it. FSDP2 all-gathers a unit's parameters in its forward pre-hook and
reduce-scatters their gradients from hooks placed on that forward's inputs and outputs; ZeRO-3 does
the same per module. A weight taken from a head whose hooks did not run is a shard (FSDP2: a
``Shard(0)`` DTensor; ZeRO-3: an empty tensor), and a gradient computed from it by hand
(``full_tensor()``) stays on one process: silently wrong. ``head_forward`` calls the head module
itself with its ``forward`` redirected to the op (TRL's forward redirection), so every hook of every
engine runs exactly as for ``lm_head(hidden)``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def head_forward(head: nn.Module, fn: Callable[..., Any], hidden: torch.Tensor, *args) -> Any:
    """``fn(hidden, head.weight, head.bias, *args)``, run as ``head``'s forward (``head(hidden)``
    with its forward redirected), so the engine that shards ``head`` has its parameters whole when
    ``fn`` reads them and reduces their gradients as it does for the head's own forward.

    ``fn`` must return tensors in a tuple (FSDP2 and DeepSpeed find the outputs that need their
    backward hooks by walking tuples); ``hidden`` reaches it as the engine passed it on (cast by an
    FSDP2 ``MixedPrecisionPolicy``, as the head's own input would be)."""
    if not isinstance(head, nn.Module):
        raise ValueError(f"head must be the lm_head nn.Module, got {type(head).__name__}")
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"head ({type(head).__name__}) has no weight tensor: pass the lm_head module (an nn.Linear "
                         "or the tied nn.Embedding), whose weight is (V, H)")
    had_own_forward = "forward" in head.__dict__
    own_forward = head.__dict__.get("forward")

    def redirected(engine_hidden, *engine_args):
        restore()  # anything inside fn that calls the head gets its own forward
        return fn(engine_hidden, head.weight, getattr(head, "bias", None), *engine_args)

    def restore():
        if had_own_forward:
            head.forward = own_forward
        elif "forward" in head.__dict__:
            del head.forward

    head.forward = redirected
    try:
        return head(hidden, *args)
    finally:
        restore()


def add_hidden_state_output(model) -> None:
    """Let ``model(..., dgpo_head_fn=fn)`` return ``fn(hidden, lm_head)``, ``hidden`` the backbone's last
    hidden state (a transformers causal LM: ``base_model`` and ``get_output_embeddings``). The forward
    is patched on the instance, like TRL's fused head, so the fused-linear op runs inside the model's
    forward as DDP, FSDP2 or DeepSpeed wrapped it, and ``fn`` runs it as the lm_head's own forward
    (``head_forward``): every engine gathers the head's weight and reduces its gradient as for
    ``lm_head(hidden)``."""
    previous_forward = model.forward

    def forward(self, *args, dgpo_head_fn=None, **kwargs):
        if dgpo_head_fn is None:
            return previous_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        return dgpo_head_fn(self.base_model(*args, **kwargs).last_hidden_state, self.get_output_embeddings())

    model.forward = types.MethodType(forward, model)


def fused_linear_on_model(model, input_ids, attention_mask, logits_to_keep, loss_fn):
    """``loss_fn(hidden, weight, bias)`` on the completion positions' hidden states, run as the
    lm_head's forward inside ``model``'s (wrapped) forward; returns what ``loss_fn`` returns (a tuple
    of tensors). ``model`` has had ``add_hidden_state_output``."""
    def on_hidden(hidden, head):
        return head_forward(head, loss_fn, hidden[:, -logits_to_keep - 1 : -1])

    return model(input_ids=input_ids, attention_mask=attention_mask, dgpo_head_fn=on_hidden)
