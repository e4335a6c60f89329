"""The per-token method table: one row per policy loss of ``docs/math.md``.

Every method is two per-token functions of ``(log_ratio, advantage, old_logp)``:
the loss value ``L`` and the gradient weight ``psi`` with ``dL/dl = -A * psi``.
A row holds the method's typed config and its torch function; the Triton mirror
(``dgpo_ops.kernels.method_table``) reads the same config through ``kernel_params``.

The torch functions write ``L`` in the authors' autograd form (so autograd of ``L``
can be checked against the closed-form ``psi``) and select branches with region
masks built from detached values, so that ties on a boundary resolve exactly as the
region table says instead of by autograd's tie-breaking of ``max``/``clamp``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple

import torch

# The codes and slots the kernels read are the kernels' own interface (a leaf module); re-exported here.
from dgpo_ops.kernels.interface import (  # noqa: F401
    FLOAT32_MAX,
    LOG_RATIO_CLAMP,
    LOGP_FLOOR,
    NUM_KERNEL_PARAMS,
    VESPO_LOG_W_MIN,
    Gate,
    KernelParam,
    MethodId,
    Region,
)
from dgpo_ops.methods.selection import random_subset, selection_size, token_covariance, top_subset


@dataclass(frozen=True)
class ParamSpec:
    """What a method parameter accepts and where the trainer reads it from.

    ``low``/``high`` bound the value (``low_open``: strictly above ``low``); ``optional``: None is allowed
    (it turns the feature off); ``choices``: the allowed strings. ``config_field`` names the
    ``DGPOConfig`` (or TRL ``GRPOConfig``) field the trainer reads the parameter from: a field TRL
    already has keeps TRL's meaning, any other is added to ``DGPOConfig`` from this table; None in that
    field means the method's default, except ``config_fallback``, the field whose value stands in (TRL's
    ``epsilon_high=None`` means ``epsilon``). ``config_offset`` is added on the way to the config (CISPO's
    cap ``1 + eps_high`` is TRL's ``epsilon_high``). Parameters with no ``config_field`` keep their
    default under the trainer. ``verl_field`` names the field of verl's actor config
    (``actor_rollout_ref.actor``, or ``policy_loss.<name>`` of its policy-loss config) that means the same
    (``dgpo_ops.integrations.verl``); parameters without one are read from ``policy_loss.method_params``.
    ``verl_none``: the value verl's own loss uses where that field is null (verl's code constant, which may
    differ from its config's default).
    """

    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    optional: bool = False
    choices: tuple[str, ...] | None = None
    config_field: str | None = None
    config_fallback: str | None = None
    config_offset: float = 0.0
    verl_field: str | None = None
    verl_none: float | None = None

    def check(self, method: str, name: str, value) -> None:
        if value is None:
            if self.optional:
                return
            raise ValueError(f"{method}: {name} must be in {self.describe()}, got None")
        if self.choices is not None:
            if value not in self.choices:
                raise ValueError(f"{method}: {name} must be one of {sorted(self.choices)}, got {value!r}")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{method}: {name} must be a finite number, got {value!r}")
        if abs(value) > FLOAT32_MAX:  # the kernels read the parameters as float32
            raise ValueError(f"{method}: {name} must be a finite float32 number (at most {FLOAT32_MAX:.2g}), "
                             f"got {value!r}")
        low, high = self.low, self.high
        too_low = low is not None and (value <= low if self.low_open else value < low)
        if too_low or (high is not None and value > high):
            bracket = "(" if self.low_open or low is None else "["
            closing = ")" if high is None else "]"
            raise ValueError(f"{method}: {name} must be in {bracket}{'-inf' if low is None else low}, "
                             f"{'inf' if high is None else high}{closing}, got {value!r}")

    def to_config(self, value):
        """The parameter's value in its config field's terms (``config_offset`` added)."""
        return value if value is None or isinstance(value, str) else value + self.config_offset

    def from_config(self, value):
        """The parameter's value from its config field's value."""
        return value if value is None or isinstance(value, str) else value - self.config_offset

    def describe(self) -> str:
        """The accepted values in words, for the README table and ``--help``."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        text = f"{'(' if self.low_open or self.low is None else '['}{low}, {high}{')' if self.high is None else ']'}"
        return text + (" or None (off)" if self.optional else "")


def param(default, help: str, **spec):
    """A method parameter: a dataclass field whose metadata is its ``ParamSpec``."""
    return dataclasses.field(default=default, metadata={"param": ParamSpec(help=help, **spec)})


# The parameters several methods share: one definition each.
def _eps_low(default=0.2, **spec):
    spec = {"verl_field": "clip_ratio_low", **spec}
    return param(default, "lower clip: the trust region starts at 1 - eps_low", low=0.0, high=1.0,
                 config_field="epsilon", **spec)


def _eps_high(default=0.2, **spec):
    spec = {"verl_field": "clip_ratio_high", **spec}
    return param(default, "upper clip: the trust region ends at 1 + eps_high", low=0.0, config_field="epsilon_high",
                 config_fallback="epsilon", **spec)


def _dual_clip(default, optional=True):
    return param(default, "dual clip c > 1 for A < 0", low=1.0, low_open=True, optional=optional,
                 config_field="dual_clip", verl_field="clip_ratio_c")


@dataclass(frozen=True)
class MethodConfig:
    """Base of the per-method configs. Field names are the public keyword names; each field's
    ``ParamSpec`` (its metadata) says what it accepts."""

    name: ClassVar[str]
    method_id: ClassVar[MethodId]

    def __post_init__(self):
        for field in dataclasses.fields(self):
            field.metadata["param"].check(self.name, field.name, getattr(self, field.name))

    def kernel_params(self) -> list[float]:
        """The fp32 parameter vector of ``KernelParam`` slots; slots a method does not read stay 0."""
        values = [0.0] * NUM_KERNEL_PARAMS
        values[KernelParam.DUAL_CLIP] = math.inf
        values[KernelParam.DELTA] = math.inf
        for slot, value in self._kernel_slots().items():
            values[slot] = math.inf if value is None else float(value)
        return values

    def _kernel_slots(self) -> dict[KernelParam, float | None]:
        raise NotImplementedError

    @property
    def gate_id(self) -> Gate:
        return Gate.SIGMOID


def _symmetric_bounds(cfg) -> dict[KernelParam, float]:
    return {
        KernelParam.LOW_POS: 1.0 - cfg.eps_low,
        KernelParam.HIGH_POS: 1.0 + cfg.eps_high,
        KernelParam.LOW_NEG: 1.0 - cfg.eps_low,
        KernelParam.HIGH_NEG: 1.0 + cfg.eps_high,
    }


@dataclass(frozen=True)
class GrpoConfig(MethodConfig):
    name: ClassVar[str] = "grpo"
    method_id: ClassVar[MethodId] = MethodId.GRPO
    eps_low: float = _eps_low()
    eps_high: float = _eps_high()
    dual_clip: float | None = _dual_clip(None)
    # TRL's two-sided clipping (INTELLECT-2): the unclipped ratio is capped at delta, -min(min(r, delta) A, clip(r) A)
    delta: float | None = param(None, "cap on the ratio before PPO's min (TRL's delta)", low=0.0, low_open=True,
                                optional=True, config_field="delta")

    def _kernel_slots(self):
        return {**_symmetric_bounds(self), KernelParam.DUAL_CLIP: self.dual_clip, KernelParam.DELTA: self.delta}


@dataclass(frozen=True)
class CispoConfig(MethodConfig):
    name: ClassVar[str] = "cispo"
    method_id: ClassVar[MethodId] = MethodId.CAPPED_IS
    # TRL's CISPO has no lower bound on the weight (eps_low = 1) and calls the cap itself epsilon_high.
    eps_low: float = param(1.0, "the weight is floored at 1 - eps_low (1: no floor)", low=0.0, high=1.0,
                           verl_field="clip_ratio_low")
    eps_high: float = param(4.0, "the weight is capped at 1 + eps_high", low=0.0, config_field="epsilon_high",
                            config_fallback="epsilon", config_offset=1.0, verl_field="clip_ratio_high")

    def _kernel_slots(self):
        return _symmetric_bounds(self)


def _dispo_bound(default, sign: str, side: str):
    low, high = (0.0, 1.0) if side == "low" else (0.0, None)
    what = "floored at 1 - " if side == "low" else "capped at 1 + "
    return param(default, f"for A {sign} 0 the weight is {what}eps_{side}_{'pos' if sign == '>' else 'neg'}",
                 low=low, high=high, config_field=f"dispo_eps_{side}_{'pos' if sign == '>' else 'neg'}")


@dataclass(frozen=True)
class DispoConfig(MethodConfig):
    name: ClassVar[str] = "dispo"
    method_id: ClassVar[MethodId] = MethodId.CAPPED_IS
    eps_low_pos: float = _dispo_bound(0.2, ">", "low")
    eps_high_pos: float = _dispo_bound(10.0, ">", "high")
    eps_low_neg: float = _dispo_bound(1.0, "<", "low")
    eps_high_neg: float = _dispo_bound(100.0, "<", "high")

    def _kernel_slots(self):
        return {
            KernelParam.LOW_POS: 1.0 - self.eps_low_pos,
            KernelParam.HIGH_POS: 1.0 + self.eps_high_pos,
            KernelParam.LOW_NEG: 1.0 - self.eps_low_neg,
            KernelParam.HIGH_NEG: 1.0 + self.eps_high_neg,
        }


@dataclass(frozen=True)
class GppoConfig(MethodConfig):
    name: ClassVar[str] = "gppo"
    method_id: ClassVar[MethodId] = MethodId.GRADIENT_PRESERVING
    eps_low: float = _eps_low()
    eps_high: float = _eps_high()
    dual_clip: float | None = _dual_clip(3.0)

    beta1: ClassVar[float] = 1.0
    beta2: ClassVar[float] = 1.0

    def _kernel_slots(self):
        return {
            **_symmetric_bounds(self),
            KernelParam.DUAL_CLIP: self.dual_clip,
            KernelParam.LN_WEIGHT: self.beta1 * (1.0 - self.eps_low),
            KernelParam.HP_WEIGHT: self.beta2 * (1.0 + self.eps_high),
        }


@dataclass(frozen=True)
class CeGppoConfig(MethodConfig):
    name: ClassVar[str] = "ce_gppo"
    method_id: ClassVar[MethodId] = MethodId.GRADIENT_PRESERVING
    eps_low: float = _eps_low()
    eps_high: float = _eps_high()
    dual_clip: float | None = _dual_clip(3.0)
    beta1: float = param(0.75, "scale of the left-boundary gradient", low=0.0, config_field="gppo_beta1")
    beta2: float = param(1.0, "scale of the right-boundary gradient", low=0.0, config_field="gppo_beta2")

    _kernel_slots = GppoConfig._kernel_slots


@dataclass(frozen=True)
class AspoConfig(MethodConfig):
    name: ClassVar[str] = "aspo"
    method_id: ClassVar[MethodId] = MethodId.ASPO
    eps_low: float = _eps_low()
    eps_high: float = _eps_high()
    dual_clip: float = _dual_clip(3.0, optional=False)  # aspo's soft dual clip cannot be turned off

    def _kernel_slots(self):
        return {**_symmetric_bounds(self), KernelParam.DUAL_CLIP: self.dual_clip}


@dataclass(frozen=True)
class DgpoConfig(MethodConfig):
    name: ClassVar[str] = "dgpo"
    method_id: ClassVar[MethodId] = MethodId.DGPO
    eps_low: float = _eps_low()
    eps_high: float = _eps_high()
    n: float = param(1.0, "polynomial decay order of the probability gradient on the left boundary", low=0.0,
                     config_field="dgpo_n")
    m: float = param(2.0, "radical decay order on the right boundary", low=1.0, config_field="dgpo_m")

    def _kernel_slots(self):
        return {**_symmetric_bounds(self), KernelParam.N: self.n, KernelParam.M: self.m}


@dataclass(frozen=True)
class DcpoConfig(MethodConfig):
    name: ClassVar[str] = "dcpo"
    method_id: ClassVar[MethodId] = MethodId.DCPO
    # DCPO's eps set a bound that depends on the old probability, not PPO's clip: not verl's clip_ratio_*.
    eps_low: float = _eps_low(0.16, verl_field=None)
    eps_high: float = _eps_high(0.2, verl_field=None)
    r_max: float = param(10.0, "ratio cap (and dual clip)", low=1.0, low_open=True, config_field="dcpo_r_max")

    def _kernel_slots(self):
        return {KernelParam.EPS_LOW: self.eps_low, KernelParam.EPS_HIGH: self.eps_high, KernelParam.R_MAX: self.r_max}


@dataclass(frozen=True)
class GpgConfig(MethodConfig):
    name: ClassVar[str] = "gpg"
    method_id: ClassVar[MethodId] = MethodId.REINFORCE

    def _kernel_slots(self):
        return {}


def _dppo_threshold(default, side: str):
    sign = "<=" if side == "low" else ">"
    return param(default, f"divergence threshold for A {sign} 0: a token whose probability moved further is dropped",
                 low=0.0, config_field=f"dppo_delta_{side}", verl_field=f"clip_ratio_{side}")


@dataclass(frozen=True)
class DppoTvConfig(MethodConfig):
    name: ClassVar[str] = "dppo_tv"
    method_id: ClassVar[MethodId] = MethodId.DPPO_TV
    # verl reads its clip fields as the divergence thresholds and clip_ratio_c as the weight's cap.
    delta_low: float = _dppo_threshold(0.2, "low")
    delta_high: float = _dppo_threshold(0.2, "high")
    is_cap: float = param(3.0, "the importance weight is capped at is_cap", low=0.0, low_open=True,
                          config_field="dppo_is_cap", verl_field="clip_ratio_c")

    def _kernel_slots(self):
        return {KernelParam.EPS_LOW: self.delta_low, KernelParam.EPS_HIGH: self.delta_high,
                KernelParam.R_MAX: self.is_cap}


@dataclass(frozen=True)
class DppoKlConfig(DppoTvConfig):
    name: ClassVar[str] = "dppo_kl"
    method_id: ClassVar[MethodId] = MethodId.DPPO_KL


def _vespo_param(default, what: str, sign: str):
    side = "pos" if sign == ">=" else "neg"
    symbol = "k" if what == "shape" else "lambda"
    return param(default, f"gamma {what} for A {sign} 0", low=0.0, config_field=f"vespo_{symbol}_{side}")


@dataclass(frozen=True)
class VespoConfig(MethodConfig):
    name: ClassVar[str] = "vespo"
    method_id: ClassVar[MethodId] = MethodId.VESPO
    k_pos: float = _vespo_param(2.0, "shape", ">=")
    lambda_pos: float = _vespo_param(3.0, "rate", ">=")
    k_neg: float = _vespo_param(3.0, "shape", "<")
    lambda_neg: float = _vespo_param(2.0, "rate", "<")

    def _kernel_slots(self):
        return {KernelParam.K_POS: self.k_pos, KernelParam.LAMBDA_POS: self.lambda_pos, KernelParam.K_NEG: self.k_neg,
                KernelParam.LAMBDA_NEG: self.lambda_neg}


@dataclass(frozen=True)
class DroConfig(MethodConfig):
    name: ClassVar[str] = "dro"
    method_id: ClassVar[MethodId] = MethodId.DRO
    # No default, as verl's policy_loss.dro_beta (None raises there too): DRO is its penalty.
    dro_beta: float | None = param(None, "weight of the penalty (dro_beta / 2) (l - l_old)^2; required", low=0.0,
                                   low_open=True, config_field="dro_beta", verl_field="policy_loss.dro_beta")

    def _kernel_slots(self):
        return {KernelParam.PROXIMAL_BETA: self.dro_beta}


def _unclipped_bounds() -> dict[KernelParam, float]:
    """Bounds that clip nothing: the plain ratio -A r in the PPO branch of the kernels."""
    return {KernelParam.LOW_POS: 0.0, KernelParam.HIGH_POS: math.inf, KernelParam.LOW_NEG: 0.0,
            KernelParam.HIGH_NEG: math.inf}


@dataclass(frozen=True)
class GeoMeanConfig(MethodConfig):
    name: ClassVar[str] = "geo_mean"
    method_id: ClassVar[MethodId] = MethodId.GRPO  # -A R at the response's clipped geometric mean R
    # GMPO clips each token's log-ratio before the mean, in log space (verl reads its clip_ratio_* as these)
    eps_low: float = param(0.2, "for A < 0 a token's log-ratio is clipped below at -eps_low", low=0.0,
                           config_field="epsilon", verl_field="clip_ratio_low")
    eps_high: float = param(0.2, "for A > 0 a token's log-ratio is clipped above at eps_high", low=0.0,
                            config_field="epsilon_high", config_fallback="epsilon", verl_field="clip_ratio_high")

    def _kernel_slots(self):
        return _unclipped_bounds()


def _covariance_param(default, what: str, field: str, verl_none=None, **spec):
    # verl's clip_cov / kl_cov read a null field as their code's constant: the default, but for ppo_kl_coef
    return param(default, what, config_field=field, verl_field=f"policy_loss.{field}",
                 verl_none=default if verl_none is None else verl_none, **spec)


@dataclass(frozen=True)
class ClipCovConfig(MethodConfig):
    name: ClassVar[str] = "clip_cov"
    method_id: ClassVar[MethodId] = MethodId.GRPO  # PPO's single clip; the selection cuts the chosen tokens
    eps_low: float = _eps_low()
    eps_high: float = _eps_high()
    clip_cov_ratio: float = _covariance_param(2e-4, "fraction of the scored tokens whose gradient is cut (at least "
                                              "one)", "clip_cov_ratio", low=0.0, low_open=True, high=1.0)
    clip_cov_lb: float = _covariance_param(1.0, "a cut token's covariance is above clip_cov_lb", "clip_cov_lb")
    clip_cov_ub: float = _covariance_param(5.0, "a cut token's covariance is below clip_cov_ub", "clip_cov_ub")

    def _kernel_slots(self):
        return _symmetric_bounds(self)


@dataclass(frozen=True)
class KlCovConfig(MethodConfig):
    name: ClassVar[str] = "kl_cov"
    method_id: ClassVar[MethodId] = MethodId.GRPO  # the plain ratio; the selection adds the penalty
    kl_cov_ratio: float = _covariance_param(2e-4, "fraction of the scored tokens (the largest covariances, at "
                                            "least one) that get the penalty", "kl_cov_ratio", low=0.0,
                                            low_open=True, high=1.0)
    ppo_kl_coef: float = _covariance_param(0.1, "weight of the penalty abs(l - l_old) on the chosen tokens",
                                           "ppo_kl_coef", verl_none=1.0, low=0.0)

    def _kernel_slots(self):
        return _unclipped_bounds()


GATES = {"sigmoid": Gate.SIGMOID, "erf": Gate.ERF, "arctan": Gate.ARCTAN, "softsign": Gate.SOFTSIGN}


@dataclass(frozen=True)
class SapoConfig(MethodConfig):
    name: ClassVar[str] = "sapo"
    method_id: ClassVar[MethodId] = MethodId.SAPO
    gate: str = param("sigmoid", "soft gate of the ratio", choices=tuple(GATES), config_field="sapo_gate")
    tau_pos: float = param(1.0, "gate temperature for A >= 0", low=0.0, low_open=True,
                           config_field="sapo_temperature_pos", verl_field="tau_pos")
    tau_neg: float = param(1.05, "gate temperature for A < 0", low=0.0, low_open=True,
                           config_field="sapo_temperature_neg", verl_field="tau_neg")

    def _kernel_slots(self):
        return {KernelParam.TAU_POS: self.tau_pos, KernelParam.TAU_NEG: self.tau_neg}

    @property
    def gate_id(self) -> Gate:
        return GATES[self.gate]


# --------------------------------------------------------------------------------------------
# Per-token torch functions: (config, TokenInputs) -> TokenTerms, psi detached.
# --------------------------------------------------------------------------------------------


class TokenInputs(NamedTuple):
    log_ratio: torch.Tensor  # clamped straight-through; differentiable
    ratio: torch.Tensor  # exp(log_ratio); differentiable
    ratio_detached: torch.Tensor
    advantage: torch.Tensor
    logp: torch.Tensor  # l = log_ratio + old_logp; differentiable
    old_logp: torch.Tensor


class TokenTerms(NamedTuple):
    loss: torch.Tensor
    psi: torch.Tensor
    region: torch.Tensor
    # dL/dl = -A psi + penalty_slope: a penalty whose slope is not proportional to A (dro's quadratic one,
    # kl_cov's |l - l_old| on its chosen tokens); None: no penalty
    penalty_slope: torch.Tensor | None = None


def _full(value, like):
    return value if torch.is_tensor(value) else torch.full_like(like, value)


def _regions(rd, adv, low, high):
    """Region codes from the trust region [low, high] (tensors or floats) and the sign of A."""
    pos, neg = adv > 0, adv < 0
    below, above = rd < low, rd > high
    region = torch.full_like(rd, Region.M.value, dtype=torch.int8)
    region = torch.where(below & neg, Region.LN.value, region)
    region = torch.where(above & pos, Region.HP.value, region)
    region = torch.where(below & pos, Region.LP.value, region)
    return torch.where(above & neg, Region.HN.value, region).to(torch.int8)


def _ppo_clip(x: TokenInputs, low, high, dual_clip, delta=math.inf) -> TokenTerms:
    rd, adv = x.ratio_detached, x.advantage
    region = _regions(rd, adv, low, high)
    in_ln = region == Region.LN.value
    clipped = in_ln | (region == Region.HP.value)
    loss = torch.where(clipped, -adv * torch.where(in_ln, _full(low, rd), _full(high, rd)), -adv * x.ratio)
    # TRL's delta, -min(min(r, delta) A, clip(r) A): for A > 0 the value is -A min(r, delta, high); for A < 0 a
    # ratio above both high and delta gives -A max(delta, high). Where it fires the gradient is 0 (DUAL, HP stays HP).
    capped_pos = (adv > 0) & (rd > delta)
    capped_neg = (adv < 0) & (rd > high) & (rd > delta)
    loss = torch.where(capped_pos, -adv * torch.minimum(_full(delta, rd), _full(high, rd)), loss)
    loss = torch.where(capped_neg, -adv * torch.maximum(_full(delta, rd), _full(high, rd)), loss)
    capped = capped_pos | capped_neg
    region = torch.where(capped & (region != Region.HP.value), Region.DUAL.value, region)
    dual = (adv < 0) & (rd > dual_clip)
    loss = torch.where(dual, -adv * dual_clip, loss)
    psi = torch.where(clipped | capped | dual, torch.zeros_like(rd), rd)
    return TokenTerms(loss, psi, torch.where(dual, Region.DUAL.value, region).to(torch.int8))


def _capped_is(x: TokenInputs, low, high) -> TokenTerms:
    rd, adv = x.ratio_detached, x.advantage
    weight = torch.minimum(torch.maximum(rd, _full(low, rd)), _full(high, rd))
    return TokenTerms(-adv * weight * x.logp, weight, _regions(rd, adv, low, high))


def _grpo(cfg: GrpoConfig, x: TokenInputs) -> TokenTerms:
    dual = math.inf if cfg.dual_clip is None else cfg.dual_clip
    delta = math.inf if cfg.delta is None else cfg.delta
    return _ppo_clip(x, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, dual, delta)


def dcpo_bounds(cfg: DcpoConfig, old_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DCPO's trust region [lower(q), upper(q)] from the old probability q."""
    q = old_logp.exp()
    low = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * cfg.eps_low / q, min=0.0))
    high = torch.clamp(0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * cfg.eps_high / q), max=cfg.r_max)
    return low, high


