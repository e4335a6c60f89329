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

After the model's forward (``fused_linear_dgpo_loss(hidden, model.lm_head, ...)``) a head that shares
its FSDP2 unit with other modules (accelerate's ``[final norm, lm_head]`` and ``[final norm, embedding,
lm_head]``, a tied ``[embedding, lm_head]``) is the one case this needs more than the call: that unit's
forward has ended, so FSDP2 would take the call for a new, partial forward of the unit and reduce and
reshard the unit's parameters where the call's input gets its gradient. That is before the final
norm's backward, which then reads a freed weight (on the CPU both processes die with SIGSEGV, or hang),
and before a tied weight's gradient exists (autograd accumulates a shared leaf's
gradient once, after its last use, the embedding's backward), which FSDP2 then never reduces
(``grad`` stays ``None``). ``head_forward`` runs the call instead as the last module of the unit's
forward (``_unit_forward_continued``): FSDP2 gathers the unit if it resharded, registers no
post-backward hook of its own for the call, and reduces the gradients once, where it does for the
model's forward (the post-backward hook on the unit's input, or the end of backward), after every
contribution.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dgpo_ops.layouts.vocab import FUSED_LINEAR_ON_MODEL, IN_HEAD_FORWARD


def refuse_own_forward(head: nn.Module) -> None:
    """``ValueError`` for a head whose output is not ``hidden @ weight.T + bias``: a PEFT adapter layer (LoRA on the
    lm_head: its output adds the adapter's product, and the adapter would get no gradient) or an ``nn.Linear`` /
    ``nn.Embedding`` subclass with a forward of its own (a quantised layer, a scaled output). The fused op reads
    ``weight`` and ``bias`` alone. A sharding engine's subclass (FSDP2's) keeps the base class's forward."""
    name = f"{type(head).__module__}.{type(head).__qualname__}"
    if hasattr(head, "get_base_layer") or hasattr(head, "base_layer"):
        what = f"a PEFT adapter layer ({name})"
    elif isinstance(head, nn.Linear) and type(head).forward is not nn.Linear.forward:
        what = f"an nn.Linear subclass with its own forward ({name})"
    elif isinstance(head, nn.Embedding) and type(head).forward is not nn.Embedding.forward:
        what = f"an nn.Embedding subclass with its own forward ({name})"
    else:
        return
    raise ValueError(f"the lm_head is {what}: the fused linear op computes hidden @ weight.T + bias from its weight "
                     "and bias alone, so its output and gradients would not be the head's. Leave the lm_head out of "
                     "the adapter's target_modules, or compute the logits with the head and use fused_dgpo_loss "
                     "(DGPOTrainer: fused='logits')")


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
    refuse_own_forward(head)
    had_own_forward = "forward" in head.__dict__
    own_forward = head.__dict__.get("forward")
    unit_groups = []  # the head's FSDP2 parameter groups when the call continues its unit's forward

    def redirected(engine_hidden, *engine_args):
        restore()  # anything inside fn that calls the head gets its own forward
        hook_group = getattr(getattr(engine_hidden, "grad_fn", None), "param_group", None)
        if unit_groups and hook_group in unit_groups:
            # This torch's FSDP2 registered its post-backward hook on the call's input all the same: it
            # would reduce and reshard the unit before the rest of the unit's backward (see the module
            # docstring). Refused before anything ran, rather than hanging in the backward.
            raise ValueError(_grouped_unit_refusal(
                head, "this torch's FSDP2 registers a post-backward hook on the call's input even when it "
                      "continues the unit's forward"))
        token = IN_HEAD_FORWARD.set(True)
        try:
            return fn(engine_hidden, head.weight, getattr(head, "bias", None), *engine_args)
        finally:
            IN_HEAD_FORWARD.reset(token)

    def restore():
        if had_own_forward:
            head.forward = own_forward
        elif "forward" in head.__dict__:
            del head.forward

    with _unit_forward_continued(head) as groups:
        unit_groups.extend(groups)
        head.forward = redirected
        try:
            return head(hidden, *args)
        finally:
            restore()



