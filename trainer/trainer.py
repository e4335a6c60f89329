"""``DGPOTrainer``: TRL's ``GRPOTrainer`` whose policy loss (and log-probs) run on dgpo-ops' fused ops.

Only the loss changes: generation, rewards, ``num_iterations``, ``steps_per_generation``, gradient
accumulation, PEFT, vLLM importance sampling and checkpointing are GRPOTrainer's. The trainer is
``GRPOTrainer`` with one mixin per concern, each in its own module:

* ``loss.FusedLoss``: ``_compute_loss``, the method's objective on the fused ops and the rest of TRL's loss
  (its normalisers, masks, entropy bonus and the MoE router's load-balancing loss), and TRL's metric names
  and definitions for each call (its base, ``trl_metrics.TRLMetrics``;
  ``tests/trainer/test_trainer_conformance.py`` compares each with ``GRPOTrainer``'s first update);
* ``model_call.FusedModelCalls``: how the model is called (the backbone, then the fused ops on the
  completion positions, through TRL's own chunking and multimodal slicing), and the old-policy and
  reference log-probs through the same ops;
* ``gradient_guard.NonfiniteGradientGuard``: an optimizer step with non-finite gradients is skipped;
* ``scores.ResponseScores``: the rewards of each generation batch, each response's score in the loss's inputs
  where the loss reads it (topr, the positive-example NLL), and DCPO's smooth advantages from the same scores
  with their checkpointed state.

No two mixins override the same method (``tests/trainer/test_trainer_conformance.py`` checks it), so their order
in the class list does not matter; ``DGPOTrainer.__init__`` sets them up in one place, each part given what it
reads of another as an argument.
"""

from __future__ import annotations

import functools

from trl import GRPOConfig, GRPOTrainer

from .config import DGPOConfig
from .gradient_guard import NonfiniteGradientGuard
from .loss import FusedLoss
from .model_call import FusedModelCall, FusedModelCalls
from .scores import ResponseScores


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


class DGPOTrainer(FusedLoss, FusedModelCalls, NonfiniteGradientGuard, ResponseScores, GRPOTrainer):
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
        # self.loss_options, then each part given what it reads of another
        self._init_loss(model_call=functools.partial(FusedModelCall, self),
                        after_metrics_read=self.report_skipped_steps)
        self.loss_options = self._init_model_calls(self.loss_options)  # with the model's projection
        self._init_scores(loss_reads_scores=self.loss_options.needs_scores,
                          smooth_advantages=self.args.advantage_estimator == "dcpo")
        self._init_gradient_guard()
