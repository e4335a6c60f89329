"""Triton mirror of the method table (``dgpo_ops/methods.py``) for the kernels' per-token epilogue.

``token_terms`` takes one token's scalars and the fp32 parameter vector a ``MethodConfig`` lowers
to (``kernel_params``), and returns ``(L, psi, region)``. The method is a constexpr switch; every
hyperparameter is a runtime value. Tests compare this mirror with the torch table row by row.
"""

import triton
import triton.language as tl

from dgpo_ops.methods import Gate, KernelParam, MethodId, Region

GRPO = tl.constexpr(MethodId.GRPO.value)
DCPO = tl.constexpr(MethodId.DCPO.value)
CAPPED_IS = tl.constexpr(MethodId.CAPPED_IS.value)
GRADIENT_PRESERVING = tl.constexpr(MethodId.GRADIENT_PRESERVING.value)
ASPO = tl.constexpr(MethodId.ASPO.value)
DGPO = tl.constexpr(MethodId.DGPO.value)
SAPO = tl.constexpr(MethodId.SAPO.value)

GATE_SIGMOID = tl.constexpr(Gate.SIGMOID.value)
GATE_ERF = tl.constexpr(Gate.ERF.value)
GATE_ARCTAN = tl.constexpr(Gate.ARCTAN.value)
GATE_SOFTSIGN = tl.constexpr(Gate.SOFTSIGN.value)

REGION_M = tl.constexpr(Region.M.value)
REGION_LN = tl.constexpr(Region.LN.value)
REGION_HP = tl.constexpr(Region.HP.value)
REGION_LP = tl.constexpr(Region.LP.value)
REGION_HN = tl.constexpr(Region.HN.value)
REGION_DUAL = tl.constexpr(Region.DUAL.value)

P_LOW_POS = tl.constexpr(KernelParam.LOW_POS.value)
P_HIGH_POS = tl.constexpr(KernelParam.HIGH_POS.value)
P_LOW_NEG = tl.constexpr(KernelParam.LOW_NEG.value)
P_HIGH_NEG = tl.constexpr(KernelParam.HIGH_NEG.value)
P_EPS_LOW = tl.constexpr(KernelParam.EPS_LOW.value)
P_EPS_HIGH = tl.constexpr(KernelParam.EPS_HIGH.value)
P_DUAL_CLIP = tl.constexpr(KernelParam.DUAL_CLIP.value)
P_LN_WEIGHT = tl.constexpr(KernelParam.LN_WEIGHT.value)
P_HP_WEIGHT = tl.constexpr(KernelParam.HP_WEIGHT.value)
P_N = tl.constexpr(KernelParam.N.value)
P_M = tl.constexpr(KernelParam.M.value)
P_R_MAX = tl.constexpr(KernelParam.R_MAX.value)
P_TAU_POS = tl.constexpr(KernelParam.TAU_POS.value)
P_TAU_NEG = tl.constexpr(KernelParam.TAU_NEG.value)

LOG_RATIO_CLAMP = tl.constexpr(20.0)
NAN_PROPAGATING = tl.constexpr(tl.PropagateNan.ALL)
HALF_SQRT_PI_OVER_2 = tl.constexpr(1.2533141373155003)  # sqrt(pi / 2)
INV_SQRT2 = tl.constexpr(0.7071067811865476)


@triton.jit
def _regions(r, adv, low, high):
    region = tl.where((r < low) & (adv < 0), REGION_LN, REGION_M)
    region = tl.where((r > high) & (adv > 0), REGION_HP, region)
    region = tl.where((r < low) & (adv > 0), REGION_LP, region)
    return tl.where((r > high) & (adv < 0), REGION_HN, region)


@triton.jit
def _ppo_clip(r, adv, low, high, dual_clip):
    region = _regions(r, adv, low, high)
    in_ln = region == REGION_LN
    clipped = in_ln | (region == REGION_HP)
    dual = (adv < 0) & (r > dual_clip)
    loss = tl.where(clipped, -adv * tl.where(in_ln, low, high), -adv * r)
    loss = tl.where(dual, -adv * dual_clip, loss)
    psi = tl.where(clipped | dual, 0.0, r)
    return loss, psi, tl.where(dual, REGION_DUAL, region)


@triton.jit
def _atan(x):
    # libdevice's atan has no interpreter twin: three half-angle reductions
    # (atan x = 2 atan(x / (1 + sqrt(1 + x^2)))) bring |x| below 0.2, where eight odd terms
    # of the series are exact to fp32.
    t = x / (1.0 + tl.sqrt(1.0 + x * x))
    t = t / (1.0 + tl.sqrt(1.0 + t * t))
    t = t / (1.0 + tl.sqrt(1.0 + t * t))
    t2 = t * t
    series = 1.0 / 15.0
    series = 1.0 / 13.0 - t2 * series
    series = 1.0 / 11.0 - t2 * series
    series = 1.0 / 9.0 - t2 * series
    series = 1.0 / 7.0 - t2 * series
    series = 1.0 / 5.0 - t2 * series
    series = 1.0 / 3.0 - t2 * series
    series = 1.0 - t2 * series
    return 8.0 * t * series


