"""``DGPOTrainer``: TRL's ``GRPOTrainer`` whose policy loss (and log-probs) run on dgpo-ops' fused ops.

Only the loss changes: generation, rewards, ``num_iterations``, ``steps_per_generation``, gradient
accumulation, PEFT, vLLM importance sampling and checkpointing are GRPOTrainer's. The loss returned is
already scaled for gradient accumulation, as TRL's is: the aggregation's normaliser is chosen to
reproduce TRL's for the same ``loss_type`` (micro-batch size x accumulation steps, or
``num_items_in_batch`` across processes for token_mean/dapo).

Everything of TRL's loss that is not the method's objective is TRL's, on the fused ops' outputs: the
entropy bonus (a token mean, divided only by gradient accumulation; adaptive entropy control), the
high-entropy token mask (``top_entropy_quantile``), the off-policy sequence mask
(``off_policy_mask_threshold``), the MoE router's load-balancing loss, the multimodal inputs of a
vision-language model, ``cast_lm_head_to_fp32`` and TRL's metric names
(``tests/test_trainer_conformance.py`` compares each with ``GRPOTrainer``'s first update). The model is
called through ``GRPOTrainer._get_per_token_logps_and_entropies``, with ``_FusedModelCall`` in place of
the model: TRL slices every chunk and its multimodal inputs as it does for its own fused head, and the
call runs the backbone and the fused ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
from types import SimpleNamespace

import torch
from accelerate.utils import gather_object, is_peft_model
from dgpo_ops.kernels.interface import LOG_RATIO_CLAMP, Region
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from dgpo_ops.api import fused_linear_logprobs, linear_loss_from_options, loss_from_options
from dgpo_ops.core.inputs import LossBatch
from dgpo_ops.core.metrics import METRIC_NAMES
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.core.validation import raise_deferred_errors
from dgpo_ops.distributed.head import add_hidden_state_output, fused_linear_on_model
from dgpo_ops.methods import gspo
from dgpo_ops.methods.base import SequenceInputs
from dgpo_ops.methods.table import token_terms
from dgpo_ops.ops.backends import select_kernels
from dgpo_ops.ops.linear import ProjectionOptions

from .advantages import SmoothAdvantageStandardizer, prompt_key
from .config import DGPOConfig

DCPO_STATE_FILE = "dcpo_advantage_state.json"
logger = logging.get_logger(__name__)

# dgpo-ops metric -> the name logged (TRL's where the meaning is the same)
LOGGED_METRICS = {
    "ln_fraction": "clip_ratio/low_mean",
    "hp_fraction": "clip_ratio/high_mean",
    "lp_fraction": "clip_ratio/lp_mean",
    "hn_fraction": "clip_ratio/hn_mean",
    "dual_clip_fraction": "clip_ratio/dual_mean",
    "eur": "eur",
    "ratio_mean": "ratio_mean",
    "entropy_mean": "entropy",
}

# The keyword arguments after compute_aux_loss of GRPOTrainer._get_per_token_logps_and_entropies: the multimodal
# inputs TRL forwards to the model (pixel_values, image_grid_thw, token_type_ids, ...), whatever this TRL has.
_TRL_LOGPS_PARAMETERS = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
MULTIMODAL_INPUTS = tuple(_TRL_LOGPS_PARAMETERS[_TRL_LOGPS_PARAMETERS.index("compute_aux_loss") + 1:])


def _logit_transform(config) -> tuple[float, float | None]:
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


def _fused_adam(optimizer):
    """The torch Adam/AdamW behind accelerate's wrapper when every group is fused (it honours
    ``found_inf`` on the device), else None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) and all(g.get("fused") for g in inner.param_groups):
        return inner
    return None