def _dcpo(cfg: DcpoConfig, x: TokenInputs) -> TokenTerms:
    low, high = dcpo_bounds(cfg, x.old_logp)
    return _ppo_clip(x, low, high, cfg.r_max)


def _cispo(cfg: CispoConfig, x: TokenInputs) -> TokenTerms:
    return _capped_is(x, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)


def _dispo(cfg: DispoConfig, x: TokenInputs) -> TokenTerms:
    neg, rd = x.advantage < 0, x.ratio_detached
    low = torch.where(neg, _full(1.0 - cfg.eps_low_neg, rd), _full(1.0 - cfg.eps_low_pos, rd))
    high = torch.where(neg, _full(1.0 + cfg.eps_high_neg, rd), _full(1.0 + cfg.eps_high_pos, rd))
    return _capped_is(x, low, high)


def _gppo(cfg: GppoConfig | CeGppoConfig, x: TokenInputs) -> TokenTerms:
    r, rd, adv = x.ratio, x.ratio_detached, x.advantage
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    dual_clip = math.inf if cfg.dual_clip is None else cfg.dual_clip
    region = _regions(rd, adv, low, high)
    in_ln, in_hp = region == Region.LN.value, region == Region.HP.value
    unit = r / rd  # value 1, gradient r/sg(r): the gradient-preserving trick
    loss = torch.where(in_ln, -adv * cfg.beta1 * low * unit, -adv * r)
    loss = torch.where(in_hp, -adv * cfg.beta2 * high * unit, loss)
    psi = torch.where(in_ln, _full(cfg.beta1 * low, rd), rd)
    psi = torch.where(in_hp, _full(cfg.beta2 * high, rd), psi)
    dual = (adv < 0) & (-adv * dual_clip < loss.detach())
    loss = torch.where(dual, -adv * dual_clip, loss)
    psi = torch.where(dual, torch.zeros_like(rd), psi)
    return TokenTerms(loss, psi, torch.where(dual, Region.DUAL.value, region).to(torch.int8))


