"""The loss of ``DGPOTrainer``: the method's objective on the fused ops, with everything else of TRL's loss.

The loss returned is already scaled for gradient accumulation, as TRL's is: the normaliser is the step normaliser
of the ``trl:<loss_type>`` row in TRL's spec (``dgpo_ops.frameworks.trl``: micro-batch size x accumulation steps,
or ``num_items_in_batch`` across processes for dapo), or of one of dgpo-ops' own aggregations over TRL's step.

Everything of TRL's loss that is not the method's objective is TRL's, in the same fused call: the entropy
bonus (a token mean, divided only by gradient accumulation; adaptive entropy control) as the op's entropy weights,
the high-entropy token mask (``top_entropy_quantile``) and the off-policy sequence mask
(``off_policy_mask_threshold``) on the current log-probs and entropies of the call's own first sweep
(``complete_batch``), vLLM's importance-sampling correction; and the MoE router's load-balancing loss. One call
per update: 3 GEMM passes over the lm_head for a token-local method without a mask, 4 otherwise
(``bench/passes.py``).
"""

from __future__ import annotations

import dataclasses

import torch
from trl import GRPOTrainer

from dgpo_ops.core.aggregation import aggregation_codes
from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.core.objective import entropy_weight_term
from dgpo_ops.frameworks import trl

from .advantages import per_token_advantages
from .model_call import MULTIMODAL_INPUTS, Head
from .trl_metrics import TRLMetrics