def _fsdp2_state(head: nn.Module):
    """The FSDP2 (``fully_shard``) state managing ``head`` as (a member of) its own unit, or None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed, or without FSDP2
        return None
    return head._get_fsdp_state() if isinstance(head, FSDPModule) else None


def _grouped_unit_refusal(head: nn.Module, why: str) -> str:
    return (f"the lm_head ({type(head).__name__}) shares its FSDP2 unit with other modules whose forward has "
            f"already run, and {why}: the gradients would be reduced before the unit's backward ends (a crash or "
            "a hang), "
            "or never. Run the op inside the model's forward instead, where FSDP2 sees it as the head's own "
            f"forward: {FUSED_LINEAR_ON_MODEL}(model, input_ids, attention_mask, logits_to_keep, loss_fn), after "
            "dgpo_ops.distributed.head.add_hidden_state_output(model) (DGPOTrainer's route)")


@contextlib.contextmanager
def _unit_forward_continued(head: nn.Module):
    """Around ``head(...)``: when the head shares an FSDP2 unit with other modules and that unit is idle
    (its forward has ended, its backward not begun: ``fused_linear_dgpo_loss(hidden, model.lm_head, ...)``
    after the model's forward), FSDP2 is put back into the unit's forward with the head as the one module
    left to run, so the call completes that forward as the head's own call would have: the unit is
    gathered if it resharded, the call's outputs get the pre-backward hook that gathers it again for the
    backward, and the gradients are reduced once, where FSDP2 reduces them for the model's forward (see
    the module docstring). Yields the unit's parameter groups, or ``()`` where FSDP2's own hooks already
    do the right thing: no FSDP2; the head its own unit (the call is that unit's whole forward);
    the unit mid-forward (inside the model's forward, ``fused_linear_on_model``)."""
    state = _fsdp2_state(head)
    if state is None or len(getattr(state, "_modules", ())) <= 1:
        yield ()
        return
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        groups = (list(state._fsdp_param_groups) if hasattr(state, "_fsdp_param_groups")
                  else [state._fsdp_param_group])  # older torch: one group per state
        groups = [group for group in groups if group is not None]
        modules_to_run = state._modules_to_run_forward
        idle = (state._training_state == TrainingState.IDLE
                and all(group._training_state == TrainingState.IDLE for group in groups))
    except (ImportError, AttributeError) as error:
        raise ValueError(_grouped_unit_refusal(head, "this torch's FSDP2 does not expose the unit's training "
                                                     f"state the call needs ({error})")) from error
    if not idle or not groups:
        yield ()
        return
    # The unit's forward, with the head the module left to run: the pre-forward hook then skips what only the
    # first module of a forward does (the post-backward hook on the unit's input: FSDP2 registered it when the
    # unit's forward began), and the head's post-forward hook finishes the forward (reshard if the unit does,
    # pre-backward hook on the outputs).
    state._training_state = TrainingState.FORWARD
    for group in groups:
        group._training_state = TrainingState.FORWARD
    modules_to_run.clear()
    modules_to_run.add(head)
    try:
        yield groups
    finally:
        if state._training_state == TrainingState.FORWARD:  # the call raised before its post-forward hook ran
            modules_to_run.clear()
            state._training_state = TrainingState.IDLE
            for group in groups:
                if group._training_state == TrainingState.FORWARD:
                    group._training_state = TrainingState.IDLE


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

    # The model's own signature, as TRL's fused head keeps it: generate() checks its keyword arguments
    # (attention_mask, pixel_values, token_type_ids, ...) against it when prepare_inputs_for_generation
    # takes **kwargs (NemotronH, Gemma3's vision-language model). A __signature__, not a __wrapped__:
    # accelerate's unwrap_model(keep_fp32_wrapper=False) follows __wrapped__ past this forward.
    forward.__signature__ = inspect.signature(type(model).forward)
    model.forward = types.MethodType(forward, model)


def fused_linear_on_model(model, input_ids, attention_mask, logits_to_keep, loss_fn, **model_kwargs):
    """``loss_fn(hidden, weight, bias)`` on the completion positions' hidden states, run as the
    lm_head's forward inside ``model``'s (wrapped) forward; returns what ``loss_fn`` returns (a tuple
    of tensors). ``model`` has had ``add_hidden_state_output``. ``model_kwargs`` go to the backbone
    (a vision-language model's ``pixel_values``, ``image_grid_thw``, ...; an MoE's ``output_router_logits``)."""
    def on_hidden(hidden, head):
        return head_forward(head, loss_fn, hidden[:, -logits_to_keep - 1 : -1])

    return model(input_ids=input_ids, attention_mask=attention_mask, dgpo_head_fn=on_hidden, **model_kwargs)
