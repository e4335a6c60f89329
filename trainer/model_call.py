"""How ``DGPOTrainer`` calls the model: the backbone, then the fused ops on the completion positions.

The model is called through ``GRPOTrainer._get_per_token_logps_and_entropies``, with ``FusedModelCall`` in
place of the model: TRL slices every chunk and its multimodal inputs as it does for its own fused head, and
the call runs the backbone and the fused ops (``Head``) on its outputs. ``FusedModelCalls`` is the trainer's
side of it: the policy's hooks, ``cast_lm_head_to_fp32``, the logit transform of the fused-linear path, and
the old-policy and reference log-probs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from types import SimpleNamespace

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer

from dgpo_ops.api import policy_loss
from dgpo_ops.core.call import PROJECTION_OPTIONS
from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.distributed.head import add_hidden_state_output, fused_linear_on_model
from dgpo_ops.ops.backends import select_kernels

# The keyword arguments after compute_aux_loss of GRPOTrainer._get_per_token_logps_and_entropies: the multimodal
# inputs TRL forwards to the model (pixel_values, image_grid_thw, token_type_ids, ...), whatever this TRL has.
_TRL_LOGPS_PARAMETERS = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
MULTIMODAL_INPUTS = tuple(_TRL_LOGPS_PARAMETERS[_TRL_LOGPS_PARAMETERS.index("compute_aux_loss") + 1:])


def logit_transform(config) -> tuple[float, float | None]:
    """(logit_scale, softcap) of a causal LM config for the fused-linear path, read as TRL's fused head reads them:
    ``logit_scale`` (Cohere), else ``output_multiplier``, else ``lm_head_multiplier`` (Falcon-H1), else
    ``1 / logits_scaling`` (Granite, MiniCPM3; HyperCLOVA X multiplies by it); ``final_logit_softcapping``."""
    text_config = config.get_text_config()
    logit_scale = getattr(text_config, "logit_scale", None)
    if logit_scale is None:
        logit_scale = getattr(text_config, "output_multiplier", None)
    if logit_scale is None:
        logit_scale = getattr(text_config, "lm_head_multiplier", None)
    if logit_scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        logit_scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return (1.0 if logit_scale is None else float(logit_scale)), getattr(text_config, "final_logit_softcapping", None)


def load_balancing_loss(model, backbone_outputs, attention_mask) -> torch.Tensor:
    """The MoE router's load-balancing loss, as TRL's fused head computes it (Mixtral's function, which
    every MoE family shares), from the backbone's router logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    text_config = model.config.get_text_config()
    num_experts = getattr(text_config, "num_experts", None)
    if num_experts is None:
        num_experts = getattr(model, "num_experts", None) or text_config.num_local_experts
    return load_balancing_loss_func(backbone_outputs.router_logits, num_experts, text_config.num_experts_per_tok,
                                    attention_mask)