@triton.jit
def _sapo_gate(r, tau, GATE: tl.constexpr):
    u = r - 1.0
    tu = tau * u
    if GATE == GATE_SIGMOID:
        s = tl.sigmoid(tu)
        value = s * 4.0 / tau
        slope = 4.0 * s * (1.0 - s)
    elif GATE == GATE_ERF:
        k = HALF_SQRT_PI_OVER_2 / tau
        value = k * (1.0 + tl.math.erf(tu * INV_SQRT2)) + 1.0 - k
        slope = tl.exp(-0.5 * tu * tu)
    elif GATE == GATE_ARCTAN:
        value = 1.0 + _atan(tu) / tau
        slope = 1.0 / (1.0 + tu * tu)
    else:
        d = 1.0 + tu * tu
        value = 1.0 + u / tl.sqrt(d)
        slope = 1.0 / (d * tl.sqrt(d))
    return value, slope


@triton.jit
def token_terms(log_ratio, adv, old_logp, logp, params_ptr, METHOD: tl.constexpr, GATE: tl.constexpr):
    """(L, psi, region) of one token; ``logp`` is the token's own log-prob (cispo's value uses it)."""
    log_ratio = tl.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP, propagate_nan=NAN_PROPAGATING)
    r = tl.exp(log_ratio)
    # min/max/clamp here propagate NaN (plain tl.minimum returns the other operand): a NaN ratio
    # must give a NaN loss, as torch does. Divisions and square roots that decide a region are
    # IEEE-rounded (div_rn, sqrt_rn) so ties resolve as in torch on a GPU too.
    low_pos = tl.load(params_ptr + P_LOW_POS)
    high_pos = tl.load(params_ptr + P_HIGH_POS)
    if METHOD == GRPO:
        loss, psi, region = _ppo_clip(r, adv, low_pos, high_pos, tl.load(params_ptr + P_DUAL_CLIP))
    elif METHOD == DCPO:
        q = tl.exp(old_logp)
        eps_low = tl.load(params_ptr + P_EPS_LOW)
        eps_high = tl.load(params_ptr + P_EPS_HIGH)
        r_max = tl.load(params_ptr + P_R_MAX)
        low = 0.5 + 0.5 * tl.sqrt_rn(tl.maximum(1.0 - tl.div_rn(4.0 * eps_low, q), 0.0))
        high = tl.minimum(0.5 + 0.5 * tl.sqrt_rn(1.0 + tl.div_rn(4.0 * eps_high, q)), r_max)
        loss, psi, region = _ppo_clip(r, adv, low, high, r_max)
    elif METHOD == CAPPED_IS:
        neg = adv < 0
        low = tl.where(neg, tl.load(params_ptr + P_LOW_NEG), low_pos)
        high = tl.where(neg, tl.load(params_ptr + P_HIGH_NEG), high_pos)
        psi = tl.minimum(tl.maximum(r, low, propagate_nan=NAN_PROPAGATING), high, propagate_nan=NAN_PROPAGATING)
        loss = -adv * psi * logp
        region = _regions(r, adv, low, high)
    elif METHOD == GRADIENT_PRESERVING:
        dual_clip = tl.load(params_ptr + P_DUAL_CLIP)
        region = _regions(r, adv, low_pos, high_pos)
        ln_weight = tl.load(params_ptr + P_LN_WEIGHT)
        hp_weight = tl.load(params_ptr + P_HP_WEIGHT)
        psi = tl.where(region == REGION_LN, ln_weight, tl.where(region == REGION_HP, hp_weight, r))
        loss = -adv * psi
        dual = (adv < 0) & (-adv * dual_clip < loss)
        loss = tl.where(dual, -adv * dual_clip, loss)
        psi = tl.where(dual, 0.0, psi)
        region = tl.where(dual, REGION_DUAL, region)
    elif METHOD == ASPO:
        c = tl.load(params_ptr + P_DUAL_CLIP)
        pos = adv >= 0
        p = tl.where(r > high_pos, high_pos, r)
        pos_dual = tl.div_rn(1.0, p) > c
        pos_loss = tl.where(pos_dual, -adv * c * logp, -adv / p)
        pos_psi = tl.where(pos_dual, c, tl.where(r > high_pos, 0.0, tl.div_rn(1.0, r)))
        u = tl.where(r < low_pos, low_pos, r)
        neg_dual = u > c
        neg_loss = tl.where(neg_dual, -adv * c * logp, -adv * u)
        neg_psi = tl.where(neg_dual, c, tl.where(r < low_pos, 0.0, r))
        loss = tl.where(pos, pos_loss, neg_loss)
        psi = tl.where(pos, pos_psi, neg_psi)
        dual = tl.where(pos, pos_dual, neg_dual) & (adv != 0)
        region = tl.where(dual, REGION_DUAL, _regions(r, adv, low_pos, high_pos))
    elif METHOD == DGPO:
        n = tl.load(params_ptr + P_N)
        m = tl.load(params_ptr + P_M)
        region = _regions(r, adv, low_pos, high_pos)
        log_low = tl.log(tl.maximum(low_pos, 1e-30))  # low = 0 leaves LN empty
        ln_weight = tl.exp(log_ratio + n * (log_ratio - log_low))
        hp_weight = tl.exp(log_ratio + (tl.log(high_pos) - log_ratio) / m)
        psi = tl.where(region == REGION_LN, ln_weight, tl.where(region == REGION_HP, hp_weight, r))
        loss = -adv * psi
    else:
        tau = tl.where(adv >= 0, tl.load(params_ptr + P_TAU_POS), tl.load(params_ptr + P_TAU_NEG))
        value, slope = _sapo_gate(r, tau, GATE)
        loss = -adv * value
        psi = slope * r
        region = tl.zeros_like(log_ratio).to(tl.int32) + REGION_M
    return loss, psi, region
