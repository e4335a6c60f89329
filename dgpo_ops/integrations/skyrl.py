"""dgpo-ops inside SkyRL (skyrl 0.3.0): the method table as SkyRL policy losses.

Importing this module registers every method and alias of the table as the SkyRL policy loss ``dgpo_ops.<name>``
(``PolicyLossRegistry.register``, SkyRL's way for a loss from outside its package). SkyRL reads no entry point: a
loss is registered by the process that starts training, before ``initialize_ray`` copies the registry to its Ray
actor, from which every worker reads it. This module's ``main`` is SkyRL's ``main_base.main`` with the losses
registered and the config below, so a run is one of

    python -m dgpo_ops.integrations.skyrl trainer.algorithm.policy_loss_type=dgpo_ops.dgpo ...
    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=dgpo_ops.integrations.skyrl ...

and an entrypoint of one's own needs one line, ``import dgpo_ops.integrations.skyrl``, before ``initialize_ray``.
The parameters SkyRL has no field for (DGPO's ``n`` and ``m``, DISPO's four bounds, ...) go in
``trainer.algorithm.method_params`` of this module's ``AlgorithmConfig`` (``skyrl_params``; docs/integrations.md,
"Training with SkyRL").

SkyRL calls a policy loss on padded ``(batch, response_length)`` tensors after its trainer has divided the
advantages by the ``loss_reduction``'s count over the mini-batch (``apply_loss_reduction_to_advantages_minibatch``);
the loss sums over ``loss_mask`` (``reduce_loss``), and SkyRL adds its own KL and entropy terms. The loss here is
``dgpo_ops.policy_loss`` on SkyRL's log-probs, summed the same way (``loss_mask`` as its per-token scales), with
SkyRL's off-policy correction (``SkyRLCorrection``) on the policy term where SkyRL passes ``rollout_logprobs``.
"""

# No ``from __future__ import annotations``: SkyRL builds its config from the fields' types, which must be classes
# (a string annotation would leave a nested config a dict).
import sys
from dataclasses import dataclass, field

import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
from skyrl.train.config import AlgorithmConfig as SkyRLAlgorithmConfig
from skyrl.train.config import SkyRLTrainConfig as SkyRLBaseTrainConfig
from skyrl.train.config import TrainerConfig as SkyRLTrainerConfig

from dgpo_ops.api import policy_loss
from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.corrections.core import CorrectionInputs, weight_metrics
from dgpo_ops.integrations.config_fields import check_method_params
from dgpo_ops.integrations.skyrl_params import (
    CORRECTION,
    LOSS_TYPES,
    METHOD_PARAMS,
    NEEDS_ROLLOUT_LOGPROBS,
    ROLLOUT_BEHAVIOUR,
    check_level,
    correction_from_skyrl,
    loss_options,
)
from dgpo_ops.integrations.token_grid import OWN_METRICS, grid_log_probs, grid_tensor, to_host
from dgpo_ops.methods.table import resolve


@dataclass
class AlgorithmConfig(SkyRLAlgorithmConfig):
    """SkyRL's ``trainer.algorithm`` with the two fields the losses ``dgpo_ops.*`` read beyond SkyRL's:
    ``method_params``, the method's parameters by their dgpo-ops names (they win over SkyRL's fields), and
    ``importance_sampling_level`` (``"sequence"``: GSPO's ratio, for any method)."""

    method_params: dict = field(default_factory=dict)
    importance_sampling_level: str = "token"

    def __post_init__(self):
        # Checked when the config is built (the driver parses the command line); SkyRL's own fields, which the
        # loss also reads, are checked again at the first step.
        check_level(self.importance_sampling_level)
        if self.policy_loss_type in LOSS_TYPES:
            check_method_params(resolve(LOSS_TYPES[self.policy_loss_type])[0], self.method_params, METHOD_PARAMS)
        elif self.method_params:
            raise ValueError(f"{METHOD_PARAMS} is read by the losses dgpo_ops.* only; policy_loss_type is "
                             f"{self.policy_loss_type!r}")


@dataclass
class TrainerConfig(SkyRLTrainerConfig):
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)