class Head:
    """What the loss and log-probs of one call run on: the completion positions' hidden states and the
    lm_head's weight (``fused="linear"``, inside the head's own forward), or the model's logits."""

    def __init__(self, trainer, hidden=None, weight=None, bias=None, logits=None):
        self.trainer, self.hidden, self.weight, self.bias, self.logits = trainer, hidden, weight, bias, logits
        self.fp32 = trainer.args.cast_lm_head_to_fp32 and logits is None

    @contextlib.contextmanager
    def _precision(self):
        """``cast_lm_head_to_fp32``: the projection in fp32 whatever the autocast, as TRL's fused head runs it."""
        if not self.fp32:
            yield self.hidden, self.weight, self.bias
            return
        with torch.autocast(self.hidden.device.type, enabled=False):
            yield self.hidden.float(), self.weight.float(), None if self.bias is None else self.bias.float()

    def loss(self, batch: LossInputs, options: LossOptions, complete_batch=None) -> PolicyLossOutput:
        """The loss of ``batch``; ``complete_batch(logps, entropies)`` (``dgpo_ops.ops.linear.CompleteBatch``): the
        batch from the current log-probs and entropies, which the fused-linear op makes in its own first sweep
        (the logits path reads them off the logits, a forward of the row kernels only)."""
        if self.logits is not None:
            if complete_batch is not None:
                batch = complete_batch(*self.logprobs(batch.target_ids))
            return policy_loss(batch, options, logits=self.logits)
        with self._precision() as (hidden, weight, bias):
            return policy_loss(batch, options, hidden=hidden, weight=weight, bias=bias, complete_batch=complete_batch)

    @torch.no_grad()
    def logprobs(self, targets) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (log p, entropy) of ``targets``, forward only (one GEMM pass on the linear path): the loss
        call's own options with grpo's objective, which the log-probs do not read."""
        batch = LossInputs(targets, torch.zeros(targets.shape, device=targets.device))
        options = self.trainer.logprob_options
        if self.logits is not None:
            out = policy_loss(batch, options, logits=self.logits.detach())
            return out.logps, out.entropy
        with self._precision() as (hidden, weight, bias):
            out = policy_loss(batch, options, hidden=hidden, weight=weight, bias=bias)
        return out.logps, out.entropy


class FusedModelCall:
    """Passed as the model to ``GRPOTrainer._get_per_token_logps_and_entropies``, which slices each chunk's
    inputs (multimodal ones included) as for its own fused head and calls this with them and TRL's labels.
    The call runs the model to the completion positions and ``head_fn(Head, targets)`` on them: inside the
    lm_head's forward (``fused_linear_on_model``) for ``fused="linear"``, on the model's logits otherwise.
    ``head_fn`` returns a tuple of tensors whose first two are the per-token log-probs and entropies."""

    def __init__(self, trainer, model, logits_to_keep: int, head_fn):
        self.trainer, self.model, self.logits_to_keep, self.head_fn = trainer, model, logits_to_keep, head_fn
        self.results: list[tuple] = []

    def __call__(self, labels=None, fused_lm_head=True, **model_inputs):
        trainer, keep = self.trainer, self.logits_to_keep
        targets = labels[:, -keep:]
        input_ids, attention_mask = model_inputs.pop("input_ids"), model_inputs.pop("attention_mask")
        with trainer._backbone_outputs(model_inputs.get("output_router_logits", False)) as backbone:
            if trainer.args.fused == "linear":
                result = fused_linear_on_model(
                    self.model, input_ids, attention_mask, keep,
                    lambda hidden, weight, bias: self.head_fn(Head(trainer, hidden, weight, bias), targets),
                    **model_inputs)
            else:
                with trainer._fp32_lm_head(self.model):
                    logits = self.model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep + 1,
                                        **model_inputs).logits[:, :-1]
                result = self.head_fn(Head(trainer, logits=logits), targets)
        aux_loss = None
        if model_inputs.get("output_router_logits"):
            aux_loss = load_balancing_loss(trainer._policy_base(), backbone[-1], attention_mask)
        self.results.append(result)
        return SimpleNamespace(log_probs=result[0], entropy=result[1], aux_loss=aux_loss)


class FusedModelCalls:
    """``DGPOTrainer``'s model calls (a mixin of ``GRPOTrainer``): the old-policy and reference log-probs
    through ``FusedModelCall``, and what such a call needs of the trainer."""

    def _init_model_calls(self, options: LossOptions) -> LossOptions:
        """After ``GRPOTrainer.__init__``: the hidden-state outputs and the backbone hook on the models; returns the
        loss ``options`` with the projection of ``fused="linear"`` (the model's logit scale and softcap, the
        config's memory budget and on-chip choice), and sets the options of the log-prob calls."""
        base = self._policy_base()
        add_hidden_state_output(base)
        if self.ref_model is not None:
            add_hidden_state_output(self.ref_model)
        # The backbone's outputs of the current call, for the MoE router's load-balancing loss.
        self._captured_backbone: list | None = None
        base.base_model.register_forward_hook(self._capture_backbone_output)
        if self.args.fused == "linear":
            logit_scale, softcap = logit_transform(base.config)
            options = dataclasses.replace(options, logit_scale=logit_scale, softcap=softcap,
                                          memory_budget=self.args.fused_memory_budget,
                                          logits_on_chip=self.args.fused_logits_on_chip)
        # the log-probs read no objective: grpo's, plain, on the loss call's projection, kernels and checks
        self.logprob_options = LossOptions.build(
            "grpo", temperature=options.temperature, backend=options.backend, validation=options.validation,
            **{name: getattr(options, name) for name in PROJECTION_OPTIONS})
        if self.args.fused_logits_on_chip:  # fail now, not at the first training step
            probe = torch.empty(0, device=self.accelerator.device)
            if select_kernels(options.backend, probe).name != "triton":
                raise ValueError(f"fused_logits_on_chip=True runs Triton kernels, which this run on "
                                 f"{self.accelerator.device} does not use (CUDA, or TRITON_INTERPRET=1 with "
                                 "backend='triton' on the CPU)")
        return options

    def _policy_base(self):
        """The policy's transformers model (under a PEFT wrapper, its base model)."""
        return self.model.get_base_model() if is_peft_model(self.model) else self.model

    def _capture_backbone_output(self, module, args, output):
        if self._captured_backbone is not None:
            self._captured_backbone.append(output)

    @contextlib.contextmanager
    def _backbone_outputs(self, capture: bool):
        """Collect the policy backbone's outputs of the calls inside (when ``capture``)."""
        if not capture:
            yield None
            return
        self._captured_backbone = captured = []
        try:
            yield captured
        finally:
            self._captured_backbone = None

    @contextlib.contextmanager
    def _fp32_lm_head(self, model):
        """``cast_lm_head_to_fp32`` on the logits path: the model's lm_head (TRL made it fp32) runs outside
        the autocast, as TRL's fused head does; during the loss and log-prob calls only (generation stays TRL's)."""
        head = self.accelerator.unwrap_model(model).get_output_embeddings() if self.args.cast_lm_head_to_fp32 else None
        if head is None:
            yield
            return
        had_own, own = "forward" in head.__dict__, head.__dict__.get("forward")
        forward = head.forward

        def fp32_forward(hidden, *args, **kwargs):
            with torch.autocast(hidden.device.type, enabled=False):
                return forward(hidden.float(), *args, **kwargs)

        head.forward = fp32_forward
        try:
            yield
        finally:
            if had_own:
                head.forward = own
            else:
                del head.forward

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        # Old-policy and reference log-probs through the same op, autocast and precision as the loss: the
        # on-policy ratios of an unchanged policy are exactly 1. TRL chunks the batch and slices the multimodal
        # inputs; FusedModelCall runs each chunk.
        call = FusedModelCall(self, model, logits_to_keep, lambda head, targets: head.logprobs(targets))
        return super()._get_per_token_logps_and_entropies(call, input_ids, attention_mask, logits_to_keep, batch_size,
                                                          compute_entropy, compute_aux_loss, **multimodal)
