"""Triton mirror of the per-token rows of the method table (``dgpo_ops/methods/``) for the kernels' epilogue.

Only the methods the row kernels evaluate have a row here: those with a ``MethodId`` (each token's terms from
that token's inputs alone, ``MethodSpec.token_local``). ``kernel_token_terms`` takes one token's scalars and the fp32
parameter vector a ``MethodConfig`` lowers to (``kernel_params``), and returns ``(L, dL/dl, psi, region, r)``.
The method is a constexpr switch that names every ``MethodId`` and fails to compile on any other value
(``tl.static_assert``), so a method without a Triton branch is a compile error, never another method's
numbers. Every hyperparameter is a runtime value. Tests compare this mirror with the torch table row by row.
"""

import triton
import triton.language as tl

from . import codes


@triton.jit
def _regions(r, adv, low, high):
    region = tl.where((r < low) & (adv < 0), codes.REGION_LN, codes.REGION_M)
    region = tl.where((r > high) & (adv > 0), codes.REGION_HP, region)
    region = tl.where((r < low) & (adv > 0), codes.REGION_LP, region)
    return tl.where((r > high) & (adv < 0), codes.REGION_HN, region)


@triton.jit
def _ppo_clip(r, adv, low, high, dual_clip, delta):
    region = _regions(r, adv, low, high)
    in_ln = region == codes.REGION_LN
    clipped = in_ln | (region == codes.REGION_HP)
    loss = tl.where(clipped, -adv * tl.where(in_ln, low, high), -adv * r)
    # TRL's delta (as the table): A > 0 -> -A min(r, delta, high); A < 0 above high and delta -> -A max(delta, high)
    capped_pos = (adv > 0) & (r > delta)
    capped_neg = (adv < 0) & (r > high) & (r > delta)
    loss = tl.where(capped_pos, -adv * tl.minimum(delta, high), loss)
    loss = tl.where(capped_neg, -adv * tl.maximum(delta, high), loss)
    capped = capped_pos | capped_neg
    region = tl.where(capped & (region != codes.REGION_HP), codes.REGION_DUAL, region)
    dual = (adv < 0) & (r > dual_clip)
    loss = tl.where(dual, -adv * dual_clip, loss)
    psi = tl.where(clipped | capped | dual, 0.0, r)
    return loss, psi, tl.where(dual, codes.REGION_DUAL, region)


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
    if GATE == codes.GATE_SIGMOID:
        s = tl.sigmoid(tu)
        value = s * 4.0 / tau
        slope = 4.0 * s * (1.0 - s)
    elif GATE == codes.GATE_ERF:
        k = codes.HALF_SQRT_PI_OVER_2 / tau
        value = k * (1.0 + tl.math.erf(tu * codes.INV_SQRT2)) + 1.0 - k
        slope = tl.exp(-0.5 * tu * tu)
    elif GATE == codes.GATE_ARCTAN:
        value = 1.0 + _atan(tu) / tau
        slope = 1.0 / (1.0 + tu * tu)
    elif GATE == codes.GATE_SOFTSIGN:
        d = 1.0 + tu * tu
        value = 1.0 + u / tl.sqrt(d)
        slope = 1.0 / (d * tl.sqrt(d))
    else:
        tl.static_assert(False, "_sapo_gate: unknown GATE id")
    return value, slope


# One function per method id, each (L, psi, region) of one token from the clamped log ratio, the ratio
# r = exp(log ratio), A, the old and current log-probs and the parameter vector. min/max/clamp here
# propagate NaN (plain tl.minimum returns the other operand): a NaN ratio must give a NaN loss, as torch
# does. Divisions and square roots that decide a region are IEEE-rounded (div_rn, sqrt_rn) so ties
# resolve as in torch on a GPU too.


@triton.jit
def _ppo_clip_terms(log_ratio, r, adv, old_logp, logp, params_ptr):
    low = tl.load(params_ptr + codes.PARAM_LOW_POS)
    high = tl.load(params_ptr + codes.PARAM_HIGH_POS)
    return _ppo_clip(r, adv, low, high, tl.load(params_ptr + codes.PARAM_DUAL_CLIP),
                     tl.load(params_ptr + codes.PARAM_DELTA))


