"""dgpo-ops inside verl: the method table as verl policy losses, and the fused kernels as verl's fused
log-prob backend.

Importing this module registers every method and alias of the table as the verl policy loss ``dgpo_ops.<name>``
(``verl.trainer.ppo.core_algos.register_policy_loss``). verl imports it in every worker by itself: the
package's ``verl.plugins`` entry point is loaded by ``import verl``. Choose a loss with
``actor_rollout_ref.actor.policy_loss.loss_mode=dgpo_ops.dgpo``; the parameters verl has no field for
(DGPO's ``n`` and ``m``, DISPO's four bounds, ...) go in ``policy_loss.method_params``, a field of this module's
``PolicyLossConfig``, which importing it makes the class verl's actor config names (``select_for_verl``;
``verl_params``; docs/integrations.md, "Training with verl", has the command lines).

verl calls a policy loss on padded ``(batch, response_length)`` tensors and adds the entropy bonus and
the KL term itself (``verl.workers.utils.losses.ppo_loss``); the loss here is ``dgpo_ops.policy_loss`` on
verl's log-probs (the method table, GSPO's sequence ratio, rollout weights), with verl's aggregation and
normalisation across data-parallel ranks and micro-batches as its per-token scales (``verl_token_scales``).

``use_fused_kernels()`` (or ``DGPO_OPS_VERL_FUSED_KERNELS=1`` in the workers' environment, read when this
module is imported) makes verl's Triton fused-kernel path (``use_fused_kernels=True``,
``fused_kernel_options.impl_backend=triton``) compute its per-token log-probs and entropies with
``dgpo_ops.ops.linear_logprobs`` instead of verl's own kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss
from verl.workers.config import PolicyLossConfig as VerlPolicyLossConfig

from dgpo_ops.core.options import IMPORTANCE_SAMPLING_LEVELS
from dgpo_ops.api import policy_loss
from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.integrations.token_grid import OWN_METRICS, grid_log_probs, grid_tensor, masked_mean, to_host
from dgpo_ops.integrations.verl_params import (
    LOSS_MODES,
    POLICY_LOSS,
    aggregation_mode,
    check_method_params,
    loss_options,
    read_field,
    verl_token_scales,
)
from dgpo_ops.methods.table import resolve
from dgpo_ops.ops.linear_logprobs import linear_logprob_entropy

FUSED_KERNELS_ENV = "DGPO_OPS_VERL_FUSED_KERNELS"


@dataclass
class PolicyLossConfig(VerlPolicyLossConfig):
    """verl's ``policy_loss`` config with the two fields the losses ``dgpo_ops.*`` read beyond verl's:
    ``method_params``, the method's parameters by their dgpo-ops names (they win over verl's fields), and
    ``importance_sampling_level`` (``"sequence"``: GSPO's ratio, for any method). Importing the plugin makes it the
    class verl's actor config names (``select_for_verl``); ``actor_rollout_ref.actor.policy_loss._target_=
    dgpo_ops.integrations.verl.PolicyLossConfig`` names it explicitly."""

    method_params: dict = field(default_factory=dict)
    importance_sampling_level: str = "token"

    def __post_init__(self):
        # Checked when verl builds the config (worker start); the values of verl's own fields, which the
        # policy loss also reads, are checked at the first step.
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"{POLICY_LOSS}.importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        if self.loss_mode in LOSS_MODES:
            check_method_params(resolve(LOSS_MODES[self.loss_mode])[0], self.method_params)
        elif self.method_params:
            raise ValueError(f"{POLICY_LOSS}.method_params is read by the losses dgpo_ops.* only; loss_mode is "
                             f"{self.loss_mode!r}")


def select_for_verl() -> None:
    """Make ``PolicyLossConfig`` the class verl's actor config names (``verl.workers.config.PolicyLossConfig``, the
    ``_target_`` of verl's own ``actor.yaml``, which hydra looks up by that name when a worker builds its config),
    so that ``method_params`` and ``importance_sampling_level`` need no ``_target_`` line of the user's. It is a
    subclass of verl's with defaults for both fields, so every other config builds as before; a name some other
    plugin has already replaced is left alone (the ``_target_`` line still selects this class there)."""
    from verl.workers import config as verl_config
    from verl.workers.config import actor as verl_actor

    for module in (verl_config, verl_actor):
        if getattr(module, "PolicyLossConfig", None) is VerlPolicyLossConfig:
            module.PolicyLossConfig = PolicyLossConfig


def verl_policy_loss(mode: str, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                     config=None, rollout_is_weights=None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss ``dgpo_ops.<method>`` with verl's policy-loss signature: ``(loss, metrics)``, the metrics
    verl's three (``actor/pg_clipfrac``: tokens in LN or HP, where PPO's clip zeroes the gradient;
    ``actor/ppo_kl``; ``actor/pg_clipfrac_lower``: the dual clip's) and ours under ``actor/dgpo_ops/``,
    read to the host in one transfer (verl logs Python floats). ``dgpo_ops.policy_loss`` on verl's log-probs,
    with verl's normalisation as per-token scales."""
    if config is None:
        raise ValueError(f"the policy loss {mode} needs verl's actor config (config=...)")
    options = loss_options(mode, config)
    dtype = grid_log_probs("log_prob", log_prob)
    mask = grid_tensor("response_mask", response_mask, log_prob).bool()
    loss_agg_mode = aggregation_mode(options.method.name, loss_agg_mode)
    scale = verl_token_scales(mask, loss_agg_mode, read_field(config, "global_batch_info", default=None), dtype)
    inputs = LossInputs(target_ids=None, mask=mask,
                        advantages=grid_tensor("advantages", advantages, log_prob),
                        old_logps=grid_tensor("old_log_prob", old_log_prob, log_prob),
                        rollout_weights=None if rollout_is_weights is None else grid_tensor(
                            "rollout_is_weights", rollout_is_weights, log_prob))
    out = policy_loss(inputs, options, logps=log_prob, token_scales=scale)
    log_ratio = old_log_prob.detach().to(dtype) - log_prob.detach().to(dtype)
    return out.loss, to_host({
        "actor/pg_clipfrac": out.metrics["ln_fraction"] + out.metrics["hp_fraction"],
        # as verl's: the clamped mean of old - new over the scored tokens
        "actor/ppo_kl": masked_mean(log_ratio.clamp(-20.0, 20.0), mask),
        "actor/pg_clipfrac_lower": out.metrics["dual_clip_fraction"],
        **{f"actor/dgpo_ops/{name}": out.metrics[name] for name in OWN_METRICS},
    })


def _policy_loss_fn(mode: str):
    def registered(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                   rollout_is_weights=None):
        return verl_policy_loss(mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                rollout_is_weights)

    registered.__name__ = registered.__qualname__ = f"policy_loss_{LOSS_MODES[mode]}"
    registered.__doc__ = f"verl policy loss {mode}: ``dgpo_ops.integrations.verl.verl_policy_loss``."
    return registered


def register() -> list[str]:
    """Register ``dgpo_ops.<name>`` for every method and alias (again: the same functions); return the names.
    A name verl already has for another function is refused, never replaced."""
    for mode in LOSS_MODES:
        existing = POLICY_LOSS_REGISTRY.get(mode)
        if existing is not None and not getattr(existing, "__module__", "").startswith(__name__):
            raise RuntimeError(f"verl already has a policy loss named {mode!r} ({existing!r}); dgpo-ops will not "
                               "replace it")
        register_policy_loss(mode)(_policy_loss_fn(mode))
    return list(LOSS_MODES)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         reduction: str = "none", dist_process_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` contract on dgpo-ops' kernels:
    per-token ``(log_probs, entropy)``, flat ``(num_tokens,)`` fp32, differentiable in both, for hidden
    ``(..., H)``, the lm_head weight ``(V, H)`` (this process's rows with ``dist_process_group``, the
    tensor-parallel vocabulary group) and labels shaped like hidden's tokens."""
    if reduction != "none":
        raise ValueError(f"dgpo-ops' verl backend gives per-token values (reduction='none'), got reduction={reduction!r}")
    if not torch.is_tensor(hidden) or not torch.is_tensor(labels) or hidden.dim() < 2:
        raise ValueError("hidden must be a (..., H) tensor and labels a tensor of its tokens")
    # As verl's kernel: tokens are tokens, whatever the layout (Megatron's packed path hands hidden states
    # (total, 1, H) with labels (1, total)).
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if flat_labels.shape[0] != flat_hidden.shape[0]:
        raise ValueError(f"labels hold {flat_labels.shape[0]} tokens but hidden holds {flat_hidden.shape[0]}")
    if weight.is_floating_point() and torch.finfo(weight.dtype).bits > torch.finfo(flat_hidden.dtype).bits:
        # A head kept wider than the hidden states (an fp32 lm_head, TRL's cast_lm_head_to_fp32): the projection
        # runs in the head's dtype, as verl's own kernel multiplies the operands it is given, not autocast's.
        with torch.autocast(flat_hidden.device.type, enabled=False):
            return linear_logprob_entropy(flat_hidden.to(weight.dtype), weight, flat_labels,
                                          temperature=float(temperature), vocab_parallel_group=dist_process_group)
    logp, entropy = linear_logprob_entropy(flat_hidden, weight, flat_labels, temperature=float(temperature),
                                           vocab_parallel_group=dist_process_group)
    return logp, entropy


# verl's Megatron forwards import linear_cross_entropy when they are imported, not when they run
MEGATRON_FORWARDS = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")


def use_fused_kernels() -> None:
    """Make verl's fused-kernel paths use ``linear_cross_entropy`` above. The transformers forwards (FSDP
    engine, Triton backend) import ``linear_cross_entropy`` from ``verl.utils.kernel.linear_cross_entropy``
    when they run, so replacing that module's function is enough for them; the Megatron forwards import it
    when they are imported, so their names are replaced too where those modules are loaded already (after
    this call every later import finds ours). In each worker: set ``DGPO_OPS_VERL_FUSED_KERNELS=1`` in the
    workers' environment and the plugin calls this on ``import verl``, before any forward is imported."""
    import sys

    import verl.utils.kernel.linear_cross_entropy as verl_kernel

    verl_kernel.linear_cross_entropy = linear_cross_entropy
    for name in MEGATRON_FORWARDS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "linear_cross_entropy"):
            module.linear_cross_entropy = linear_cross_entropy


register()
select_for_verl()
# verl's plugin loader swallows an exception raised here (it logs it at debug level), so a value that is not
# a switch is read as off rather than raised; the README says how to check.
if os.environ.get(FUSED_KERNELS_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
    use_fused_kernels()