def _trainer_config(config, model) -> DGPOConfig:
    """``args`` as ``DGPOTrainer`` runs it: None gives the defaults (as GRPOTrainer's ``args=None`` does), a plain
    ``GRPOConfig`` its fields (its ``loss_type`` then names the objective, as in TRL)."""
    if config is None:
        from trl.trainer.utils import get_config_model_id

        name = model if isinstance(model, str) else get_config_model_id(model.config)
        return DGPOConfig(f"{name.split('/')[-1]}-DGPO")
    if isinstance(config, DGPOConfig):
        return config
    if isinstance(config, GRPOConfig):
        return DGPOConfig.from_grpo_config(config)
    raise ValueError(f"DGPOTrainer needs args=DGPOConfig(...) or a GRPOConfig, got {type(config).__name__}")


def _load_balancing_loss(model, backbone_outputs, attention_mask) -> torch.Tensor:
    """The MoE router's load-balancing loss, as TRL's fused head computes it (Mixtral's function, which
    every MoE family shares), from the backbone's router logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    text_config = model.config.get_text_config()
    num_experts = getattr(text_config, "num_experts", None)
    if num_experts is None:
        num_experts = getattr(model, "num_experts", None) or text_config.num_local_experts
    return load_balancing_loss_func(backbone_outputs.router_logits, num_experts, text_config.num_experts_per_tok,
                                    attention_mask)


class _Head:
    """What the loss and log-probs of one call run on: the completion positions' hidden states and the
    lm_head's weight (``fused="linear"``, inside the head's own forward), or the model's logits."""

    def __init__(self, trainer: "DGPOTrainer", hidden=None, weight=None, bias=None, logits=None):
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

    def loss(self, batch: LossBatch, options: LossOptions) -> PolicyLossOutput:
        if self.logits is not None:
            return loss_from_options(self.logits, batch, options)
        with self._precision() as (hidden, weight, bias):
            return linear_loss_from_options(hidden, weight, bias, batch, options, self.trainer.projection_options)

    @torch.no_grad()
    def logprobs(self, targets) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (log p, entropy) of ``targets``, forward only (one GEMM pass on the linear path)."""
        if self.logits is not None:
            options = LossOptions.build("grpo", temperature=self.trainer.temperature)
            out = loss_from_options(self.logits.detach(), LossBatch(targets, torch.zeros(
                targets.shape, device=targets.device)), options)
            return out.logps, out.entropy
        projection = self.trainer.projection_options
        with self._precision() as (hidden, weight, bias):
            return fused_linear_logprobs(hidden, weight, targets, bias=bias, temperature=self.trainer.temperature,
                                         logit_scale=projection.logit_scale, softcap=projection.softcap,
                                         memory_budget=projection.memory_budget,
                                         logits_on_chip=projection.logits_on_chip)


class _FusedModelCall:
    """Passed as the model to ``GRPOTrainer._get_per_token_logps_and_entropies``, which slices each chunk's
    inputs (multimodal ones included) as for its own fused head and calls this with them and TRL's labels.
    The call runs the model to the completion positions and ``head_fn(_Head, targets)`` on them: inside the
    lm_head's forward (``fused_linear_on_model``) for ``fused="linear"``, on the model's logits otherwise.
    ``head_fn`` returns a tuple of tensors whose first two are the per-token log-probs and entropies."""

    def __init__(self, trainer: "DGPOTrainer", model, logits_to_keep: int, head_fn):
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
                    lambda hidden, weight, bias: self.head_fn(_Head(trainer, hidden, weight, bias), targets),
                    **model_inputs)
            else:
                with trainer._fp32_lm_head(self.model):
                    logits = self.model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep + 1,
                                        **model_inputs).logits[:, :-1]
                result = self.head_fn(_Head(trainer, logits=logits), targets)
        aux_loss = None
        if model_inputs.get("output_router_logits"):
            aux_loss = _load_balancing_loss(trainer._policy_base(), backbone[-1], attention_mask)
        self.results.append(result)
        return SimpleNamespace(log_probs=result[0], entropy=result[1], aux_loss=aux_loss)


class DGPOTrainer(GRPOTrainer):
    """Drop-in for ``GRPOTrainer``: ``DGPOTrainer(model, reward_funcs, args=DGPOConfig(policy_loss="dgpo"), ...)``.
    ``args`` may also be None (``DGPOConfig``'s defaults, which are ``GRPOConfig``'s) or a plain ``GRPOConfig``
    (its fields, its ``loss_type``'s objective)."""

    def __init__(self, *args, **kwargs):
        args = list(args)
        model = args[0] if args else kwargs.get("model")
        if len(args) > 2:
            args[2] = config = _trainer_config(args[2], model)
        else:
            kwargs["args"] = config = _trainer_config(kwargs.get("args"), model)
        if config.use_vllm:
            from .vllm_cpu import check_vllm_config
            check_vllm_config(config)  # server mode on CPU: a clear error before waiting for a server
        super().__init__(*args, **kwargs)
        if self.use_vllm:
            from .vllm_cpu import install_cpu_weight_sync
            install_cpu_weight_sync(self)  # colocated vLLM on CPU: TRL's weight sync can't load into vLLM-CPU
        # The entropy bonus is TRL's (a token mean, scaled only for accumulation), added by _compute_loss.
        self.loss_options = dataclasses.replace(self.args.loss_options(), entropy_coef=0.0)
        base = self._policy_base()
        add_hidden_state_output(base)
        if self.ref_model is not None:
            add_hidden_state_output(self.ref_model)
        # The backbone's outputs of the current call, for the MoE router's load-balancing loss.
        self._captured_backbone: list | None = None
        base.base_model.register_forward_hook(self._capture_backbone_output)
        logit_scale, softcap = _logit_transform(base.config) if self.args.fused == "linear" else (1.0, None)
        self.projection_options = ProjectionOptions(logit_scale=logit_scale, softcap=softcap,
                                                    memory_budget=self.args.fused_memory_budget,
                                                    logits_on_chip=self.args.fused_logits_on_chip)
        if self.args.fused_logits_on_chip:  # fail now, not at the first training step
            probe = torch.empty(0, device=self.accelerator.device)
            if select_kernels(self.loss_options.backend, probe).name != "triton":
                raise ValueError(f"fused_logits_on_chip=True runs Triton kernels, which this run on "
                                 f"{self.accelerator.device} does not use (CUDA, or TRITON_INTERPRET=1 with "
                                 "backend='triton' on the CPU)")
        self.smooth_advantages = SmoothAdvantageStandardizer() if self.args.advantage_estimator == "dcpo" else None
        self.nonfinite_skips = 0  # consecutive optimizer steps skipped for non-finite gradients
        self.skipped_steps: list[int] = []
        self.pending_step_checks: list = []  # (step, device index of the first bad gradient or -1, names)

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

    # ------------------------------------------------------------------ non-finite gradients

    def _nonfinite_gradients(self, model):
        """(names, device bool per gradient: not finite), taken before clipping: clipping by a NaN
        norm turns every gradient NaN and would hide which parameter it came from. One
        ``_foreach_norm`` pass over the gradients per optimizer step."""
        named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        if not named or len({grad.device for _, grad in named}) != 1:
            return None
        per_tensor = torch.stack(torch._foreach_norm([grad for _, grad in named]))
        return [name for name, _ in named], ~torch.isfinite(per_tensor)

    def _clip_grad_norm(self, model):
        if self.accelerator.scaler is None:
            self._gradient_check = self._nonfinite_gradients(model)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        """Every optimizer step: a step whose gradients are not finite is skipped, so parameters and
        optimizer moments stay as they were and the next generation never samples from NaN.

        With a fused torch Adam/AdamW (``optim="adamw_torch_fused"``, the default with torch >= 2.8)
        the skip happens on the device, through the optimizer's ``found_inf`` flag (as GradScaler
        does), and the index of the first parameter with a non-finite gradient is kept on the
        device: both are read at the next step's metrics read, which TRL's logging does anyway, so
        the guard adds no host synchronisation. Other optimizers get a host read of the pre-clip
        norm (the value TRL logs as grad_norm) per optimizer step, and the gradients are dropped.
        Under a GradScaler (fp16) the scaler skips such steps itself."""
        grad_norm = super()._get_grad_norm(model, grad_norm)
        check, self._gradient_check = getattr(self, "_gradient_check", None), None
        if self.accelerator.scaler is not None:
            return grad_norm
        if check is None:  # max_grad_norm = 0: nothing was clipped, the gradients are as they came
            check = self._nonfinite_gradients(model)
        step = self.state.global_step + 1
        optimizer = _fused_adam(self.optimizer)
        if optimizer is not None and check is not None:
            names, bad = check
            optimizer.found_inf = bad.any().float()
            self.pending_step_checks.append((step, torch.where(bad.any(), bad.int().argmax(), -1), names))
            return grad_norm
        norm = grad_norm if torch.is_tensor(grad_norm) else torch.tensor(float(grad_norm))
        if bool(torch.isfinite(norm)):  # a host read per step: optimizers that cannot skip on the device
            self._count_step(step, None)
            return grad_norm
        first = "(unknown: gradients on several devices)"
        if check is not None:
            names, bad = check
            first = names[int(bad.int().argmax())] if bool(bad.any()) else "(none: the total norm overflowed)"
        model.zero_grad(set_to_none=True)  # optimizers skip parameters without a gradient
        self._count_step(step, first)
        return grad_norm

    def report_skipped_steps(self) -> None:
        """Warn about the steps skipped on the device since the last call (a host read of values the
        device has computed by now) and stop the run after too many in a row."""
        if not self.pending_step_checks:
            return
        firsts = torch.stack([first for _, first, _ in self.pending_step_checks]).tolist()
        checks, self.pending_step_checks = self.pending_step_checks, []
        for (step, _, names), first in zip(checks, firsts):
            self._count_step(step, None if first < 0 else names[first])

    def _count_step(self, step: int, first_nonfinite: str | None) -> None:
        if first_nonfinite is None:
            self.nonfinite_skips = 0
            return
        self.nonfinite_skips += 1
        self.skipped_steps.append(step)
        limit = self.args.max_nonfinite_steps
        logger.warning(f"DGPOTrainer: step {step} skipped: non-finite gradient, first in {first_nonfinite} "
                       f"({self.nonfinite_skips} in a row; the run stops after {limit})")
        if self.nonfinite_skips >= limit:
            raise RuntimeError(
                f"DGPOTrainer: {self.nonfinite_skips} consecutive optimizer steps had non-finite gradients "
                f"(last at step {step}, first in {first_nonfinite}); stopping. Lower the learning rate, train in "
                "fp32 (bf16=False), or raise DGPOConfig.max_nonfinite_steps")

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        self.report_skipped_steps()  # the last steps' checks
        return result

    # ------------------------------------------------------------------ per-token log-probs

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        # Old-policy and reference log-probs through the same op, autocast and precision as the loss: the
        # on-policy ratios of an unchanged policy are exactly 1. TRL chunks the batch and slices the multimodal
        # inputs; _FusedModelCall runs each chunk.
        call = _FusedModelCall(self, model, logits_to_keep, lambda head, targets: head.logprobs(targets))
        return super()._get_per_token_logps_and_entropies(call, input_ids, attention_mask, logits_to_keep, batch_size,
                                                          compute_entropy, compute_aux_loss, **multimodal)

    # ------------------------------------------------------------------ the loss

    def _loss_normalizer(self, inputs, mask, mode):
        """The denominator TRL's `_compute_loss` uses for this aggregation and loss_type, already
        including gradient accumulation (so the returned loss is GA-scaled, like TRL's), and the factor
        that turns the loss into TRL's `policy_loss` metric (TRL logs it before dividing by the
        accumulation steps, except for the loss types normalised by `num_items_in_batch`)."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        batch_size = mask.size(0)
        aggregation = self.loss_options.aggregation
        trl_aggregation = self.args.loss_aggregation is None
        if aggregation == "seq_mean_token_mean":
            return float(batch_size * accumulation), accumulation
        if aggregation == "seq_mean_token_sum_norm":
            length = 1 if self.args.loss_type == "luspo" and trl_aggregation else self.max_completion_length
            return float(batch_size * length * accumulation), accumulation
        if aggregation == "seq_sum_token_mean":
            return float(accumulation), accumulation
        if aggregation == "seq_mean_token_sum":  # TRL's luspo, where the aggregations have it
            return float(batch_size * accumulation), accumulation
        if self.args.loss_type == "bnpo" and trl_aggregation:
            return mask.sum().clamp(min=1.0).float() * accumulation, accumulation
        # dapo/cispo: tokens of the whole generation batch, per process and accumulation window
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0).float() / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return normalizer, 1

    def _rollout_weights(self, inputs, mask):
        """vLLM's importance-sampling correction, as TRL multiplies the per-token loss by it, or None."""
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return inputs["importance_sampling_ratio"]
        return None

    def _off_policy_mask(self, inputs, advantages, old_logps, current_logps, mask):
        """TRL's off-policy sequence mask (``get_off_policy_mask``, DeepSeek-V3.2) on the current log-probs."""
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        if current_logps is None:  # no old or sampling log-probs: the KL is 0 and every sequence is kept
            current_logps = torch.zeros(mask.shape, device=mask.device)
        old = current_logps if old_logps is None else old_logps
        sampling = inputs.get("sampling_per_token_logps", old)
        return self.get_off_policy_mask(advantages, current_logps, sampling, mask, self.off_policy_mask_threshold)

    def _entropy_bonus_coef(self) -> float:
        """TRL's coefficient of the entropy bonus for this step (adaptive: applied only at or below the target,
        from the entropy of the previous optimizer step)."""
        if not self._entropy_bonus_enabled:
            return 0.0
        if self.use_adaptive_entropy:
            return self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        return self.entropy_coef

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        scored = mask.bool()
        targets = completion_ids.masked_fill(~scored, -100)
        advantages = inputs["advantages"]
        old_logps = inputs.get("old_per_token_logps")
        ref_logps = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        normalizer, policy_loss_scale = self._loss_normalizer(inputs, mask, mode)
        bonus_coef = self._entropy_bonus_coef()
        off_policy_needs_logps = old_logps is not None or "sampling_per_token_logps" in inputs
        effective = {}  # the tokens the entropy bonus acts on (TRL's effective_mask)

        def loss_terms(head: _Head, _labels):
            """The loss on ``head``: TRL's masks on the current log-probs and entropies (one forward-only pass
            first, when a mask needs them), the method's objective, TRL's entropy bonus."""
            current = None
            if self.top_entropy_quantile < 1.0 or (self.off_policy_mask_threshold is not None and off_policy_needs_logps):
                current = head.logprobs(targets)
            # TRL multiplies the policy term of each token by its masks. Every method's term is A times a weight,
            # so the masks multiply the advantages: exact for every method, also where the rollout weights do not
            # multiply the term (vespo folds vLLM's ratios into its sequence weight, as TRL does).
            keep = torch.ones_like(mask, dtype=torch.float32)
            entropy_mask = None
            if self.top_entropy_quantile < 1.0:
                entropy_mask = self.get_high_entropy_mask(current[1], mask, 1 - self.top_entropy_quantile)
                keep = keep * entropy_mask
            if self.off_policy_mask_threshold is not None:
                keep = keep * self._off_policy_mask(inputs, advantages, old_logps,
                                                    None if current is None else current[0], mask)
            masked_advantages = advantages
            if entropy_mask is not None or self.off_policy_mask_threshold is not None:
                masked_advantages = (advantages[:, None] if advantages.dim() == 1 else advantages) * keep
            weights = self._rollout_weights(inputs, mask)
            if weights is not None:
                weights = weights.expand(mask.shape)
            batch = LossBatch(targets, masked_advantages, scored, old_logps, ref_logps, weights, normalizer)
            out = head.loss(batch, self.loss_options)
            loss = out.loss
            effective["mask"] = scored if entropy_mask is None else scored & entropy_mask
            if bonus_coef != 0.0:
                # TRL's bonus: coef x the mean entropy over the tokens it acts on, / accumulation only. A second
                # fused call whose objective is zero (advantages 0): only its entropy term has a gradient.
                tokens = effective["mask"]
                bonus = head.loss(LossBatch(targets.masked_fill(~tokens, -100), torch.zeros_like(advantages), tokens,
                                            loss_normalizer=tokens.sum().clamp(min=1).float() * accumulation),
                                  self._bonus_options(bonus_coef))
                loss = loss + bonus.loss
            return out.logps, out.entropy, loss, out.metrics.as_tensor(), out.loss.detach()

        call = _FusedModelCall(self, model, logits_to_keep, loss_terms)
        _, _, aux_loss = super()._get_per_token_logps_and_entropies(
            call, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled, **{name: inputs.get(name) for name in MULTIMODAL_INPUTS})
        (logps, entropy, loss, stats, policy_loss), = call.results
        if self._entropy_bonus_enabled:
            self._entropy_bonus_bookkeeping(policy_loss * policy_loss_scale, entropy, effective["mask"], mode)
        if self.aux_loss_enabled:  # the policy loss is scaled for accumulation, so is this (TRL's)
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._log_loss_metrics(stats, logps, old_logps, advantages, mask, mode)
        if self.loss_options.method.name == "vespo":
            self._log_vespo_weights(inputs, logps, old_logps, advantages, mask, mode)
        return loss

    @torch.no_grad()
    def _log_vespo_weights(self, inputs, logps, old_logps, advantages, mask, mode):
        """TRL's ``vespo/phi_seq_mean``: its own gamma weights (``get_gamma_weights``) of the current log-probs,
        averaged over the sequences of every process."""
        method = self.loss_options.method
        log_ratio = logps - (logps if old_logps is None else old_logps)
        phi = self.get_gamma_weights(
            advantages.unsqueeze(1) if advantages.dim() == 1 else advantages, log_ratio, mask,
            inputs.get("importance_sampling_ratio"), k_pos=method.k_pos, lambda_pos=method.lambda_pos,
            k_neg=method.k_neg, lambda_neg=method.lambda_neg)
        totals = self.accelerator.reduce(torch.stack([phi.sum(), torch.tensor(float(phi.numel()), device=phi.device)]),
                                         reduction="sum")
        self._metrics[mode]["vespo/phi_seq_mean"].append((totals[0] / totals[1].clamp(min=1.0)).item())

    def _bonus_options(self, coef: float) -> LossOptions:
        """The entropy bonus's call: a zero objective (grpo at advantage 0), token mean, ``entropy_coef=coef``."""
        from dgpo_ops.methods.table import method_config

        return dataclasses.replace(self.loss_options, method=method_config("grpo"), aggregation="token_mean",
                                   beta=0.0, kl_ratio_correction=False, entropy_coef=coef,
                                   importance_sampling_level="token")

    def _entropy_bonus_bookkeeping(self, policy_loss, entropies, effective_mask, mode):
        """TRL's metrics and adaptive entropy control of the entropy bonus, as its ``_compute_loss`` keeps them."""
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            effective_mask = effective_mask.float()
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            self._entropy_window_stats = stats if self._entropy_window_stats is None \
                else self._entropy_window_stats + stats
            if self.accelerator.sync_gradients:
                window_stats = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (window_stats[0] / window_stats[1].clamp(min=1.0)).item()
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    @torch.no_grad()
    def _clip_fractions(self, logps, old_logps, advantages, scored):
        """Per sequence, the fraction of its scored tokens below the trust region with A < 0 (the method's ln
        region: TRL's ``is_low_clipped``) and above it with A > 0 (hp: ``is_high_clipped``), NaN for a sequence
        without any (TRL's ``masked_seq_mean``); and each sequence's weight in TRL's global mean: its token count,
        or 1 under ``importance_sampling_level="sequence"`` (TRL's (B, 1) ratios)."""
        logp = torch.where(scored, logps, 0.0)
        old = logp if old_logps is None else torch.where(scored, old_logps.to(logp.dtype), 0.0)
        log_ratio = logp - old
        sequence_level = self.args.importance_sampling_level == "sequence"  # TRL's coef_1
        if sequence_level:
            log_ratio = gspo.mean_log_ratio(self.loss_options.method, SequenceInputs(log_ratio, None, scored, None))
        delta = getattr(self.loss_options.method, "delta", None)
        if delta is not None:  # TRL's metrics read the ratio its two-sided clip capped
            log_ratio = log_ratio.clamp(max=math.log(delta))
        adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logp.dtype).expand_as(logp)
        # (a batch-level selection draws nothing here: the regions TRL's metrics read are PPO's)
        region = token_terms(self.loss_options.method, log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), adv, old,
                             logp=logp, scored=torch.zeros_like(scored)).region
        counts = scored.sum(-1).float()
        low = ((region == Region.LN.value) & scored).sum(-1) / counts
        high = ((region == Region.HP.value) & scored).sum(-1) / counts
        if sequence_level:  # TRL's ratio of a sequence without tokens is 1: not clipped
            return low.nan_to_num(0.0), high.nan_to_num(0.0), torch.ones_like(counts)
        return low, high, counts

    def _log_loss_metrics(self, stats, logps, old_logps, advantages, mask, mode):
        """TRL's metrics under TRL's names and definitions, ours beside them. The masked means are reduced
        across processes as (sum, count) in one vector, like TRL's global_masked_mean: one reduction and
        one host read (TRL's logging reads its metrics too), and one gather for the per-sequence extremes."""
        scored = mask.bool()
        count = scored.sum().float()
        low, high, weights = self._clip_fractions(logps, old_logps, advantages, scored)
        clip_sums = torch.stack([(low * weights).nansum(), (high * weights).nansum(), weights.sum()])
        local = torch.cat([stats * count, count[None], clip_sums])
        totals = self.accelerator.reduce(local, reduction="sum").tolist()
        n = len(METRIC_NAMES)
        means = {name: totals[i] / max(totals[n], 1.0) for i, name in enumerate(METRIC_NAMES)}
        low_mean, high_mean = totals[n + 1] / max(totals[n + 3], 1.0), totals[n + 2] / max(totals[n + 3], 1.0)
        # The read above waited for this step's kernels: input errors they found on the device
        # (deferred validation) are raised now, and earlier optimizer steps skipped on the device are
        # reported, at no extra synchronisation.
        raise_deferred_errors()
        if mode == "train":
            self.report_skipped_steps()
        metrics = self._metrics[mode]
        for name, logged in LOGGED_METRICS.items():
            metrics[logged].append(means[name])
        if self.beta != 0.0:
            metrics["kl"].append(means["kl_mean"])
        metrics["clip_ratio/low_mean"][-1] = low_mean  # TRL's: per sequence under sequence-level ratios
        metrics["clip_ratio/high_mean"][-1] = high_mean
        metrics["clip_ratio/region_mean"].append(low_mean + high_mean)
        metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(low)).item())
        metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(high)).item())
        if self.loss_options.method.name == "cispo":  # TRL's CISPO metric: weights at the cap, A > 0
            metrics["cispo_clip_ratio"].append(high_mean)

    # ------------------------------------------------------------------ DCPO advantages

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._scored_prompts = prompts
        self._rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.smooth_advantages is not None and self.model.training:
            output["advantages"] = self._smooth_advantages().to(output["advantages"].device)
        return output

    def _smooth_advantages(self) -> torch.Tensor:
        rewards_per_func = self._rewards_per_func
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        rewards = torch.nan_to_num((rewards_per_func * weights).nansum(dim=1), nan=0.0)
        # Every process sees the same gathered rewards and keys, so every standardiser stays identical.
        keys = gather_object([prompt_key(json.dumps(p, sort_keys=True, default=str)) for p in self._scored_prompts])
        advantages = self.smooth_advantages(keys, rewards.float(), self.num_generations)
        advantages = advantages.masked_fill(unscorable, 0.0)
        local = len(self._scored_prompts)
        start = self.accelerator.process_index * local
        return advantages[start:start + local]

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.smooth_advantages is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, DCPO_STATE_FILE), "w") as f:
                json.dump(self.smooth_advantages.state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.smooth_advantages is not None and checkpoint is not None:
            path = os.path.join(checkpoint, DCPO_STATE_FILE)
            if os.path.exists(path):
                with open(path) as f:
                    self.smooth_advantages.load_state_dict(json.load(f))