def _aspo(cfg: AspoConfig, x: TokenInputs) -> TokenTerms:
    r, rd, adv, logp = x.ratio, x.ratio_detached, x.advantage, x.logp
    low, high, c = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, cfg.dual_clip
    zero = torch.zeros_like(rd)
    pos = adv >= 0
    # A >= 0: flipped ratio 1/p with p = min(r, high); soft dual clip where 1/p > c.
    # Selects written so that a NaN ratio takes the ratio's branch: NaN must reach the loss.
    p = torch.where(rd > high, _full(high, rd), r)
    pd = p.detach()
    pos_dual = 1.0 / pd > c
    pos_loss = torch.where(pos_dual, -adv * c * logp, -adv * (p / pd) / pd)
    pos_psi = torch.where(pos_dual, _full(c, rd), torch.where(rd > high, zero, 1.0 / rd))
    # A < 0: u = max(r, low); soft dual clip where u > c.
    u = torch.where(rd < low, _full(low, rd), r)
    neg_dual = u.detach() > c
    neg_loss = torch.where(neg_dual, -adv * c * logp, -adv * u)
    neg_psi = torch.where(neg_dual, _full(c, rd), torch.where(rd < low, zero, rd))
    dual = torch.where(pos, pos_dual, neg_dual) & (adv != 0)
    region = torch.where(dual, Region.DUAL.value, _regions(rd, adv, low, high)).to(torch.int8)
    return TokenTerms(
        torch.where(pos, pos_loss, neg_loss), torch.where(pos, pos_psi, neg_psi), region
    )