@triton.jit
def _dcpo_terms(log_ratio, r, adv, old_logp, logp, params_ptr):
    q = tl.exp(old_logp)
    eps_low = tl.load(params_ptr + codes.PARAM_THRESHOLD_LOW)
    eps_high = tl.load(params_ptr + codes.PARAM_THRESHOLD_HIGH)
    r_max = tl.load(params_ptr + codes.PARAM_RATIO_CAP)
    low = 0.5 + 0.5 * tl.sqrt_rn(tl.maximum(1.0 - tl.div_rn(4.0 * eps_low, q), 0.0))
    high = tl.minimum(0.5 + 0.5 * tl.sqrt_rn(1.0 + tl.div_rn(4.0 * eps_high, q)), r_max)
    return _ppo_clip(r, adv, low, high, r_max, tl.load(params_ptr + codes.PARAM_DELTA))  # +inf: no delta


@triton.jit
def _capped_is_terms(log_ratio, r, adv, old_logp, logp, params_ptr):
    neg = adv < 0
    low = tl.where(neg, tl.load(params_ptr + codes.PARAM_LOW_NEG), tl.load(params_ptr + codes.PARAM_LOW_POS))
    high = tl.where(neg, tl.load(params_ptr + codes.PARAM_HIGH_NEG), tl.load(params_ptr + codes.PARAM_HIGH_POS))
    psi = tl.minimum(tl.maximum(r, low, propagate_nan=codes.NAN_PROPAGATING), high,
                     propagate_nan=codes.NAN_PROPAGATING)
    return -adv * psi * logp, psi, _regions(r, adv, low, high)


@triton.jit
def _banded_is_terms(log_ratio, r, adv, old_logp, logp, params_ptr):
    low = tl.load(params_ptr + codes.PARAM_LOW_POS)
    high = tl.load(params_ptr + codes.PARAM_HIGH_POS)
    outside = (r <= low) | (r >= high)  # an open band; a NaN ratio is not outside (as the table)
    psi = tl.where(outside, 0.0, r)
    return tl.where(outside, 0.0, -adv * psi * logp), psi, _regions(r, adv, low, high)


@triton.jit
def _gradient_preserving_terms(log_ratio, r, adv, old_logp, logp, params_ptr):
    low = tl.load(params_ptr + codes.PARAM_LOW_POS)
    high = tl.load(params_ptr + codes.PARAM_HIGH_POS)
    dual_clip = tl.load(params_ptr + codes.PARAM_DUAL_CLIP)
    region = _regions(r, adv, low, high)
    ln_weight = tl.load(params_ptr + codes.PARAM_LN_WEIGHT)
    hp_weight = tl.load(params_ptr + codes.PARAM_HP_WEIGHT)
    psi = tl.where(region == codes.REGION_LN, ln_weight, tl.where(region == codes.REGION_HP, hp_weight, r))
    loss = -adv * psi
    dual = (adv < 0) & (-adv * dual_clip < loss)
    loss = tl.where(dual, -adv * dual_clip, loss)
    psi = tl.where(dual, 0.0, psi)
    return loss, psi, tl.where(dual, codes.REGION_DUAL, region)


@triton.jit
def _aspo_terms(log_ratio, r, adv, old_logp, logp, params_ptr):
    low = tl.load(params_ptr + codes.PARAM_LOW_POS)
    high = tl.load(params_ptr + codes.PARAM_HIGH_POS)
    c = tl.load(params_ptr + codes.PARAM_DUAL_CLIP)
    pos = adv >= 0
    p = tl.where(r > high, high, r)
    pos_dual = tl.div_rn(1.0, p) > c
    pos_loss = tl.where(pos_dual, -adv * c * logp, -adv / p)
    pos_psi = tl.where(pos_dual, c, tl.where(r > high, 0.0, tl.div_rn(1.0, r)))
    u = tl.where(r < low, low, r)
    neg_dual = u > c
    neg_loss = tl.where(neg_dual, -adv * c * logp, -adv * u)
    neg_psi = tl.where(neg_dual, c, tl.where(r < low, 0.0, r))
    dual = tl.where(pos, pos_dual, neg_dual) & (adv != 0)
    region = tl.where(dual, codes.REGION_DUAL, _regions(r, adv, low, high))
    return tl.where(pos, pos_loss, neg_loss), tl.where(pos, pos_psi, neg_psi), region