class FusedLoss(TRLMetrics):
    """A mixin of ``GRPOTrainer`` (``DGPOTrainer``'s): ``_compute_loss`` on the fused ops, and TRL's metrics
    of each call (its base, ``TRLMetrics``)."""

    def _init_loss(self, model_call, after_metrics_read) -> None:
        """``model_call(model, logits_to_keep, head_fn)``: the model call the loss runs on
        (``model_call.FusedModelCall`` of this trainer). ``after_metrics_read``: what else waits for the
        device's values of a training step, called right after the metrics' host read (the non-finite-gradient
        guard's report: no synchronisation of its own)."""
        # The entropy bonus is TRL's (a token mean, scaled only for accumulation), added by _compute_loss.
        self.loss_options = dataclasses.replace(self.args.loss_options(), entropy_coef=0.0)
        self._model_call, self._after_metrics_read = model_call, after_metrics_read

    def _loss_normalizer(self, inputs, mask, mode):
        """The denominator TRL's `_compute_loss` uses for this aggregation and loss_type, already including
        gradient accumulation (so the returned loss is GA-scaled, like TRL's), and the factor that turns the loss
        into TRL's `policy_loss` metric: the row's step normaliser over TRL's step (`dgpo_ops.frameworks.trl`)."""
        train = mode == "train"
        accumulation = self.current_gradient_accumulation_steps if train else 1
        aggregation = self.loss_options.aggregation
        row = trl.trainer_row(aggregation, *aggregation_codes(aggregation))
        step = trl.TrlStep(mask=mask, max_completion_length=self.max_completion_length,
                           num_items_in_batch=inputs.get("num_items_in_batch"), accumulation=accumulation,
                           window=accumulation / self.args.steps_per_generation if train else 1,
                           processes=self.accelerator.num_processes)
        return trl.trainer_normalizer(row, step)

    def _rollout_weights(self, inputs, mask):
        """vLLM's importance-sampling correction, as TRL multiplies the per-token loss by it, or None."""
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return inputs["importance_sampling_ratio"]
        return None

    def _off_policy_mask(self, inputs, advantages, old_logps, current_logps, mask):
        """TRL's off-policy sequence mask (``get_off_policy_mask``, DeepSeek-V3.2) on the current log-probs."""
        if current_logps is None:  # no old or sampling log-probs: the KL is 0 and every sequence is kept
            current_logps = torch.zeros(mask.shape, device=mask.device)
        old = current_logps if old_logps is None else old_logps
        sampling = inputs.get("sampling_per_token_logps", old)
        return self.get_off_policy_mask(per_token_advantages(advantages), current_logps, sampling, mask, self.off_policy_mask_threshold)

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
        needs_current = self.top_entropy_quantile < 1.0 or (self.off_policy_mask_threshold is not None
                                                              and off_policy_needs_logps)
        effective = {}  # the tokens the entropy bonus acts on (TRL's effective_mask)
        weights = self._rollout_weights(inputs, mask)
        if weights is not None:
            weights = weights.expand(mask.shape)
        batch = LossInputs(target_ids=targets, advantages=advantages, mask=scored, old_logps=old_logps,
                           ref_logps=ref_logps, rollout_weights=weights, loss_normalizer=normalizer,
                           scores=inputs.get("scores"))  # ResponseScores' (None where the loss reads none)

        def complete(current_logps=None, entropies=None) -> LossInputs:
            """The loss call's batch with TRL's masks on the current log-probs and entropies (from the call's own
            first sweep, where a mask needs them) and TRL's entropy bonus as entropy weights."""
            # TRL multiplies the policy term of each token by its masks. Every method's term is A times a weight,
            # so the masks multiply the advantages: exact for every method, also where the rollout weights do not
            # multiply the term (vespo folds vLLM's ratios into its sequence weight, as TRL does).
            keep = torch.ones_like(mask, dtype=torch.float32)
            entropy_mask = None
            if self.top_entropy_quantile < 1.0:
                entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
                keep = keep * entropy_mask
            if self.off_policy_mask_threshold is not None:
                keep = keep * self._off_policy_mask(inputs, advantages, old_logps, current_logps, mask)
            masked_advantages = advantages
            if entropy_mask is not None or self.off_policy_mask_threshold is not None:
                masked_advantages = per_token_advantages(advantages) * keep
            tokens = scored if entropy_mask is None else scored & entropy_mask
            effective["mask"] = tokens
            # TRL's bonus: coef x the mean entropy over the tokens it acts on, / accumulation only: weights of the
            # entropies outside the policy term's aggregation, in the same call (no pass of its own).
            entropy_weights = None
            if bonus_coef != 0.0:
                entropy_weights = tokens * (bonus_coef / (tokens.sum().clamp(min=1).float() * accumulation))
            effective["weights"] = entropy_weights
            return batch._replace(advantages=masked_advantages, entropy_weights=entropy_weights)

        def loss_terms(head: Head, _labels):
            """The loss on ``head``, one call: TRL's masks from the call's own first sweep where they need the
            current log-probs or entropies, the method's objective, TRL's entropy bonus."""
            out = head.loss(batch, self.loss_options, complete) if needs_current \
                else head.loss(complete(), self.loss_options)
            policy_loss = out.loss.detach()
            if bonus_coef != 0.0:  # TRL's policy_loss metric leaves the bonus out
                policy_loss = policy_loss - entropy_weight_term(out.entropy, effective["weights"], scored)
            return out.logps, out.entropy, out.loss, out.metrics.as_tensor(), policy_loss

        # GRPOTrainer's own chunking and slicing around the loss's call (the trainer's override of this method
        # would wrap the call in a log-prob call).
        call = self._model_call(model, logits_to_keep, loss_terms)
        _, _, aux_loss = GRPOTrainer._get_per_token_logps_and_entropies(
            self, call, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled, **{name: inputs.get(name) for name in MULTIMODAL_INPUTS})
        (logps, entropy, loss, stats, policy_loss), = call.results
        if self._entropy_bonus_enabled:
            self._entropy_bonus_bookkeeping(policy_loss * policy_loss_scale, entropy, effective["mask"], mode)
        if self.aux_loss_enabled:  # the policy loss is scaled for accumulation, so is this (TRL's)
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        method = self.loss_options.method
        self._log_loss_metrics(method, stats, logps, old_logps, advantages, mask, mode)
        if mode == "train":
            self._after_metrics_read()
        if method.name == "vespo":
            self._log_vespo_weights(method, inputs, logps, old_logps, advantages, mask, mode)
        return loss

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