def _dgpo(cfg: DgpoConfig, x: TokenInputs) -> TokenTerms:
    log_r, rd, adv = x.log_ratio, x.ratio_detached, x.advantage
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    region = _regions(rd, adv, low, high)
    in_ln, in_hp = region == Region.LN.value, region == Region.HP.value
    log_rd = log_r.detach()
    # LN: exp(l + n sg(l) - (n+1) l_old) / low^n. Exponents are zeroed outside their region so
    # an overflow there cannot turn into 0 * inf = nan in the backward of torch.where.
    log_low = math.log(low) if low > 0 else 0.0  # low = 0 leaves LN empty
    ln_exponent = torch.where(in_ln, log_r + cfg.n * (log_rd - log_low), log_r.detach() * 0)
    # HP: exp(l + log(high)/m - l_old (m-1)/m - sg(l)/m).
    hp_exponent = torch.where(in_hp, log_r + (math.log(high) - log_rd) / cfg.m, log_r.detach() * 0)
    weight = torch.where(in_ln, torch.exp(ln_exponent), torch.where(in_hp, torch.exp(hp_exponent), x.ratio))
    return TokenTerms(-adv * weight, weight, region)


def _sapo_gate(gate: Gate, x, tau):
    """Gate value f_tau(x) and slope f'_tau(x); tau is a tensor."""
    u = x - 1.0
    if gate == Gate.SIGMOID:
        s = torch.sigmoid(tau * u)
        return s * 4.0 / tau, 4.0 * s * (1.0 - s)
    if gate == Gate.ERF:
        k = math.sqrt(math.pi / 2.0) / tau
        return k * (1.0 + torch.erf(tau * u / math.sqrt(2.0))) + 1.0 - k, torch.exp(-0.5 * (tau * u) ** 2)
    if gate == Gate.ARCTAN:
        return 1.0 + torch.atan(tau * u) / tau, 1.0 / (1.0 + (tau * u) ** 2)
    if gate == Gate.SOFTSIGN:
        d = 1.0 + (tau * u) ** 2
        return 1.0 + u / torch.sqrt(d), d**-1.5
    raise AssertionError(gate)