@triton.jit
def _dgpo_terms(log_ratio, r, adv, old_logp, logp, params_ptr):
    low = tl.load(params_ptr + codes.PARAM_LOW_POS)
    high = tl.load(params_ptr + codes.PARAM_HIGH_POS)
    n = tl.load(params_ptr + codes.PARAM_N)
    m = tl.load(params_ptr + codes.PARAM_M)
    region = _regions(r, adv, low, high)
    log_low = tl.log(tl.maximum(low, 1e-30))  # low = 0 leaves LN empty
    ln_weight = tl.exp(log_ratio + n * (log_ratio - log_low))
    hp_weight = tl.exp(log_ratio + (tl.log(high) - log_ratio) / m)
    psi = tl.where(region == codes.REGION_LN, ln_weight, tl.where(region == codes.REGION_HP, hp_weight, r))
    return -adv * psi, psi, region


@triton.jit
def _sapo_terms(log_ratio, r, adv, old_logp, logp, params_ptr, GATE: tl.constexpr):
    tau = tl.where(adv >= 0, tl.load(params_ptr + codes.PARAM_TAU_POS), tl.load(params_ptr + codes.PARAM_TAU_NEG))
    value, slope = _sapo_gate(r, tau, GATE)
    # SAPO has no trust region: every token is in M.
    return -adv * value, slope * r, tl.zeros_like(log_ratio).to(tl.int32) + codes.REGION_M


@triton.jit
def _reinforce_terms(log_ratio, r, adv, old_logp, logp, params_ptr):
    # gpg: L = -A l, psi = 1, every token in M.
    return -adv * logp, tl.zeros_like(adv) + 1.0, tl.zeros_like(adv).to(tl.int32) + codes.REGION_M


@triton.jit
def _dppo_terms(log_ratio, r, adv, old_logp, logp, params_ptr, BINARY_KL: tl.constexpr):
    delta_low = tl.load(params_ptr + codes.PARAM_THRESHOLD_LOW)
    delta_high = tl.load(params_ptr + codes.PARAM_THRESHOLD_HIGH)
    cap = tl.load(params_ptr + codes.PARAM_RATIO_CAP)
    p = tl.exp(logp)
    q = tl.exp(old_logp)
    pos = adv > 0
    # "not dropped": a NaN log-prob keeps its token and reaches the loss (as the table)
    if BINARY_KL:
        binary_kl = q * (old_logp - logp) + (1.0 - q) * tl.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        dropped = tl.where(pos, (binary_kl > delta_high) & (p > q), (binary_kl > delta_low) & (p < q))
    else:
        dropped = tl.where(pos, p - q > delta_high, p - q < -delta_low)
    kept = dropped == 0
    psi = tl.where(kept, tl.minimum(r, cap, propagate_nan=codes.NAN_PROPAGATING), 0.0)
    region = tl.where(kept, tl.where(r > cap, codes.REGION_DUAL, codes.REGION_M),
                      tl.where(pos, codes.REGION_HP, codes.REGION_LN))
    return tl.where(kept, -adv * psi * logp, 0.0), psi, tl.where(adv == 0, codes.REGION_M, region)


@triton.jit
def _prime_terms(log_ratio, r, adv, old_logp, logp, params_ptr, SYMMETRIC: tl.constexpr):
    # -A adv_tau r on the kept tokens; kernel_token_terms adds the penalty (as dro's)
    delta_low = tl.load(params_ptr + codes.PARAM_THRESHOLD_LOW)
    delta_high = tl.load(params_ptr + codes.PARAM_THRESHOLD_HIGH)
    moved = tl.exp(logp) - tl.exp(old_logp)
    rose = moved > delta_high
    fell = moved < -delta_low
    if SYMMETRIC:
        dropped = rose | fell
    else:
        dropped = tl.where(adv > 0, rose, fell)
    kept = dropped == 0  # "not dropped": a NaN log-prob keeps its token (as the table)
    psi = tl.where(kept, tl.load(params_ptr + codes.PARAM_ADV_SCALE) * r, 0.0)
    region = tl.where(logp > old_logp, tl.where(adv > 0, codes.REGION_HP, codes.REGION_HN),
                      tl.where(adv > 0, codes.REGION_LP, codes.REGION_LN))
    region = tl.where(kept | (adv == 0), codes.REGION_M, region)
    return tl.where(kept, -adv * psi, 0.0), psi, region


