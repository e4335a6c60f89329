"""The method table: one row per policy loss of ``docs/math.md``, collected from the family modules beside
this file (a method's config, its torch terms, its row and its sequence statistic or token selection stand
together in the file named after it, or after its family).

Every method is two per-token functions of ``(log_ratio, advantage, old_logp)``: the loss value ``L`` and the
gradient weight ``psi`` with ``dL/dl = -A * psi``. The torch functions write ``L`` in the authors' autograd form
(so autograd of ``L`` can be checked against the closed-form ``psi``) and select branches with region masks built
from detached values, so that ties on a boundary resolve exactly as the region table says instead of by
autograd's tie-breaking of ``max``/``clamp``. The Triton mirror (``dgpo_ops.kernels.method_table``) reads the
same config through ``MethodConfig.kernel_params``.
"""

from __future__ import annotations

import dataclasses

import torch

from dgpo_ops.kernels.interface import LOG_RATIO_CLAMP
from dgpo_ops.methods import (
    aspo,
    cispo,
    covariance,
    dcpo,
    dgpo,
    dppo,
    dro,
    fipo,
    geo_mean,
    gpg,
    gppo,
    grpo,
    sapo,
    topr,
    vespo,
)
from dgpo_ops.methods.base import (
    MethodAlias,
    MethodConfig,
    MethodSpec,
    TokenInputs,
    TokenTerms,
    straight_through_clamp,
)

# The family modules in the order of docs/methods.md's table; a new method's module is added here once.
FAMILIES = (grpo, cispo, gppo, aspo, dgpo, dcpo, sapo, gpg, topr, dppo, vespo, fipo, dro, geo_mean, covariance)

METHODS: dict[str, MethodSpec] = {spec.name: spec for family in FAMILIES for spec in family.SPECS}
ALIASES: dict[str, MethodAlias] = {alias.name: alias for family in FAMILIES for alias in getattr(family, "ALIASES", ())}
GATES = sapo.GATES

# Names people reach for that are an option of every method here, not a method: the refusal says which option.
NOT_METHODS = {
    "gspo": "GSPO's sequence ratio is an option of every method, not a method: keep the method (grpo or any "
            "other) and set importance_sampling_level=\"sequence\" (as TRL's GRPOConfig does; docs/math.md, "
            "'Sequence-level ratio (GSPO)')",
}


def resolve(name: str) -> tuple[str, dict]:
    """The method a name stands for and the parameters its alias presets (none for a method); an unknown name
    raises ValueError listing the known ones."""
    if name in METHODS:
        return name, {}
    if name in ALIASES:
        return ALIASES[name].method, dict(ALIASES[name].params)
    hint = f" {NOT_METHODS[name]};" if name in NOT_METHODS else ""
    raise ValueError(f"unknown method {name!r};{hint} known methods: {', '.join([*METHODS, *ALIASES])}")


def method_config(method: str | MethodConfig, **params) -> MethodConfig:
    """Build (and validate) the config of a method or alias by name; unknown names and parameters raise
    ValueError. An alias (``ALIASES``) is its method with the alias's parameters where ``params`` leaves them
    unset: ``method_config("dapo")`` is ``method_config("grpo", eps_high=0.28)``."""
    if isinstance(method, MethodConfig):
        config_cls, base = type(method), dataclasses.asdict(method)
    else:
        name, base = resolve(method)
        config_cls = METHODS[name].config
    refuse_unknown_params(config_cls, params)
    return config_cls(**{**base, **params})


def refuse_unknown_params(config_cls: type[MethodConfig], names) -> None:
    """A ``ValueError`` naming the parameters among ``names`` that the method of ``config_cls`` does not take,
    and those it does: the one message of every place a method's parameters are given (keywords, config
    fields)."""
    allowed = [f.name for f in dataclasses.fields(config_cls)]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        takes = f"it takes {', '.join(allowed)}" if allowed else "it takes no parameters"
        raise ValueError(f"{config_cls.name} does not take parameter(s) {', '.join(unknown)}; {takes}")


def token_terms(
    cfg: MethodConfig,
    log_ratio: torch.Tensor,
    advantage: torch.Tensor,
    old_logp: torch.Tensor,
    logp: torch.Tensor | None = None,
    scored: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    score: torch.Tensor | None = None,
) -> TokenTerms:
    """Loss value, gradient weight psi, region (and penalty slope, ``TokenTerms``) of every token.

    ``log_ratio`` may carry autograd (l - l_old, or its sequence mean); ``old_logp`` is detached.
    ``logp`` is the token's own log-prob for the methods whose value uses ``l`` (cispo, dispo,
    aspo's dual branch); it defaults to ``log_ratio + old_logp``, which is ``l`` at token level.
    The log ratio is clamped to [-20, 20] straight-through: values are clamped, the gradient
    passes, so psi is evaluated at the clamped ratio instead of being zeroed (an infinite log
    ratio too). A method with a batch-level selection (``MethodSpec.token_selection``) selects among the
    ``scored`` tokens (default: all), drawing from ``generator`` where it draws at random. ``score``: each
    token's response score, for a method that reads it (``MethodSpec.reads_scores``).
    """
    if logp is None:
        logp = log_ratio + old_logp
    log_ratio = straight_through_clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    inputs = TokenInputs(log_ratio, ratio, ratio.detach(), advantage, logp, old_logp,
                         None if score is None else score.detach())
    spec = METHODS[cfg.name]
    terms = spec.token_fn(cfg, inputs)
    if spec.token_selection is not None:
        if scored is None:  # every token, on the grid the terms are on (advantages may be per response, (B, 1))
            scored = torch.ones(torch.broadcast_shapes(log_ratio.shape, advantage.shape), dtype=torch.bool,
                                device=log_ratio.device)
        terms = spec.token_selection(cfg, terms, inputs, scored, generator)
    slope = terms.penalty_slope
    return TokenTerms(terms.loss, terms.psi.detach(), terms.region, None if slope is None else slope.detach())

