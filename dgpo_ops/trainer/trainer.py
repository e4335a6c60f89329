"""``DGPOTrainer``: TRL's ``GRPOTrainer`` whose policy loss (and log-probs) run on dgpo-ops' fused ops.

Only the loss changes: generation, rewards, ``num_iterations``, ``steps_per_generation``, gradient
accumulation, PEFT and checkpointing are GRPOTrainer's. The loss returned is already scaled for
gradient accumulation, as TRL's is: the aggregation's normaliser is chosen to reproduce TRL's for
the same ``loss_type`` (micro-batch size x accumulation steps, or ``num_items_in_batch`` across
processes for token_mean/dapo).
"""

from __future__ import annotations

import json
import os

import torch
from accelerate.utils import gather_object, is_peft_model
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer

from dgpo_ops.ops.backends import select_kernels
from dgpo_ops.api import fused_linear_logprobs, linear_loss_from_options, loss_from_options
from dgpo_ops.ops.linear import ProjectionOptions
from dgpo_ops.distributed.head import add_hidden_state_output, fused_linear_on_model
from dgpo_ops.core.inputs import LossBatch
from dgpo_ops.core.metrics import METRIC_NAMES
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.core.validation import raise_deferred_errors

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


def _logit_transform(config) -> tuple[float, float | None]:
    """(logit_scale, softcap) of a causal LM config, for the fused-linear path."""
    text_config = config.get_text_config()
    for name in ("lm_head_multiplier", "logits_scaling", "output_multiplier"):
        if getattr(text_config, name, None) is not None:
            raise ValueError(f"fused='linear' does not handle the model's {name}; use fused='logits'")
    logit_scale = getattr(text_config, "logit_scale", None)
    return (1.0 if logit_scale is None else float(logit_scale)), getattr(text_config, "final_logit_softcapping", None)


def _fused_adam(optimizer):
    """The torch Adam/AdamW behind accelerate's wrapper when every group is fused (it honours
    ``found_inf`` on the device), else None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) and all(g.get("fused") for g in inner.param_groups):
        return inner
    return None


class DGPOTrainer(GRPOTrainer):
    """Drop-in for ``GRPOTrainer``: ``DGPOTrainer(model, reward_funcs, args=DGPOConfig(policy_loss="dgpo"), ...)``."""

    def __init__(self, *args, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if getattr(config, "use_vllm", False):
            from .vllm_cpu import check_vllm_config
            check_vllm_config(config)  # server mode on CPU: a clear error before waiting for a server
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DGPOConfig):
            raise ValueError("DGPOTrainer needs args=DGPOConfig(...)")
        if self.use_vllm:
            from .vllm_cpu import install_cpu_weight_sync
            install_cpu_weight_sync(self)  # colocated vLLM on CPU: TRL's weight sync can't load into vLLM-CPU
        self.loss_options = self.args.loss_options()
        base = self.model.get_base_model() if is_peft_model(self.model) else self.model
        add_hidden_state_output(base)
        if self.ref_model is not None:
            add_hidden_state_output(self.ref_model)
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
        # Old-policy and reference log-probs through the same op as the loss: on-policy ratios are exactly 1.
        if compute_aux_loss or any(value is not None for value in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, att = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            targets = ids[:, -logits_to_keep:].masked_fill(att[:, -logits_to_keep:] == 0, -100)
            def logprobs(hidden, weight, bias):  # run as the lm_head's forward (dgpo_ops.distributed.head)
                return fused_linear_logprobs(hidden, weight, targets, bias=bias, temperature=self.temperature,
                                             logit_scale=self.projection_options.logit_scale,
                                             softcap=self.projection_options.softcap,
                                             memory_budget=self.projection_options.memory_budget,
                                             logits_on_chip=self.projection_options.logits_on_chip)

            # The same autocast as the loss: the old-policy log-probs of an unchanged policy then equal
            # the loss's own, and on-policy ratios are exactly 1 in bf16 runs too.
            with self.accelerator.autocast():
                lp, ent = fused_linear_on_model(model, ids, att, logits_to_keep, logprobs)
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    # ------------------------------------------------------------------ the loss

    def _loss_normalizer(self, inputs, mask, mode):
        """The denominator TRL's `_compute_loss` uses for this aggregation and loss_type, already
        including gradient accumulation (so the returned loss is GA-scaled, like TRL's)."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        batch_size = mask.size(0)
        aggregation = self.loss_options.aggregation
        if aggregation == "seq_mean_token_mean":
            return float(batch_size * accumulation)
        if aggregation == "seq_mean_token_sum_norm":
            return float(batch_size * self.max_completion_length * accumulation)
        if aggregation == "seq_sum_token_mean":
            return float(accumulation)
        if self.args.loss_type == "bnpo" and self.args.loss_aggregation is None:
            return mask.sum().clamp(min=1.0).float() * accumulation
        # dapo/cispo: tokens of the whole generation batch, per process and accumulation window
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0).float() / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return normalizer

    def _rollout_weights(self, inputs, advantages, per_token_old, mask):
        weights = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            weights = inputs["importance_sampling_ratio"]
        return weights

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        targets = completion_ids.masked_fill(mask == 0, -100)
        advantages = inputs["advantages"]
        old_logps = inputs.get("old_per_token_logps")
        ref_logps = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        rollout_weights = self._rollout_weights(inputs, advantages, old_logps, mask)
        if rollout_weights is not None and rollout_weights.shape != mask.shape:
            rollout_weights = rollout_weights.expand(mask.shape)
        normalizer = self._loss_normalizer(inputs, mask, mode)
        batch = LossBatch(targets, advantages, mask.bool(), old_logps, ref_logps, rollout_weights, normalizer)
        with self.accelerator.autocast():
            if self.args.fused == "linear":
                def policy_loss(hidden, weight, bias):
                    return linear_loss_from_options(hidden, weight, bias, batch, self.loss_options,
                                                          self.projection_options).tensors()

                out = PolicyLossOutput.from_tensors(
                    fused_linear_on_model(model, input_ids, attention_mask, logits_to_keep, policy_loss))
            else:
                logits = model(input_ids=input_ids, attention_mask=attention_mask,
                               logits_to_keep=logits_to_keep + 1).logits[:, :-1]
                out = loss_from_options(logits, batch, self.loss_options)
        self._log_loss_metrics(out.metrics, mask, mode)
        return out.loss

    def _log_loss_metrics(self, metrics, mask, mode):
        # Masked means reduced across processes as (sum, count), like TRL's global_masked_mean: one
        # vector, one reduction and one host read per step (TRL's logging reads its metrics too).
        count = mask.sum().float()
        names = list(LOGGED_METRICS) + (["kl_mean"] if self.beta != 0.0 else [])
        local = torch.cat([metrics.as_tensor() * count, count[None]])
        totals = self.accelerator.reduce(local, reduction="sum")
        every_mean = (totals[:-1] / totals[-1].clamp(min=1.0)).tolist()
        means = [every_mean[METRIC_NAMES.index(name)] for name in names]
        # The read above waited for this step's kernels: input errors they found on the device
        # (deferred validation) are raised now, and earlier optimizer steps skipped on the device are
        # reported, at no extra synchronisation.
        raise_deferred_errors()
        if mode == "train":
            self.report_skipped_steps()
        for name, value in zip(names, means):
            self._metrics[mode][LOGGED_METRICS.get(name, "kl")].append(value)
        low, high = means[names.index("ln_fraction")], means[names.index("hp_fraction")]
        self._metrics[mode]["clip_ratio/region_mean"].append(low + high)

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