@triton.jit
def kernel_token_terms(log_ratio, adv, old_logp, logp, params_ptr, METHOD: tl.constexpr, GATE: tl.constexpr):
    """(L, dL/dl, psi, region, r) of one token: ``r`` is the ratio psi was evaluated at (exp of the clamped
    log ratio); dL/dl is -A psi plus a penalty's slope where the method has one (dro). ``logp`` is the token's
    own log-prob (cispo's value uses it). A switch over the method ids that fails to compile on any other."""
    log_ratio = tl.clamp(log_ratio, -codes.LOG_RATIO_CLAMP, codes.LOG_RATIO_CLAMP, propagate_nan=codes.NAN_PROPAGATING)
    r = tl.exp(log_ratio)
    if METHOD == codes.METHOD_PPO_CLIP:
        loss, psi, region = _ppo_clip_terms(log_ratio, r, adv, old_logp, logp, params_ptr)
    elif METHOD == codes.METHOD_DCPO:
        loss, psi, region = _dcpo_terms(log_ratio, r, adv, old_logp, logp, params_ptr)
    elif METHOD == codes.METHOD_CAPPED_IS:
        loss, psi, region = _capped_is_terms(log_ratio, r, adv, old_logp, logp, params_ptr)
    elif METHOD == codes.METHOD_GRADIENT_PRESERVING:
        loss, psi, region = _gradient_preserving_terms(log_ratio, r, adv, old_logp, logp, params_ptr)
    elif METHOD == codes.METHOD_ASPO:
        loss, psi, region = _aspo_terms(log_ratio, r, adv, old_logp, logp, params_ptr)
    elif METHOD == codes.METHOD_DGPO:
        loss, psi, region = _dgpo_terms(log_ratio, r, adv, old_logp, logp, params_ptr)
    elif METHOD == codes.METHOD_SAPO:
        loss, psi, region = _sapo_terms(log_ratio, r, adv, old_logp, logp, params_ptr, GATE)
    elif METHOD == codes.METHOD_REINFORCE:
        loss, psi, region = _reinforce_terms(log_ratio, r, adv, old_logp, logp, params_ptr)
    elif METHOD == codes.METHOD_DPPO_TV:
        loss, psi, region = _dppo_terms(log_ratio, r, adv, old_logp, logp, params_ptr, False)
    elif METHOD == codes.METHOD_DPPO_KL:
        loss, psi, region = _dppo_terms(log_ratio, r, adv, old_logp, logp, params_ptr, True)
    elif METHOD == codes.METHOD_DRO:
        loss, psi, region = _reinforce_terms(log_ratio, r, adv, old_logp, logp, params_ptr)
    elif METHOD == codes.METHOD_PRIME_DPPO:
        loss, psi, region = _prime_terms(log_ratio, r, adv, old_logp, logp, params_ptr, False)
    elif METHOD == codes.METHOD_PRIME_IPO:
        loss, psi, region = _prime_terms(log_ratio, r, adv, old_logp, logp, params_ptr, True)
    elif METHOD == codes.METHOD_BANDED_IS:
        loss, psi, region = _banded_is_terms(log_ratio, r, adv, old_logp, logp, params_ptr)
    else:
        tl.static_assert(False, "kernel_token_terms: unknown METHOD id (add the method's function and branch here)")
    dloss_dlogp = -adv * psi
    # (beta / 2) (l - l_old)^2: a slope not proportional to A (dro's; prime-rl's kl_tau term with beta = 2 kl_tau)
    if (METHOD == codes.METHOD_DRO) or (METHOD == codes.METHOD_PRIME_DPPO) or (METHOD == codes.METHOD_PRIME_IPO):
        beta = tl.load(params_ptr + codes.PARAM_PROXIMAL_BETA)
        drift = logp - old_logp  # unclamped, as verl's penalty (and the table's)
        loss += 0.5 * beta * drift * drift
        dloss_dlogp += beta * drift
    return loss, dloss_dlogp, psi, region, r
