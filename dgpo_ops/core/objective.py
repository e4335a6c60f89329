"""The per-token policy objective on O(N) vectors: log ratio (token or sequence), the method
table, KL, entropy bonus, rollout weights and aggregation.

Every backend runs this on the per-token log-probs and entropies: the reference with autograd
back to the logits, the fused ops with autograd back to those two vectors only (then a kernel
expands the two per-token coefficients over the vocabulary).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dgpo_ops.core.inputs import TokenBatch
from dgpo_ops.core.metrics import policy_metrics
from dgpo_ops.core.options import LossOptions
from dgpo_ops.kernels.interface import LOG_RATIO_CLAMP, LOGP_FLOOR
from dgpo_ops.methods import gspo
from dgpo_ops.methods.base import SequenceInputs, TokenTerms, straight_through_clamp
from dgpo_ops.methods.table import token_terms


class ObjectiveTerms(NamedTuple):
    loss: torch.Tensor  # scalar
    tokens: TokenTerms  # the method's per-token L (differentiable), psi, region
    log_ratio: torch.Tensor  # what psi was evaluated at (sequence mean under GSPO), detached
    kl: torch.Tensor | None  # per-token k3 value, detached
    per_token: torch.Tensor  # each token's w L + beta KL - c H, before the mask and scale (differentiable)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1 of d = l_ref - l, d clamped straight-through before the exponential as the
    policy's log ratio is (so 100 nats from the reference give a large finite value, not inf)."""
    delta = straight_through_clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(delta) - delta - 1.0


def check_kl_inputs(batch, options: LossOptions) -> None:
    """The inputs the added terms read: ``ref_logps`` for the KL, ``scores`` for the positive-example NLL.
    ``batch``: anything with both (a ``TokenBatch`` or the kernels' ``RowInputs``)."""
    if options.beta != 0.0 and batch.ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps")
    if options.beta == 0.0 and batch.ref_logps is not None:  # only the KL reads them: beta 0 drops it unsaid
        raise ValueError("ref_logps are read only by the KL term, which beta=0 turns off: pass beta > 0 (the "
                         "KL coefficient) with ref_logps, or leave ref_logps out")
    if options.positive_nll_coef != 0.0 and batch.objective_inputs["scores"] is None:
        raise ValueError("positive_nll_coef > 0 needs scores (each response's reward: its positive responses are "
                         "the correct ones)")


def positive_nll(logp: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """VAPO's positive-example NLL as NeMo-RL's ClippedPGLossFn forms it: the mean of ``-l`` over the scored tokens
    of the responses whose score is > 0, over this call's count of them plus 1e-8 (0 where there is none)."""
    correct = batch.mask & (batch.objective_inputs["scores"] > 0)
    return -torch.where(correct, logp, 0.0).sum() / (correct.sum() + 1e-8)


def policy_objective(
    logp: torch.Tensor, entropy: torch.Tensor | None, batch: TokenBatch, options: LossOptions,
    generator: torch.Generator | None = None,
) -> ObjectiveTerms:
    """Scalar loss from per-token log-probs ``(B, T)`` and entropies (differentiable in both). ``generator``:
    what a method that selects tokens at random draws from (clip_cov)."""
    check_kl_inputs(batch, options)
    # Floored straight-through: a target of probability 0 (log p = -inf) gives finite values, and
    # the on-policy ratio l - l is 1, not -inf - -inf.
    logp = straight_through_clamp(logp, LOGP_FLOOR, None)
    old_logp = batch.old_logps if batch.old_logps is not None else logp.detach()
    log_ratio = logp - old_logp
    statistic = options.sequence_statistic
    # TRL's importance ratio (its coef_1: the token's, or GSPO's sequence mean), which its KL correction uses
    # whatever the loss type: a method's own sequence statistic (vespo's, geo_mean's) is not it
    importance_log_ratio = log_ratio
    statistic = options.sequence_statistic
    if statistic is not None:
        log_ratio = statistic(options.method, SequenceInputs(log_ratio, batch.advantages, batch.mask,
                                                             batch.rollout_weights))
        if statistic is gspo.mean_log_ratio:
            importance_log_ratio = log_ratio
    tokens = token_terms(options.method, log_ratio, batch.advantages, old_logp, logp=logp, scored=batch.mask,
                         generator=generator, score=batch.objective_inputs["scores"])
    per_token = tokens.loss
    if batch.rollout_weights is not None and not options.folds_rollout_weights:
        per_token = per_token * batch.rollout_weights
    kl = None
    if options.beta != 0.0:
        kl_value = kl_k3(logp, batch.ref_logps)
        if options.kl_ratio_correction:  # as TRL: by the importance ratio, with its gradient (clamped
            # straight-through, as every exponential here)
            kl_value = kl_value * torch.exp(straight_through_clamp(importance_log_ratio, -LOG_RATIO_CLAMP,
                                                                   LOG_RATIO_CLAMP))
        per_token = per_token + options.beta * kl_value
        kl = kl_value.detach()
    if options.entropy_coef != 0.0:
        per_token = per_token - options.entropy_coef * entropy
    loss = torch.where(batch.mask, per_token, 0.0).mul(batch.scale).sum()
    if options.positive_nll_coef != 0.0:  # normalised by its own count, whatever the aggregation (as NeMo-RL's)
        loss = loss + options.positive_nll_coef * positive_nll(logp, batch)
    clamped = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return ObjectiveTerms(loss, tokens, clamped, kl, per_token)


def entropy_weight_term(entropy: torch.Tensor, weights: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``-sum w_t H_t`` over the scored tokens: ``LossInputs.entropy_weights``' term, added to the loss as it is
    (outside the aggregation). Every route adds it with this function (the fused ops on detached entropies)."""
    return -torch.where(scored, weights * entropy, 0.0).sum()


def masked_objective(logp, entropy, batch, options: LossOptions, generator=None):
    """``(loss, logp, entropy, metrics)`` from per-token log-probs and entropies on ``batch``'s grid
    (differentiable): the reference's tail. Masked
    positions take no part (their replacement target may even have a -inf logit): their per-token
    values are 0."""
    logp = torch.where(batch.mask, logp, 0.0)
    entropy = torch.where(batch.mask, entropy, 0.0)
    terms = policy_objective(logp, entropy, batch, options, generator)
    metrics = policy_metrics(terms.log_ratio, terms.tokens.psi, terms.tokens.region, entropy, terms.kl, batch.mask)
    return terms.loss, logp, entropy, metrics