def _sapo(cfg: SapoConfig, x: TokenInputs) -> TokenTerms:
    rd = x.ratio_detached
    tau = torch.where(x.advantage >= 0, _full(cfg.tau_pos, rd), _full(cfg.tau_neg, rd))
    value, _ = _sapo_gate(cfg.gate_id, x.ratio, tau)
    _, slope = _sapo_gate(cfg.gate_id, rd, tau)
    # SAPO has no trust region: every token is in M.
    return TokenTerms(-x.advantage * value, slope * rd, torch.zeros_like(rd, dtype=torch.int8))


def _gpg(cfg: GpgConfig, x: TokenInputs) -> TokenTerms:
    # REINFORCE: the log-prob weighted by the advantage, no ratio. Every token is in M.
    rd = x.ratio_detached
    return TokenTerms(-x.advantage * x.logp, torch.ones_like(rd), torch.zeros_like(rd, dtype=torch.int8))


def dppo_kept(cfg: DppoTvConfig, logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor):
    """DPPO's trust region in probability space: whether the token's probability ``p = e^l`` stayed within
    the divergence thresholds of ``q = e^l_old`` (A > 0 against ``delta_high``, A <= 0 against ``delta_low``).
    Written as "not dropped", so that a NaN log-prob keeps its token and reaches the loss."""
    p, q = logp.detach().exp(), old_logp.exp()
    pos = advantage > 0
    if cfg.method_id == MethodId.DPPO_TV:
        return ~torch.where(pos, p - q > cfg.delta_high, p - q < -cfg.delta_low)
    # binary KL(q || p) of the token's own probability; a move towards the advantage's side is always kept
    binary_kl = q * (old_logp - logp.detach()) + (1.0 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    return ~torch.where(pos, (binary_kl > cfg.delta_high) & (p > q), (binary_kl > cfg.delta_low) & (p < q))


def _dppo(cfg: DppoTvConfig, x: TokenInputs) -> TokenTerms:
    rd, adv = x.ratio_detached, x.advantage
    kept = dppo_kept(cfg, x.logp, x.old_logp, adv)
    weight = torch.where(kept, torch.minimum(rd, _full(cfg.is_cap, rd)), torch.zeros_like(rd))
    # Dropped tokens are LN (A < 0) or HP (A > 0); kept ones whose weight the cap truncated are DUAL; A = 0 is M.
    region = torch.where(kept, torch.where(rd > cfg.is_cap, Region.DUAL.value, Region.M.value),
                         torch.where(adv > 0, Region.HP.value, Region.LN.value))
    region = torch.where(adv == 0, Region.M.value, region).to(torch.int8)
    # A dropped token's value is 0, also where its log-prob is -inf (not 0 * -inf).
    return TokenTerms(torch.where(kept, -adv * weight * x.logp, 0.0), weight, region)


def _vespo(cfg: VespoConfig, x: TokenInputs) -> TokenTerms:
    # x.log_ratio is the response's summed token log-ratios (MethodSpec.sequence_log_ratio): w is the product of
    # its ratios, phi = w^k e^(lambda (1 - w)) its gamma weight (phi(1) = 1), detached as in TRL's get_gamma_weights.
    rd, adv = x.ratio_detached, x.advantage
    pos = adv >= 0
    k = torch.where(pos, _full(cfg.k_pos, rd), _full(cfg.k_neg, rd))
    rate = torch.where(pos, _full(max(cfg.lambda_pos, 1e-4), rd), _full(max(cfg.lambda_neg, 1e-4), rd))
    log_w = x.log_ratio.detach().clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
    phi = torch.exp(rate + k * log_w - rate * log_w.exp())
    # A weight beyond the dtype's range (k = 10, lambda = 0, log w = 10: 3e42 in float32) is 0, as TRL's
    # nan_to_num(posinf=0): it drops that response. A NaN stays NaN (a bad input must reach the loss).
    phi = torch.where(phi == math.inf, 0.0, phi)
    # A weight of exactly 0 (w far above its peak) silences the token, also where l is infinite (not 0 * inf)
    silenced = (phi == 0) & x.logp.detach().isinf()
    return TokenTerms(torch.where(silenced, 0.0, -adv * phi * x.logp), phi, torch.zeros_like(rd, dtype=torch.int8))


def _dro(cfg: DroConfig, x: TokenInputs) -> TokenTerms:
    # REINFORCE plus (beta / 2) (l - l_old)^2 on the unclamped log-ratio, as verl's dro; psi is the policy-gradient
    # part (1), the penalty's slope beta (l - l_old) is apart.
    rd = x.ratio_detached
    drift = x.logp - x.old_logp
    loss = -x.advantage * x.logp + 0.5 * cfg.dro_beta * drift * drift
    return TokenTerms(loss, torch.ones_like(rd), torch.zeros_like(rd, dtype=torch.int8), cfg.dro_beta * drift.detach())


def _unclipped(cfg, x: TokenInputs) -> TokenTerms:
    # -A r with nothing clipped: geo_mean at its clipped geometric mean, kl_cov's tokens before its selection
    rd = x.ratio_detached
    return TokenTerms(-x.advantage * x.ratio, rd, torch.zeros_like(rd, dtype=torch.int8))


def _clip_cov(cfg: ClipCovConfig, x: TokenInputs) -> TokenTerms:
    return _ppo_clip(x, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, math.inf)


def _clip_cov_selection(cfg: ClipCovConfig, terms: TokenTerms, x: TokenInputs, scored, generator) -> TokenTerms:
    """verl's clip_cov: of the scored tokens PPO did not clip whose covariance lies in (lb, ub), a random
    ``clip_cov_ratio`` of the scored count (at least one) get no loss and no gradient (region DUAL)."""
    covariance = token_covariance(x.advantage, x.logp.detach(), scored, eps=1e-8)
    ppo_clipped = (terms.region == Region.LN.value) | (terms.region == Region.HP.value)
    candidates = scored & ~ppo_clipped & (covariance > cfg.clip_cov_lb) & (covariance < cfg.clip_cov_ub)
    cut = random_subset(candidates, selection_size(scored, cfg.clip_cov_ratio), generator)
    return TokenTerms(torch.where(cut, 0.0, terms.loss), torch.where(cut, 0.0, terms.psi),
                      torch.where(cut, Region.DUAL.value, terms.region).to(torch.int8), terms.penalty_slope)


def _kl_cov_selection(cfg: KlCovConfig, terms: TokenTerms, x: TokenInputs, scored, generator) -> TokenTerms:
    """verl's kl_cov: the ``kl_cov_ratio`` of the scored tokens (at least one) with the largest covariance get
    ``ppo_kl_coef |l - l_old|`` on top of -A r."""
    covariance = token_covariance(x.advantage, x.logp.detach(), scored, eps=0.0)
    chosen = top_subset(covariance, scored, selection_size(scored, cfg.kl_cov_ratio))
    drift = x.logp - x.old_logp
    loss = torch.where(chosen, terms.loss + cfg.ppo_kl_coef * drift.abs(), terms.loss)
    slope = torch.where(chosen, cfg.ppo_kl_coef * torch.sign(drift.detach()), 0.0)  # |x|' at 0 is 0, as torch's
    return TokenTerms(loss, terms.psi, terms.region, slope)


@dataclass(frozen=True)
class MethodSpec:
    """One row of the table: everything about a method that is not its Triton function.

    ``variants``: the parameter sets the tests run for it (the defaults first; every value of a
    ``choices`` parameter somewhere). ``presets``: other ``DGPOConfig`` values that ``dgpo-ops train``
    applies for this method unless given (a parameter read with an offset gets its default there by
    itself: TRL's default of that field means something else). ``paper``: where the method comes from.
    """

    config: type[MethodConfig]
    token_fn: Callable[..., TokenTerms]
    summary: str
    paper: str
    variants: tuple[dict, ...] = ({},)
    presets: dict = dataclasses.field(default_factory=dict)
    # "sum": the method is evaluated at its response's summed token log-ratios (each clamped to +-20), with the
    # rollout weights folded into that sum as log-weights instead of multiplying the loss (TRL's vespo and its
    # vLLM importance ratio). Such a method is sequence-level by itself: the torch objective evaluates it.
    # "clipped_mean": at the mean over its response of each token's log-ratio clipped in log space by the sign of
    # its advantage (GMPO's geometric mean), the rollout weights' logs averaged in.
    sequence_log_ratio: str | None = None
    # A batch-level stage after the per-token terms: (config, terms, inputs, scored, generator) -> terms, with
    # statistics over every scored token of the call (the torch objective evaluates such a method).
    token_selection: Callable[..., TokenTerms] | None = None
    # The aggregation verl's loss of this name uses whatever loss_agg_mode says (dgpo_ops.integrations.verl_params)
    verl_aggregation: str | None = None
    # The aggregation the method's authors or framework fix: the default of every loss function and of DGPOConfig
    # (TRL's loss_type has none for a method TRL lacks); an explicit aggregation wins. None: token_mean.
    aggregation: str | None = None


@dataclass(frozen=True)
class MethodAlias:
    """Another name for a method with some parameters preset (``dapo`` is grpo with clip-higher). The
    preset parameters apply where the caller leaves them unset."""

    method: str
    params: dict
    summary: str


METHODS: dict[str, MethodSpec] = {
    "grpo": MethodSpec(GrpoConfig, _grpo, "PPO clip; optional dual clip",
                       "PPO (Schulman et al. 2017) as GRPO uses it (DeepSeekMath, Shao et al. 2024); dual clip: "
                       "Ye et al. 2019, arXiv:1912.09729",
                       variants=({}, {"eps_high": 0.28, "dual_clip": 3.0}, {"delta": 1.5}, {"delta": 1.1, "dual_clip": 2.0})),
    "cispo": MethodSpec(CispoConfig, _cispo, "clipped IS weight times log-prob",
                        "CISPO: MiniMax-M1, arXiv:2506.13585", variants=({}, {"eps_low": 0.2, "eps_high": 0.28})),
    "dispo": MethodSpec(DispoConfig, _dispo, "CISPO with bounds by sign of A",
                        "DISPO: Rawal et al. 2026, arXiv:2602.00983"),
    "gppo": MethodSpec(GppoConfig, _gppo, "gradient-preserving clip, constant boundary weight",
                       "GPPO: Klear-Reasoner (Kuaishou, 2025)"),
    "ce_gppo": MethodSpec(CeGppoConfig, _gppo, "GPPO with boundary scales beta1, beta2", "CE-GPPO (Kuaishou, 2025)"),
    "aspo": MethodSpec(AspoConfig, _aspo, "flipped ratio for A>0, soft dual clip",
                       "ASPO: asymmetric importance sampling policy optimization (2025)"),
    "dgpo": MethodSpec(DgpoConfig, _dgpo, "decoupled polynomial / radical decay of the probability gradient",
                       "DGPO: Fu et al., 'From log pi to pi: Taming Divergence in Soft Clipping via Bilateral "
                       "Decoupled Decay of Probability Gradient Weight'",
                       variants=({}, {"n": 2.0, "m": 3.0}, {"n": 0.0, "m": 1.0})),
    "dcpo": MethodSpec(DcpoConfig, _dcpo, "PPO clip with bounds from the old probability",
                       "DCPO: Yang et al. (Baichuan), 'Dynamic Clipping Policy Optimization'",
                       presets={"advantage_estimator": "dcpo"},  # DCPO's smooth advantage standardisation
                       aggregation="seq_sum_token_mean"),  # DCPO's "only token mean"
    "sapo": MethodSpec(SapoConfig, _sapo, "soft gates instead of clipping",
                       "SAPO: arXiv:2511.20347 (sigmoid gate); the other gates: Denisov et al. 2026, "
                       "arXiv:2602.19345",
                       variants=({"gate": "sigmoid"}, {"gate": "erf", "tau_pos": 10.0, "tau_neg": 12.0},
                                 {"gate": "arctan"}, {"gate": "softsign", "tau_pos": 2.0, "tau_neg": 3.0})),
    "gpg": MethodSpec(GpgConfig, _gpg, "plain policy gradient: the log-prob times the advantage",
                      "GPG: Group Policy Gradient, Chu et al. 2025, arXiv:2504.02546"),
    "dppo_tv": MethodSpec(DppoTvConfig, _dppo, "capped IS weight; drops tokens whose probability moved more "
                          "than delta (total variation)",
                          "DPPO: Divergence-Proximal Policy Optimization, arXiv:2602.04879",
                          variants=({}, {"delta_low": 0.05, "delta_high": 0.1, "is_cap": 1.5})),
    "dppo_kl": MethodSpec(DppoKlConfig, _dppo, "DPPO with the binary KL of the token's probability as the divergence",
                          "DPPO: Divergence-Proximal Policy Optimization, arXiv:2602.04879",
                          variants=({}, {"delta_low": 0.01, "delta_high": 0.02, "is_cap": 1.5})),
    "vespo": MethodSpec(VespoConfig, _vespo, "a sequence's gamma weight of its ratio product times the log-prob",
                        "VESPO: TRL 1.16's loss_type='vespo' (GRPOTrainer.get_gamma_weights)",
                        variants=({}, {"k_pos": 1.0, "lambda_pos": 0.5, "k_neg": 4.0, "lambda_neg": 1.0}),
                        sequence_log_ratio="sum"),
    "dro": MethodSpec(DroConfig, _dro, "plain policy gradient with a quadratic penalty on the log-ratio",
                      "DRO as verl's policy_loss dro (Direct Reward Optimisation: Richemond et al. 2024, "
                      "arXiv:2405.19107)", variants=({"dro_beta": 0.1}, {"dro_beta": 2.0})),
    "geo_mean": MethodSpec(GeoMeanConfig, _unclipped, "the geometric mean of each response's token ratios, "
                           "clipped per token in log space",
                           "GMPO: Geometric-Mean Policy Optimization, Zhao et al. 2025, arXiv:2507.20673",
                           # (not 0.4, GMPO's own: tests/helpers.py's log-ratio grid holds -0.4, a tie in log space)
                           variants=({}, {"eps_low": 0.3, "eps_high": 0.35}), sequence_log_ratio="clipped_mean",
                           verl_aggregation="row-mean", aggregation="seq_mean_token_mean"),
    "clip_cov": MethodSpec(ClipCovConfig, _clip_cov, "PPO clip; a random few tokens of high covariance of A and "
                           "log-prob get no gradient",
                           "Clip-Cov: Cui et al. 2025, 'The Entropy Mechanism of Reinforcement Learning for "
                           "Reasoning Language Models', arXiv:2505.22617",
                           # ratio 1 cuts every candidate: tests comparing two paths then cut the same tokens
                           # (tests/test_token_selection.py draws at the default ratio)
                           variants=({"clip_cov_ratio": 1.0}, {"clip_cov_ratio": 1.0, "clip_cov_lb": -1.0,
                                                               "clip_cov_ub": 1.0}),
                           token_selection=_clip_cov_selection),
    "kl_cov": MethodSpec(KlCovConfig, _unclipped, "unclipped ratio; the tokens of highest covariance of A and "
                         "log-prob get a penalty on the log-ratio's absolute value",
                         "KL-Cov: Cui et al. 2025, arXiv:2505.22617",
                         variants=({}, {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}), token_selection=_kl_cov_selection),
}

ALIASES: dict[str, MethodAlias] = {
    "dapo": MethodAlias("grpo", {"eps_high": 0.28}, "DAPO's clip-higher"),
}


class _StraightThroughClamp(torch.autograd.Function):
    """Clamps the value and passes the gradient unchanged. Unlike ``x + (x.clamp(...) - x).detach()``
    it stays finite for infinite ``x`` (inf - inf would be nan); NaN stays NaN."""

    @staticmethod
    def forward(x, low, high):
        return x.clamp(low, high)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def straight_through_clamp(x: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    return _StraightThroughClamp.apply(x, low, high)


def method_config(method: str | MethodConfig, **params) -> MethodConfig:
    """Build (and validate) the config of a method or alias by name; unknown names and parameters raise
    ValueError. An alias (``ALIASES``) is its method with the alias's parameters where ``params`` leaves them
    unset: ``method_config("dapo")`` is ``method_config("grpo", eps_high=0.28)``."""
    if isinstance(method, MethodConfig):
        config_cls, base = type(method), dataclasses.asdict(method)
    elif method in METHODS:
        config_cls, base = METHODS[method].config, {}
    elif method in ALIASES:
        config_cls, base = METHODS[ALIASES[method].method].config, dict(ALIASES[method].params)
    else:
        raise ValueError(f"unknown method {method!r}; known methods: {', '.join([*METHODS, *ALIASES])}")
    allowed = [f.name for f in dataclasses.fields(config_cls)]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"{config_cls.name} does not take parameter(s) {', '.join(unknown)}; it takes {', '.join(allowed)}"
        )
    return config_cls(**{**base, **params})


def token_terms(
    cfg: MethodConfig,
    log_ratio: torch.Tensor,
    advantage: torch.Tensor,
    old_logp: torch.Tensor,
    logp: torch.Tensor | None = None,
    scored: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> TokenTerms:
    """Loss value, gradient weight psi, region (and penalty slope, ``TokenTerms``) of every token.

    ``log_ratio`` may carry autograd (l - l_old, or its sequence mean); ``old_logp`` is detached.
    ``logp`` is the token's own log-prob for the methods whose value uses ``l`` (cispo, dispo,
    aspo's dual branch); it defaults to ``log_ratio + old_logp``, which is ``l`` at token level.
    The log ratio is clamped to [-20, 20] straight-through: values are clamped, the gradient
    passes, so psi is evaluated at the clamped ratio instead of being zeroed (an infinite log
    ratio too). A method with a batch-level selection (``MethodSpec.token_selection``) selects among the
    ``scored`` tokens (default: all), drawing from ``generator`` where it draws at random.
    """
    if logp is None:
        logp = log_ratio + old_logp
    log_ratio = straight_through_clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    inputs = TokenInputs(log_ratio, ratio, ratio.detach(), advantage, logp, old_logp)
    spec = METHODS[cfg.name]
    terms = spec.token_fn(cfg, inputs)
    if spec.token_selection is not None:
        if scored is None:  # every token, on the grid the terms are on (advantages may be per response, (B, 1))
            scored = torch.ones(torch.broadcast_shapes(log_ratio.shape, advantage.shape), dtype=torch.bool,
                                device=log_ratio.device)
        terms = spec.token_selection(cfg, terms, inputs, scored, generator)
    slope = terms.penalty_slope
    return TokenTerms(terms.loss, terms.psi.detach(), terms.region, None if slope is None else slope.detach())