@dataclass
class SkyRLTrainConfig(SkyRLBaseTrainConfig):
    """SkyRL's top-level config with this module's ``AlgorithmConfig`` (SkyRL's way to add config fields: a
    subclass)."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def skyrl_policy_loss(policy_loss_type: str, log_probs, old_log_probs, advantages, config, loss_mask=None,
                      rollout_logprobs=None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss ``dgpo_ops.<method>`` with SkyRL's policy-loss signature: ``(loss, metrics)``: the sum over
    ``loss_mask`` of the method's per-token loss at SkyRL's pre-scaled advantages, each token weighed by its
    ``loss_mask`` value (as ``reduce_loss``), times SkyRL's off-policy weights (0 where it rejects). Metrics: SkyRL's
    ``clip_ratio`` (tokens in LN or HP, where PPO's clip zeroes the gradient) and ours under ``dgpo_ops/``, read to
    the host in one transfer (SkyRL logs Python floats)."""
    if config is None:
        raise ValueError(f"the policy loss {policy_loss_type} needs SkyRL's algorithm config (config=...)")
    options = loss_options(policy_loss_type, config)
    method = options.method.name
    dtype = grid_log_probs("log_probs", log_probs)
    if loss_mask is None:  # SkyRL's reduce_loss: every token
        token_weights = torch.ones_like(log_probs, dtype=dtype)
    else:
        token_weights = grid_tensor("loss_mask", loss_mask, log_probs).detach().to(dtype)
    mask = token_weights > 0
    behaviour = ("old_log_probs", old_log_probs)
    if rollout_logprobs is not None:
        grid_tensor("rollout_logprobs", rollout_logprobs, log_probs)
        if method in ROLLOUT_BEHAVIOUR:
            behaviour = ("rollout_logprobs", rollout_logprobs)
    elif method in NEEDS_ROLLOUT_LOGPROBS:
        raise ValueError(f"the policy loss {policy_loss_type} takes its ratio against rollout_logprobs (the inference "
                         "engine's log-probs), which SkyRL did not pass: enable them in the generator")
    correction = correction_from_skyrl(config)
    if correction is not None:  # the options SkyRL's numbers need (GSPO-token; rejections are dropped below)
        try:
            correction.check_gspo_token(options)
        except ValueError as error:
            raise ValueError(f"{CORRECTION}: {error}") from None
    off_policy, kept, weights = None, mask, None
    if correction is not None and rollout_logprobs is not None:  # SkyRL corrects only where it has them
        off_policy = correction_inputs(grid_tensor("old_log_probs", old_log_probs, log_probs), rollout_logprobs, mask)
        result = correction(off_policy)
        off_policy_weights = torch.ones_like(off_policy.old_logps) if result.weights is None else result.weights
        if result.keep is not None:
            off_policy_weights = off_policy_weights * result.keep
        # A rejection (weight 0) drops the token's term after the loss, as SkyRL's corrected loss_mask does: its
        # weight becomes the scale's 0, so that a method whose sequence statistic folds the weights in (geo_mean,
        # vespo) still sees the token at weight 1 there, as SkyRL's losses see it in theirs.
        rejected = (off_policy_weights == 0).reshape(mask.shape)
        kept = mask & ~rejected
        weights = torch.where(rejected, 1.0, off_policy_weights.reshape(mask.shape))
    inputs = LossInputs(target_ids=None, mask=mask,
                        advantages=grid_tensor("advantages", advantages, log_probs),
                        old_logps=grid_tensor(*behaviour, log_probs), rollout_weights=weights)
    out = policy_loss(inputs, options, logps=log_probs, token_scales=torch.where(kept, token_weights, 0.0))
    metrics = {"clip_ratio": out.metrics["ln_fraction"] + out.metrics["hp_fraction"],
               **{f"dgpo_ops/{name}": out.metrics[name] for name in OWN_METRICS}}
    if off_policy is not None:
        metrics.update({f"dgpo_ops/{name}": value for name, value in weight_metrics(off_policy, result).items()})
    return out.loss, to_host(metrics)


def correction_inputs(old_log_probs, rollout_logprobs, mask) -> CorrectionInputs:
    """The correction's view of a ``(B, T)`` grid: flat fp32 log-probs, each row a response."""
    rows, columns = mask.shape
    sequence = torch.arange(rows, device=mask.device).repeat_interleave(columns)
    return CorrectionInputs(old_log_probs.detach().reshape(-1).to(torch.float32),
                            rollout_logprobs.detach().reshape(-1).to(torch.float32), mask.reshape(-1), sequence, rows)


@dataclass(frozen=True)
class SkyRLPolicyLoss:
    """The registered function of ``dgpo_ops.<name>``: a module-level class, so that SkyRL's registry actor
    (cloudpickle) carries it to every Ray worker by reference, and unpickling it there imports this module."""

    policy_loss_type: str

    def __call__(self, log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
        return skyrl_policy_loss(self.policy_loss_type, log_probs, old_log_probs, advantages, config, loss_mask,
                                 rollout_logprobs)


def register() -> list[str]:
    """Register ``dgpo_ops.<name>`` for every method and alias; return the names. A name SkyRL already has for
    another function is refused, never replaced; ours from an earlier import (a Ray worker that unpickled one of
    them first) stays."""
    for name in LOSS_TYPES:
        try:
            PolicyLossRegistry.register(name, SkyRLPolicyLoss(name))
        except ValueError:  # SkyRL's "already registered"
            existing = PolicyLossRegistry._functions.get(name)
            if not isinstance(existing, SkyRLPolicyLoss):
                raise RuntimeError(f"SkyRL already has a policy loss named {name!r} ({existing!r}); dgpo-ops will "
                                   "not replace it") from None
    return list(LOSS_TYPES)


OVERRIDE_ENTRYPOINT = "trainer.override_entrypoint="


def main(argv: list[str] | None = None) -> None:
    """SkyRL's ``main_base.main`` with this module's config: parse the command line (SkyRL's
    ``trainer.override_entrypoint=`` that brought it here left out), validate, start Ray (which copies the
    registry, the losses above included, to its actor) and train."""
    import ray
    from skyrl.train.entrypoints.main_base import skyrl_entrypoint
    from skyrl.train.utils import initialize_ray, validate_cfg

    args = [arg for arg in (sys.argv[1:] if argv is None else argv) if not arg.startswith(OVERRIDE_ENTRYPOINT)]
    cfg = SkyRLTrainConfig.from_cli_overrides(args)
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(skyrl_entrypoint.remote(cfg))


register()

if __name__ == "__main__":
    main()
