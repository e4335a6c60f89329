"""Golden per-token values of every policy loss, computed by hand from each method's formula (docs/math.md,
"Methods").

Every expected number below is written as the method's formula evaluated with ``math``; nothing
is copied from running the package. A token is described by ``(r, A, q)``: the package receives
``log_ratio = log r``, ``advantage = A`` and ``old_logp = log q`` so that ``l = log r + log q``.

Each case is ``(r, A, q, expected_L, expected_psi, expected_region)``.
"""

import math

import pytest
import torch

from dgpo_ops import METHODS, Region, method_config, token_terms
from dgpo_ops.methods import catalog

REL = 1e-12
F64 = torch.float64

M, LN, HP, LP, HN, DUAL = Region.M, Region.LN, Region.HP, Region.LP, Region.HN, Region.DUAL

Q = 0.3  # default old probability, old_logp = log(0.3)


def ell(r, q):
    """l = log pi_theta = log r + l_old."""
    return math.log(r) + math.log(q)


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def sigma(z):
    return 1.0 / (1.0 + math.exp(-z))


# --------------------------------------------------------------------------------------------------
# Hand-computed cases, one entry per (method, parameter set).
# --------------------------------------------------------------------------------------------------

CASES = {}

# ---- grpo: L = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)); psi = r except 0 in LN, HP ---------
# defaults eps_low = eps_high = 0.2, no dual clip: region bounds 0.8 / 1.2
CASES["grpo-default"] = (
    "grpo",
    {},
    [
        (0.5, 1.5, Q, max(-1.5 * 0.5, -1.5 * clip(0.5, 1 - 0.2, 1 + 0.2)), 0.5, LP),
        (0.5, -0.7, Q, max(0.7 * 0.5, 0.7 * clip(0.5, 1 - 0.2, 1 + 0.2)), 0.0, LN),
        (1.1, 1.5, Q, max(-1.5 * 1.1, -1.5 * clip(1.1, 1 - 0.2, 1 + 0.2)), 1.1, M),
        (1.5, 1.5, Q, max(-1.5 * 1.5, -1.5 * clip(1.5, 1 - 0.2, 1 + 0.2)), 0.0, HP),
        (4.0, -0.7, Q, max(0.7 * 4.0, 0.7 * clip(4.0, 1 - 0.2, 1 + 0.2)), 4.0, HN),  # no dual clip
        (0.9, -0.7, Q, max(0.7 * 0.9, 0.7 * clip(0.9, 1 - 0.2, 1 + 0.2)), 0.9, M),
    ],
)
# non-default: eps_low=0.1, eps_high=0.28 (DAPO clip-higher), dual clip c=3: L = min(L, -A c) for A<0
CASES["grpo-dual"] = (
    "grpo",
    {"eps_low": 0.1, "eps_high": 0.28, "dual_clip": 3.0},
    [
        (4.0, -0.7, Q, min(max(0.7 * 4.0, 0.7 * clip(4.0, 0.9, 1.28)), 0.7 * 3.0), 0.0, DUAL),
        (2.5, -0.7, Q, min(max(0.7 * 2.5, 0.7 * clip(2.5, 0.9, 1.28)), 0.7 * 3.0), 2.5, HN),
        (4.0, 1.5, Q, max(-1.5 * 4.0, -1.5 * clip(4.0, 0.9, 1.28)), 0.0, HP),  # dual clip only for A<0
        (0.85, -0.7, Q, min(max(0.7 * 0.85, 0.7 * clip(0.85, 0.9, 1.28)), 0.7 * 3.0), 0.0, LN),
        (1.25, 1.5, Q, max(-1.5 * 1.25, -1.5 * clip(1.25, 0.9, 1.28)), 1.25, M),
        (0.85, 1.5, Q, max(-1.5 * 0.85, -1.5 * clip(0.85, 0.9, 1.28)), 0.85, LP),
    ],
)

# ---- cispo: L = -A clip(r, 1-eps_low, 1+eps_high) l; psi = clip(r, ...) -----------------------------
# defaults eps_low = 1.0, eps_high = 4.0: clip(r, 0, 5)
CASES["cispo-default"] = (
    "cispo",
    {},
    [
        (0.5, 1.5, Q, -1.5 * clip(0.5, 0.0, 5.0) * ell(0.5, Q), clip(0.5, 0.0, 5.0), M),
        (7.0, 1.5, Q, -1.5 * clip(7.0, 0.0, 5.0) * ell(7.0, Q), 5.0, HP),
        (7.0, -0.7, Q, 0.7 * clip(7.0, 0.0, 5.0) * ell(7.0, Q), 5.0, HN),
        (1.0, -0.7, Q, 0.7 * 1.0 * ell(1.0, Q), 1.0, M),
        (0.05, -0.7, 0.9, 0.7 * 0.05 * ell(0.05, 0.9), 0.05, M),  # no lower clip at eps_low = 1
    ],
)
CASES["cispo-tight"] = (
    "cispo",
    {"eps_low": 0.2, "eps_high": 0.28},
    [
        (0.5, -0.7, Q, 0.7 * clip(0.5, 0.8, 1.28) * ell(0.5, Q), 0.8, LN),
        (0.5, 1.5, Q, -1.5 * clip(0.5, 0.8, 1.28) * ell(0.5, Q), 0.8, LP),
        (1.5, 1.5, Q, -1.5 * clip(1.5, 0.8, 1.28) * ell(1.5, Q), 1.28, HP),
        (1.5, -0.7, Q, 0.7 * clip(1.5, 0.8, 1.28) * ell(1.5, Q), 1.28, HN),
        (1.1, 1.5, 0.9, -1.5 * 1.1 * ell(1.1, 0.9), 1.1, M),
    ],
)

# ---- dispo: cispo with (eps_low_pos, eps_high_pos) for A>0, (eps_low_neg, eps_high_neg) for A<0 ----
# defaults 0.2, 10, 1, 100: A>0 clip(r, 0.8, 11); A<0 clip(r, 0, 101)
CASES["dispo-default"] = (
    "dispo",
    {},
    [
        (0.5, 1.5, Q, -1.5 * clip(0.5, 0.8, 11.0) * ell(0.5, Q), 0.8, LP),
        (0.5, -0.7, Q, 0.7 * clip(0.5, 0.0, 101.0) * ell(0.5, Q), 0.5, M),
        (20.0, 1.5, Q, -1.5 * clip(20.0, 0.8, 11.0) * ell(20.0, Q), 11.0, HP),
        (20.0, -0.7, Q, 0.7 * clip(20.0, 0.0, 101.0) * ell(20.0, Q), 20.0, M),
        (150.0, -0.7, Q, 0.7 * clip(150.0, 0.0, 101.0) * ell(150.0, Q), 101.0, HN),
        (1.1, 1.5, Q, -1.5 * 1.1 * ell(1.1, Q), 1.1, M),
    ],
)
# non-default: pos (0.1, 0.5) -> [0.9, 1.5]; neg (0.3, 2.0) -> [0.7, 3.0]
CASES["dispo-custom"] = (
    "dispo",
    {"eps_low_pos": 0.1, "eps_high_pos": 0.5, "eps_low_neg": 0.3, "eps_high_neg": 2.0},
    [
        (0.85, 1.5, Q, -1.5 * clip(0.85, 0.9, 1.5) * ell(0.85, Q), 0.9, LP),
        (0.6, -0.7, Q, 0.7 * clip(0.6, 0.7, 3.0) * ell(0.6, Q), 0.7, LN),
        (1.6, 1.5, Q, -1.5 * clip(1.6, 0.9, 1.5) * ell(1.6, Q), 1.5, HP),
        (1.6, -0.7, Q, 0.7 * clip(1.6, 0.7, 3.0) * ell(1.6, Q), 1.6, M),
        (4.0, -0.7, Q, 0.7 * clip(4.0, 0.7, 3.0) * ell(4.0, Q), 3.0, HN),
        (0.85, -0.7, Q, 0.7 * clip(0.85, 0.7, 3.0) * ell(0.85, Q), 0.85, M),
    ],
)

# ---- gppo / ce_gppo: LN L = -A beta1 (1-eps_low), psi = beta1 (1-eps_low);
#      HP L = -A beta2 (1+eps_high), psi = beta2 (1+eps_high); else L = -A r, psi = r;
#      dual clip for A<0: L = min(L, -A c), psi = 0 where taken. --------------------------------------
# gppo defaults: eps 0.2/0.2, beta1 = beta2 = 1, c = 3
CASES["gppo-default"] = (
    "gppo",
    {},
    [
        (0.5, -0.7, Q, min(0.7 * 1.0 * (1 - 0.2), 0.7 * 3.0), 1.0 * (1 - 0.2), LN),
        (0.5, 1.5, Q, -1.5 * 0.5, 0.5, LP),
        (1.5, 1.5, Q, -1.5 * 1.0 * (1 + 0.2), 1.0 * (1 + 0.2), HP),
        (1.5, -0.7, Q, min(0.7 * 1.5, 0.7 * 3.0), 1.5, HN),
        (4.0, -0.7, Q, min(0.7 * 4.0, 0.7 * 3.0), 0.0, DUAL),
        (1.0, 1.5, Q, -1.5 * 1.0, 1.0, M),
    ],
)
CASES["gppo-nodual"] = (
    "gppo",
    {"eps_low": 0.1, "eps_high": 0.3, "dual_clip": None},
    [
        (4.0, -0.7, Q, 0.7 * 4.0, 4.0, HN),
        (0.5, -0.7, Q, 0.7 * (1 - 0.1), 1 - 0.1, LN),
        (2.0, 1.5, Q, -1.5 * (1 + 0.3), 1 + 0.3, HP),
        (1.2, -0.7, Q, 0.7 * 1.2, 1.2, M),
    ],
)
CASES["gppo-dual2"] = (
    "gppo",
    {"dual_clip": 2.0},
    [
        (2.5, -0.7, Q, min(0.7 * 2.5, 0.7 * 2.0), 0.0, DUAL),
        (1.8, -0.7, Q, min(0.7 * 1.8, 0.7 * 2.0), 1.8, HN),
        (2.5, 1.5, Q, -1.5 * (1 + 0.2), 1 + 0.2, HP),
    ],
)
# ce_gppo defaults: beta1 = 0.75, beta2 = 1.0, eps 0.2/0.2, c = 3
CASES["ce_gppo-default"] = (
    "ce_gppo",
    {},
    [
        (0.5, -0.7, Q, min(0.7 * 0.75 * (1 - 0.2), 0.7 * 3.0), 0.75 * (1 - 0.2), LN),
        (1.5, 1.5, Q, -1.5 * 1.0 * (1 + 0.2), 1.0 * (1 + 0.2), HP),
        (4.0, -0.7, Q, min(0.7 * 4.0, 0.7 * 3.0), 0.0, DUAL),
        (0.9, -0.7, Q, 0.7 * 0.9, 0.9, M),
        (0.5, 1.5, Q, -1.5 * 0.5, 0.5, LP),
    ],
)
CASES["ce_gppo-custom"] = (
    "ce_gppo",
    {"beta1": 0.5, "beta2": 0.8, "eps_low": 0.25, "eps_high": 0.3, "dual_clip": 4.0},
    [
        (0.6, -0.7, Q, min(0.7 * 0.5 * (1 - 0.25), 0.7 * 4.0), 0.5 * (1 - 0.25), LN),
        (2.0, 1.5, Q, -1.5 * 0.8 * (1 + 0.3), 0.8 * (1 + 0.3), HP),
        (3.5, -0.7, Q, min(0.7 * 3.5, 0.7 * 4.0), 3.5, HN),
        (5.0, -0.7, Q, min(0.7 * 5.0, 0.7 * 4.0), 0.0, DUAL),
        (0.6, 1.5, Q, -1.5 * 0.6, 0.6, LP),
        (1.1, 1.5, Q, -1.5 * 1.1, 1.1, M),
    ],
)

# ---- aspo ---------------------------------------------------------------------------------------
# A>0: p = min(r, 1+eps_high); 1/p > c -> L = -A c l, psi = c (DUAL); else L = -A/p,
#      psi = 1/r if r <= 1+eps_high else 0.
# A<0: u = max(r, 1-eps_low); u > c -> L = -A c l, psi = c (DUAL); else L = -A u,
#      psi = r if r >= 1-eps_low else 0.
# defaults eps 0.2/0.2, c = 3
CASES["aspo-default"] = (
    "aspo",
    {},
    [
        (0.2, 1.5, Q, -1.5 * 3.0 * ell(0.2, Q), 3.0, DUAL),  # 1/p = 5 > 3
        (0.5, 1.5, Q, -1.5 / min(0.5, 1.2), 1 / 0.5, LP),  # 1/p = 2 <= 3
        (1.1, 1.5, Q, -1.5 / min(1.1, 1.2), 1 / 1.1, M),
        (1.5, 1.5, Q, -1.5 / min(1.5, 1.2), 0.0, HP),
        (0.5, -0.7, Q, 0.7 * max(0.5, 0.8), 0.0, LN),
        (2.0, -0.7, Q, 0.7 * max(2.0, 0.8), 2.0, HN),
        (4.0, -0.7, Q, 0.7 * 3.0 * ell(4.0, Q), 3.0, DUAL),  # u = 4 > 3
        (0.9, -0.7, 0.9, 0.7 * max(0.9, 0.8), 0.9, M),
    ],
)
# non-default: c = 2, eps_low = 0.1 (bound 0.9), eps_high = 0.4 (bound 1.4)
CASES["aspo-custom"] = (
    "aspo",
    {"dual_clip": 2.0, "eps_low": 0.1, "eps_high": 0.4},
    [
        (0.4, 1.5, Q, -1.5 * 2.0 * ell(0.4, Q), 2.0, DUAL),  # 1/p = 2.5 > 2
        (0.6, 1.5, Q, -1.5 / min(0.6, 1.4), 1 / 0.6, LP),  # 1/p = 1.67 <= 2
        (1.3, 1.5, Q, -1.5 / min(1.3, 1.4), 1 / 1.3, M),
        (1.7, 1.5, Q, -1.5 / min(1.7, 1.4), 0.0, HP),
        (2.5, -0.7, 0.2, 0.7 * 2.0 * ell(2.5, 0.2), 2.0, DUAL),  # u = 2.5 > 2
        (1.8, -0.7, Q, 0.7 * max(1.8, 0.9), 1.8, HN),
        (0.85, -0.7, Q, 0.7 * max(0.85, 0.9), 0.0, LN),
    ],
)

# ---- dgpo ---------------------------------------------------------------------------------------
# LN: L = -A r^(n+1)/(1-eps_low)^n, psi = r^(n+1)/(1-eps_low)^n
# HP: L = -A (1+eps_high)^(1/m) r^((m-1)/m), psi = (1+eps_high)^(1/m) r^((m-1)/m)
# else L = -A r, psi = r; no dual clip.  Defaults n = 1, m = 2, eps 0.2/0.2.
CASES["dgpo-default"] = (
    "dgpo",
    {},
    [
        (0.5, -0.7, Q, 0.7 * 0.5 ** (1 + 1) / 0.8**1, 0.5 ** (1 + 1) / 0.8**1, LN),
        (1.5, 1.5, Q, -1.5 * 1.2 ** (1 / 2) * 1.5 ** ((2 - 1) / 2), 1.2 ** (1 / 2) * 1.5 ** ((2 - 1) / 2), HP),
        (0.5, 1.5, Q, -1.5 * 0.5, 0.5, LP),
        (4.0, -0.7, Q, 0.7 * 4.0, 4.0, HN),
        (1.1, -0.7, Q, 0.7 * 1.1, 1.1, M),
        (0.1, -0.7, 0.9, 0.7 * 0.1**2 / 0.8, 0.1**2 / 0.8, LN),
    ],
)
# paper's 1.5B setting generalised: n = 2, m = 3, eps_low = 0.1, eps_high = 0.28
CASES["dgpo-n2m3"] = (
    "dgpo",
    {"n": 2, "m": 3, "eps_low": 0.1, "eps_high": 0.28},
    [
        (0.6, -0.7, Q, 0.7 * 0.6 ** (2 + 1) / 0.9**2, 0.6 ** (2 + 1) / 0.9**2, LN),
        (2.0, 1.5, Q, -1.5 * 1.28 ** (1 / 3) * 2.0 ** ((3 - 1) / 3), 1.28 ** (1 / 3) * 2.0 ** ((3 - 1) / 3), HP),
        (1.25, 1.5, Q, -1.5 * 1.25, 1.25, M),
        (0.6, 1.5, Q, -1.5 * 0.6, 0.6, LP),
        (2.0, -0.7, Q, 0.7 * 2.0, 2.0, HN),
    ],
)
# n = 0, m = 1: LN weight r^1 / 1 = r, HP weight (1+eps_high)^1 r^0 = 1+eps_high
CASES["dgpo-n0m1"] = (
    "dgpo",
    {"n": 0, "m": 1},
    [
        (0.5, -0.7, Q, 0.7 * 0.5 ** (0 + 1) / 0.8**0, 0.5 ** (0 + 1) / 0.8**0, LN),
        (1.5, 1.5, Q, -1.5 * 1.2 ** (1 / 1) * 1.5 ** ((1 - 1) / 1), 1.2 ** (1 / 1) * 1.5 ** 0.0, HP),
    ],
)
# non-integer n, m
CASES["dgpo-n1.5m2.5"] = (
    "dgpo",
    {"n": 1.5, "m": 2.5},
    [
        (0.5, -0.7, Q, 0.7 * 0.5 ** (1.5 + 1) / 0.8**1.5, 0.5 ** (1.5 + 1) / 0.8**1.5, LN),
        (3.0, 1.5, Q, -1.5 * 1.2 ** (1 / 2.5) * 3.0 ** ((2.5 - 1) / 2.5), 1.2 ** (1 / 2.5) * 3.0 ** (1.5 / 2.5), HP),
    ],
)


# ---- dcpo: grpo with bounds lower(q), upper(q) and dual clip c = r_max for A<0 ------------------
def dcpo_lower(q, eps_low):
    return 0.5 + 0.5 * math.sqrt(max(1 - 4 * eps_low / q, 0.0))


def dcpo_upper(q, eps_high, r_max):
    return min(0.5 + 0.5 * math.sqrt(1 + 4 * eps_high / q), r_max)


def dcpo_loss(r, A, q, eps_low, eps_high, r_max):
    lo, hi = dcpo_lower(q, eps_low), dcpo_upper(q, eps_high, r_max)
    L = max(-A * r, -A * clip(r, lo, hi))
    if A < 0:
        L = min(L, -A * r_max)
    return L


# defaults eps_low = 0.16, eps_high = 0.2, r_max = 10.
# q = 0.9: lower = 0.5 + 0.5 sqrt(1 - 0.64/0.9) ~ 0.769, upper = 0.5 + 0.5 sqrt(1 + 0.8/0.9) ~ 1.187
# q = 0.3: lower = 0.5 (max(.,0) active), upper ~ 1.457
# q = 0.001: upper = min(~14.65, 10) = 10
_D = (0.16, 0.2, 10.0)
CASES["dcpo-default"] = (
    "dcpo",
    {},
    [
        (0.7, -0.7, 0.9, dcpo_loss(0.7, -0.7, 0.9, *_D), 0.0, LN),
        (0.7, 1.5, 0.9, dcpo_loss(0.7, 1.5, 0.9, *_D), 0.7, LP),
        (1.3, 1.5, 0.9, dcpo_loss(1.3, 1.5, 0.9, *_D), 0.0, HP),
        (0.6, -0.7, 0.3, dcpo_loss(0.6, -0.7, 0.3, *_D), 0.6, M),  # lower(0.3) = 0.5
        (1.3, 1.5, 0.3, dcpo_loss(1.3, 1.5, 0.3, *_D), 1.3, M),
        (2.0, -0.7, 0.3, dcpo_loss(2.0, -0.7, 0.3, *_D), 2.0, HN),
        (12.0, -0.7, 0.001, dcpo_loss(12.0, -0.7, 0.001, *_D), 0.0, DUAL),
        (12.0, 1.5, 0.001, dcpo_loss(12.0, 1.5, 0.001, *_D), 0.0, HP),
    ],
)
# explicit formulas for a few of the above, independent of the helper
CASES["dcpo-default-explicit"] = (
    "dcpo",
    {},
    [
        (0.7, -0.7, 0.9, 0.7 * (0.5 + 0.5 * math.sqrt(1 - 4 * 0.16 / 0.9)), 0.0, LN),
        (1.3, 1.5, 0.9, -1.5 * (0.5 + 0.5 * math.sqrt(1 + 4 * 0.2 / 0.9)), 0.0, HP),
        (12.0, -0.7, 0.001, 0.7 * 10.0, 0.0, DUAL),
        (12.0, 1.5, 0.001, -1.5 * 10.0, 0.0, HP),
    ],
)
# non-default eps_low = 0.1, eps_high = 0.3, r_max = 4.
# q = 0.5: lower = 0.5 + 0.5 sqrt(0.2) ~ 0.724, upper = 0.5 + 0.5 sqrt(3.4) ~ 1.422
# q = 0.05: upper = 0.5 + 0.5 * 5 = 3.0 ; q = 0.01: upper = min(6, 4) = 4
_C = (0.1, 0.3, 4.0)
CASES["dcpo-custom"] = (
    "dcpo",
    {"eps_low": 0.1, "eps_high": 0.3, "r_max": 4.0},
    [
        (0.6, -0.7, 0.5, 0.7 * (0.5 + 0.5 * math.sqrt(1 - 4 * 0.1 / 0.5)), 0.0, LN),
        (1.6, 1.5, 0.5, -1.5 * (0.5 + 0.5 * math.sqrt(1 + 4 * 0.3 / 0.5)), 0.0, HP),
        (3.5, -0.7, 0.05, dcpo_loss(3.5, -0.7, 0.05, *_C), 3.5, HN),  # = 0.7 * 3.5 < 0.7 * 4
        (5.0, -0.7, 0.05, min(max(0.7 * 5.0, 0.7 * 3.0), 0.7 * 4.0), 0.0, DUAL),
        (5.0, 1.5, 0.01, -1.5 * 4.0, 0.0, HP),
        (3.9, 1.5, 0.01, -1.5 * 3.9, 3.9, M),
        (0.6, 1.5, 0.5, -1.5 * 0.6, 0.6, LP),
    ],
)


# ---- sapo: L = -A f_tau(r), psi = f'_tau(r) r, tau = tau_pos if A>0 else tau_neg; all region M ---
def gate_f(gate, tau, x):
    if gate == "sigmoid":
        return sigma(tau * (x - 1)) * 4 / tau
    if gate == "erf":
        k = math.sqrt(math.pi / (2 * tau**2))
        return k * (1 + math.erf(tau * (x - 1) / math.sqrt(2))) + 1 - k
    if gate == "arctan":
        return 1 + math.atan(tau * (x - 1)) / tau
    if gate == "softsign":
        return 1 + (x - 1) / math.sqrt(1 + tau**2 * (x - 1) ** 2)
    raise AssertionError(gate)


def gate_fprime(gate, tau, x):
    if gate == "sigmoid":
        s = sigma(tau * (x - 1))
        return 4 * s * (1 - s)
    if gate == "erf":
        return math.exp(-(tau**2) * (x - 1) ** 2 / 2)
    if gate == "arctan":
        return 1 / (1 + tau**2 * (x - 1) ** 2)
    if gate == "softsign":
        return (1 + tau**2 * (x - 1) ** 2) ** (-3 / 2)
    raise AssertionError(gate)


def sapo_cases(gate, tau_pos, tau_neg):
    out = []
    for r in (0.5, 0.9, 1.0, 1.5, 4.0):
        for A in (1.5, -0.7):
            tau = tau_pos if A > 0 else tau_neg
            out.append((r, A, Q, -A * gate_f(gate, tau, r), gate_fprime(gate, tau, r) * r, M))
    return out


for _gate in ("sigmoid", "erf", "arctan", "softsign"):
    CASES[f"sapo-{_gate}-default"] = ("sapo", {"gate": _gate}, sapo_cases(_gate, 1.0, 1.05))
    CASES[f"sapo-{_gate}-10-12"] = (
        "sapo",
        {"gate": _gate, "tau_pos": 10.0, "tau_neg": 12.0},
        sapo_cases(_gate, 10.0, 12.0),
    )

# sapo default gate is sigmoid; explicit spot values for it at r = 1 (f(1) = 2/tau, f'(1) = 1)
CASES["sapo-default-explicit"] = (
    "sapo",
    {},
    [
        (1.0, 1.5, Q, -1.5 * 2 / 1.0, 1.0, M),
        (1.0, -0.7, Q, 0.7 * 2 / 1.05, 1.0, M),
        (
            1.5,
            1.5,
            Q,
            -1.5 * 4 / 1.0 / (1 + math.exp(-1.0 * 0.5)),
            4 * sigma(0.5) * (1 - sigma(0.5)) * 1.5,
            M,
        ),
        (
            0.5,
            -0.7,
            Q,
            0.7 * 4 / 1.05 / (1 + math.exp(1.05 * 0.5)),
            4 * sigma(-0.525) * (1 - sigma(-0.525)) * 0.5,
            M,
        ),
    ],
)
# erf / arctan / softsign pass through f(1) = 1: L = -A at r = 1, psi = 1
for _gate in ("erf", "arctan", "softsign"):
    CASES[f"sapo-{_gate}-at-1"] = (
        "sapo",
        {"gate": _gate, "tau_pos": 3.0, "tau_neg": 5.0},
        [(1.0, 1.5, Q, -1.5, 1.0, M), (1.0, -0.7, Q, 0.7, 1.0, M)],
    )


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _inputs(points, requires_grad=False):
    log_ratio = torch.tensor([math.log(p[0]) for p in points], dtype=F64, requires_grad=requires_grad)
    adv = torch.tensor([p[1] for p in points], dtype=F64)
    old = torch.tensor([math.log(p[2]) for p in points], dtype=F64)
    return log_ratio, adv, old


def _approx(x):
    return pytest.approx(x, rel=REL, abs=0.0)


# ---- grpo with TRL's delta, as grpo_trainer._compute_loss writes it: coef_2 = clamp(r, 1 - eps_low, 1 + eps_high)
# from the uncapped ratio, then coef_1 = min(r, delta), L = -min(coef_1 A, coef_2 A); psi = dL/dl / -A ----
def trl_delta_loss(r, A, delta, low=0.8, high=1.2):
    return -min(min(r, delta) * A, clip(r, low, high) * A)


CASES["grpo-delta-above-high"] = (  # delta 1.5 >= 1 + eps_high: for A < 0 it is the dual clip at c = delta
    "grpo",
    {"delta": 1.5},
    [
        (1.1, 1.5, Q, trl_delta_loss(1.1, 1.5, 1.5), 1.1, M),
        (1.3, 1.5, Q, trl_delta_loss(1.3, 1.5, 1.5), 0.0, HP),  # above high: clipped as ever
        (1.4, -0.7, Q, trl_delta_loss(1.4, -0.7, 1.5), 1.4, HN),  # below delta: PPO's HN
        (2.0, -0.7, Q, trl_delta_loss(2.0, -0.7, 1.5), 0.0, DUAL),  # above delta: -A delta
    ],
)
CASES["grpo-delta-below-high"] = (  # delta 1.1 < 1 + eps_high: the cap bites inside the trust region
    "grpo",
    {"delta": 1.1},
    [
        (1.05, 1.5, Q, trl_delta_loss(1.05, 1.5, 1.1), 1.05, M),
        (1.15, 1.5, Q, trl_delta_loss(1.15, 1.5, 1.1), 0.0, DUAL),  # -A delta
        (1.15, -0.7, Q, trl_delta_loss(1.15, -0.7, 1.1), 1.15, M),  # inside [low, high] with A < 0: untouched
        (1.5, -0.7, Q, trl_delta_loss(1.5, -0.7, 1.1), 0.0, DUAL),  # above high and delta: -A max(delta, high)
        (0.5, -0.7, Q, trl_delta_loss(0.5, -0.7, 1.1), 0.0, LN),
    ],
)
assert trl_delta_loss(1.5, -0.7, 1.1) == 0.7 * 1.2 and trl_delta_loss(1.15, 1.5, 1.1) == -1.5 * 1.1


# ---- gpg: REINFORCE, L = -A l, psi = 1, every token in M (verl's compute_policy_loss_gpg) ----
CASES["gpg-default"] = (
    "gpg",
    {},
    [
        (0.5, 1.5, Q, -1.5 * ell(0.5, Q), 1.0, M),
        (3.0, -0.7, Q, 0.7 * ell(3.0, Q), 1.0, M),
        (1.0, 1.5, 0.9, -1.5 * ell(1.0, 0.9), 1.0, M),
    ],
)


# ---- dppo (verl's compute_policy_loss_dppo_tv / _kl): with p = r q, a token is dropped (L = psi = 0) when its
# probability moved too far; kept: w = min(r, is_cap), L = -A w l, psi = w. Defaults delta 0.2, is_cap 3 ----
def binary_kl(q, p):
    return q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))


assert binary_kl(0.3, 0.6) < 0.2 < binary_kl(0.3, 0.75) and binary_kl(0.3, 0.06) > 0.2  # the cases below
CASES["dppo_tv-default"] = (
    "dppo_tv",
    {},
    [
        (1.5, 1.5, Q, -1.5 * 1.5 * ell(1.5, Q), 1.5, M),  # p - q = 0.15 <= 0.2: kept
        (2.0, 1.5, Q, 0.0, 0.0, HP),  # p - q = 0.3 > 0.2, A > 0: dropped
        (0.2, -0.7, Q, 0.0, 0.0, LN),  # p - q = -0.24 < -0.2, A < 0: dropped
        (0.5, -0.7, Q, 0.7 * 0.5 * ell(0.5, Q), 0.5, M),  # p - q = -0.15: kept
        (4.0, 1.5, 0.02, -1.5 * 3.0 * ell(4.0, 0.02), 3.0, DUAL),  # p - q = 0.06: kept, the weight capped
        (4.0, -0.7, 0.02, 0.7 * 3.0 * ell(4.0, 0.02), 3.0, DUAL),
    ],
)
CASES["dppo_kl-default"] = (
    "dppo_kl",
    {},
    [
        (2.0, 1.5, Q, -1.5 * 2.0 * ell(2.0, Q), 2.0, M),  # p = 0.6: KL 0.18 <= 0.2, kept
        (2.5, 1.5, Q, 0.0, 0.0, HP),  # p = 0.75: KL 0.45 > 0.2 and p > q: dropped
        (0.5, 1.5, Q, -1.5 * 0.5 * ell(0.5, Q), 0.5, M),  # p < q with A > 0: always kept
        (0.2, -0.7, Q, 0.0, 0.0, LN),  # p = 0.06: KL 0.28 > 0.2 and p < q: dropped
        (2.5, -0.7, Q, 0.7 * 2.5 * ell(2.5, Q), 2.5, M),  # p > q with A < 0: always kept; below the cap
    ],
)

# ---- prime-rl (default_loss_fn / ipo_loss_fn): -adv_tau A r on kept tokens, 0 on dropped ones, plus kl_tau (log r)^2
# (kl_tau = 0 here, so that dL/dl = -A psi; test_prime_penalty_by_hand checks the penalty). prime_dppo keeps as
# dppo_tv (p - q <= 0.2 for A > 0, >= -0.2 for A <= 0); prime_ipo keeps |p - q| <= 0.1 whatever A ----
CASES["prime_dppo-no_penalty"] = (
    "prime_dppo",
    {"kl_tau": 0.0},
    [
        (1.5, 1.5, Q, -1.5 * 1.5, 1.5, M),  # p - q = 0.15: kept
        (2.0, 1.5, Q, 0.0, 0.0, HP),  # p - q = 0.3 > 0.2, A > 0: dropped
        (0.2, -0.7, Q, 0.0, 0.0, LN),  # p - q = -0.24 < -0.2, A < 0: dropped
        (0.5, -0.7, Q, 0.7 * 0.5, 0.5, M),
        (2.0, -0.7, Q, 0.7 * 2.0, 2.0, M),  # rose by 0.3 with A < 0: kept (only a fall drops it)
        (0.2, 1.5, Q, -1.5 * 0.2, 0.2, M),  # fell with A > 0: kept
        (4.0, 1.5, 0.02, -1.5 * 4.0, 4.0, M),  # p - q = 0.06: kept, the ratio not capped
    ],
)
CASES["prime_dppo-adv_tau"] = (
    "prime_dppo",
    {"adv_tau": 0.5, "kl_tau": 0.0, "delta_high": 0.1},
    [
        (1.2, 1.5, Q, -0.5 * 1.5 * 1.2, 0.5 * 1.2, M),  # p - q = 0.06
        (1.5, 1.5, Q, 0.0, 0.0, HP),  # p - q = 0.15 > 0.1
        (0.5, -0.7, Q, 0.5 * 0.7 * 0.5, 0.5 * 0.5, M),
    ],
)
CASES["prime_ipo-no_penalty"] = (
    "prime_ipo",
    {"kl_tau": 0.0},
    [
        (1.2, 1.5, Q, -1.5 * 1.2, 1.2, M),  # |p - q| = 0.06: kept
        (1.5, 1.5, Q, 0.0, 0.0, HP),  # rose by 0.15
        (1.5, -0.7, Q, 0.0, 0.0, HN),
        (0.5, 1.5, Q, 0.0, 0.0, LP),  # fell by 0.15
        (0.5, -0.7, Q, 0.0, 0.0, LN),
        (0.8, -0.7, Q, 0.7 * 0.8, 0.8, M),
    ],
)

# ---- rollout_is (SkyRL's compute_policy_loss_rollout_is): w = r inside the open band (0.8, 1.2), else 0;
# L = -A w l, psi = w ----
CASES["rollout_is-default"] = (
    "rollout_is",
    {},
    [
        (1.1, 1.5, Q, -1.5 * 1.1 * ell(1.1, Q), 1.1, M),
        (0.9, -0.7, Q, 0.7 * 0.9 * ell(0.9, Q), 0.9, M),
        (1.5, 1.5, Q, 0.0, 0.0, HP),
        (0.5, -0.7, Q, 0.0, 0.0, LN),
        (0.5, 1.5, Q, 0.0, 0.0, LP),
        (3.0, -0.7, Q, 0.0, 0.0, HN),
    ],
)
CASES["rollout_is-wide"] = (
    "rollout_is",
    {"eps_low": 0.5, "eps_high": 1.0},
    [
        (1.5, 1.5, Q, -1.5 * 1.5 * ell(1.5, Q), 1.5, M),
        (0.6, -0.7, Q, 0.7 * 0.6 * ell(0.6, Q), 0.6, M),
        (2.5, 1.5, Q, 0.0, 0.0, HP),
        (0.4, -0.7, Q, 0.0, 0.0, LN),
    ],
)

# ---- topr (ROLL's _compute_topr_loss): positive samples w = positive_weight, negative ones w = negative_weight
# min(r, 1); L = -A w l, psi = w. Without scores the advantage's sign splits them (test_topr_splits_by_the_score) ----
CASES["topr-weights"] = (
    "topr",
    {"positive_weight": 0.5, "negative_weight": 2.0},
    [
        (1.5, 1.5, Q, -1.5 * 0.5 * ell(1.5, Q), 0.5, M),
        (0.3, 1.5, Q, -1.5 * 0.5 * ell(0.3, Q), 0.5, M),
        (0.3, -0.7, Q, 0.7 * 2.0 * 0.3 * ell(0.3, Q), 2.0 * 0.3, M),
        (1.5, -0.7, Q, 0.7 * 2.0 * 1.0 * ell(1.5, Q), 2.0, DUAL),  # the ratio cut at 1
    ],
)

# ---- fipo (ms-swift): f = clip(exp(F), 1, 1.2) times grpo's terms at the token's own ratio. Called per token,
# the statistic F is the log-ratio itself (l = log r + l_old), so f = clip(r, 1, 1.2); for A < 0 with r > 4 (the
# safety threshold) f is clamped to [0.8, 1] ----
def fipo_weight(r, A, low=1.0, high=1.2, safety=4.0):
    f = clip(r, low, high)
    return clip(f, 0.8, 1.0) if A < 0 and r > safety else f


CASES["fipo-default"] = (
    "fipo",
    {},
    [
        (1.1, 1.5, Q, fipo_weight(1.1, 1.5) * -1.5 * 1.1, fipo_weight(1.1, 1.5) * 1.1, M),
        (1.5, 1.5, Q, fipo_weight(1.5, 1.5) * -1.5 * 1.2, 0.0, HP),
        (0.5, -0.7, Q, fipo_weight(0.5, -0.7) * 0.7 * 0.8, 0.0, LN),
        (0.5, 1.5, Q, fipo_weight(0.5, 1.5) * -1.5 * 0.5, 0.5, LP),
        (3.0, -0.7, Q, fipo_weight(3.0, -0.7) * 0.7 * 3.0, 1.2 * 3.0, HN),
        (5.0, -0.7, Q, fipo_weight(5.0, -0.7) * 0.7 * 5.0, 1.0 * 5.0, HN),  # the safety cap: f = 1, not 1.2
    ],
)


def test_fipo_future_sum_by_hand():
    """F_t = sum_{k >= t} gamma^(k - t) d_k within the row, d = 0 off the mask and above delta, F = 0 off the mask."""
    from dgpo_ops.methods.base import SequenceInputs
    from dgpo_ops.methods.fipo import discounted_future_sum, future_log_ratio

    gamma = 2 ** (-1 / 2.0)
    d = [0.3, -1.0, 2.0, 0.5, -0.2, 0.1, 1.5]  # r = e^2 at position 2: above delta 2.5 (e^2 = 7.4)
    mask = [True, True, True, False, True, True, False]
    log_ratio = torch.tensor([d], dtype=F64)
    cfg = method_config("fipo", decay_rate=2.0, delta=2.5)
    got = future_log_ratio(cfg, SequenceInputs(log_ratio, torch.ones(1, 1, dtype=F64), torch.tensor([mask]), None))
    kept = [x if m and math.exp(x) <= 2.5 else 0.0 for x, m in zip(d, mask)]
    for t in range(7):
        expected = sum(gamma ** (k - t) * kept[k] for k in range(t, 7)) if mask[t] else 0.0
        assert got[0, t].item() == _approx(expected) if expected else got[0, t].item() == 0.0, t
    long = torch.randn(2, 1000, dtype=F64, generator=torch.Generator().manual_seed(0))
    decay = 2 ** (-1 / 32.0)
    explicit = torch.stack([sum(decay ** j * long[:, t + j] for j in range(1000 - t)) for t in (0, 1, 500, 999)], 1)
    torch.testing.assert_close(discounted_future_sum(long, decay)[:, [0, 1, 500, 999]], explicit, rtol=1e-12,
                               atol=1e-12)


def test_topr_splits_by_the_score():
    """With scores, a response's score (not its advantage) makes it positive: score > 0 with A < 0 is -A l."""
    points = [(1.5, -0.7, Q), (1.5, 1.5, Q), (0.3, 1.5, Q), (1.5, -0.7, Q)]
    scores = torch.tensor([1.0, 0.0, -2.0, -0.5], dtype=F64)  # positive, then three negatives (0 is negative)
    log_ratio, adv, old = _inputs(points)
    out = token_terms(method_config("topr"), log_ratio, adv, old, score=scores)
    expected = [(0.7 * ell(1.5, Q), 1.0, M), (-1.5 * 1.0 * ell(1.5, Q), 1.0, DUAL),
                (-1.5 * 0.3 * ell(0.3, Q), 0.3, M), (0.7 * 1.0 * ell(1.5, Q), 1.0, DUAL)]
    for i, (loss, psi, region) in enumerate(expected):
        assert out.loss[i].item() == _approx(loss), i
        assert out.psi[i].item() == _approx(psi), i
        assert Region(int(out.region[i])) == region, i


@pytest.mark.parametrize("method,params", [("prime_dppo", {}), ("prime_ipo", {"kl_tau": 0.25})])
def test_prime_penalty_by_hand(method, params):
    """kl_tau (log r)^2 on every token, dropped ones too, with its slope 2 kl_tau log r beside -A psi."""
    kl_tau = params.get("kl_tau", 1e-3)
    points = [(1.5, 1.5, Q), (2.0, 1.5, Q), (0.2, -0.7, Q), (0.5, 0.0, Q)]  # kept, dropped, dropped, A = 0
    log_ratio, adv, old = _inputs(points, requires_grad=True)
    out = token_terms(method_config(method, **params), log_ratio, adv, old)
    (grad,) = torch.autograd.grad(out.loss.sum(), log_ratio)
    kept_pg = {0: -1.5 * 1.5}
    for i, (r, A, q) in enumerate(points):
        pg = kept_pg.get(i, 0.0) if method == "prime_dppo" else 0.0  # prime_ipo's 0.1 drops even token 0
        assert out.loss[i].item() == _approx(pg + kl_tau * math.log(r) ** 2), i
        assert out.penalty_slope[i].item() == _approx(2 * kl_tau * math.log(r)), i
        assert grad[i].item() == pytest.approx(-A * out.psi[i].item() + 2 * kl_tau * math.log(r), rel=1e-12), i


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(CASES))
def test_golden_values(key):
    method, params, cases = CASES[key]
    cfg = method_config(method, **params)
    log_ratio, adv, old = _inputs(cases)
    out = token_terms(cfg, log_ratio, adv, old)
    assert out.loss.dtype == F64 and out.psi.dtype == F64
    assert out.region.dtype == torch.int8
    assert out.loss.shape == out.psi.shape == out.region.shape == (len(cases),)
    for i, (r, A, q, L, psi, region) in enumerate(cases):
        where = f"{key}: token {i} (r={r}, A={A}, q={q})"
        assert out.loss[i].item() == _approx(L), where + " loss"
        assert out.psi[i].item() == _approx(psi), where + " psi"
        assert Region(int(out.region[i])) == region, where + " region"


@pytest.mark.parametrize("key", sorted(CASES))
def test_autograd_of_loss_matches_psi(key):
    """psi is defined by dL/dl = -A psi; at token level dl = d(log_ratio)."""
    method, params, cases = CASES[key]
    cfg = method_config(method, **params)
    log_ratio, adv, old = _inputs(cases, requires_grad=True)
    out = token_terms(cfg, log_ratio, adv, old)
    # The fused ops' reference and every gradient check differentiate this loss: it must carry autograd.
    assert out.loss.requires_grad, f"{key}: token_terms' loss lost autograd"
    (grad,) = torch.autograd.grad(out.loss.sum(), log_ratio)
    for i, (r, A, q, L, psi, region) in enumerate(cases):
        assert grad[i].item() == pytest.approx(-A * psi, rel=1e-10, abs=1e-300), f"{key}: token {i}"


# Every method's test variants, from the table (a new method is covered by its row).
ALL_METHOD_PARAMS = catalog.variants()


@pytest.mark.parametrize("method,params", ALL_METHOD_PARAMS)
def test_zero_advantage_is_region_m_with_zero_loss_and_gradient(method, params):
    cfg = method_config(method, **params)
    rs = [0.05, 0.5, 1.0, 1.5, 4.0, 20.0]
    points = [(r, 0.0, Q) for r in rs]
    log_ratio, adv, old = _inputs(points, requires_grad=True)
    out = token_terms(cfg, log_ratio, adv, old)
    # The policy term vanishes with A; a penalty (dro's, kl_cov's) does not, and a batch-level selection
    # (clip_cov) marks the tokens it cut DUAL whatever their advantage.
    policy_only = out.penalty_slope is None and METHODS[method].token_selection is None
    for i in range(len(rs)):
        assert (-adv[i] * out.psi[i]).item() == 0.0  # gradient weight -A psi vanishes
        if policy_only:
            assert out.loss[i].item() == 0.0
            assert Region(int(out.region[i])) == M
    assert out.loss.requires_grad, "token_terms' loss lost autograd"
    if policy_only:
        (grad,) = torch.autograd.grad(out.loss.sum(), log_ratio)
        assert torch.all(grad == 0)


@pytest.mark.parametrize("gate", ["sigmoid", "erf", "arctan", "softsign"])
def test_sapo_has_no_trust_region(gate):
    cfg = method_config("sapo", gate=gate)
    points = [(r, A, Q) for r in (0.01, 0.5, 0.79, 1.21, 2.0, 50.0) for A in (1.5, -0.7)]
    log_ratio, adv, old = _inputs(points)
    out = token_terms(cfg, log_ratio, adv, old)
    assert torch.all(out.region == int(M))


@pytest.mark.parametrize(
    "params", [{}, {"n": 2, "m": 3}, {"n": 2, "m": 2, "eps_low": 0.1, "eps_high": 0.28}, {"n": 0.5, "m": 1.5}]
)
def test_dgpo_psi_and_loss_continuous_at_both_boundaries(params):
    cfg = method_config("dgpo", **params)
    lo = 1 - cfg.eps_low
    hi = 1 + cfg.eps_high
    d = 1e-9
    # left boundary, A < 0: LN just below, M just above
    points = [(lo * (1 - d), -0.7, Q), (lo * (1 + d), -0.7, Q), (hi * (1 - d), 1.5, Q), (hi * (1 + d), 1.5, Q)]
    log_ratio, adv, old = _inputs(points)
    out = token_terms(cfg, log_ratio, adv, old)
    assert [Region(int(x)) for x in out.region] == [LN, M, M, HP]
    assert out.psi[0].item() == pytest.approx(out.psi[1].item(), abs=1e-7)
    assert out.psi[2].item() == pytest.approx(out.psi[3].item(), abs=1e-7)
    assert out.loss[0].item() == pytest.approx(out.loss[1].item(), abs=1e-7)
    assert out.loss[2].item() == pytest.approx(out.loss[3].item(), abs=1e-7)
    # and both equal the boundary ratio
    assert out.psi[0].item() == pytest.approx(lo, abs=1e-7)
    assert out.psi[3].item() == pytest.approx(hi, abs=1e-7)


def test_log_ratio_is_clamped_to_20():
    """L and psi are evaluated with log r clamped to [-20, 20] (grpo: HN keeps psi = r, LP too)."""
    cfg = method_config("grpo")
    log_ratio = torch.tensor([25.0, -25.0, 20.0], dtype=F64)
    adv = torch.tensor([-0.7, 1.5, -0.7], dtype=F64)
    old = torch.tensor([math.log(Q)] * 3, dtype=F64)
    out = token_terms(cfg, log_ratio, adv, old)
    assert out.loss[0].item() == _approx(0.7 * math.exp(20.0))
    assert out.psi[0].item() == _approx(math.exp(20.0))
    assert out.loss[1].item() == _approx(-1.5 * math.exp(-20.0))
    assert out.psi[1].item() == _approx(math.exp(-20.0))
    assert out.loss[2].item() == _approx(0.7 * math.exp(20.0))
    assert [Region(int(x)) for x in out.region] == [HN, LP, HN]


def test_clamped_tokens_keep_gradient():
    """The clamp bounds psi instead of zeroing the gradient (straight-through)."""
    cfg = method_config("grpo")
    log_ratio = torch.tensor([25.0, -25.0], dtype=F64, requires_grad=True)
    adv = torch.tensor([-0.7, 1.5], dtype=F64)
    old = torch.tensor([math.log(Q)] * 2, dtype=F64)
    out = token_terms(cfg, log_ratio, adv, old)
    assert out.loss.requires_grad, "token_terms' loss lost autograd"
    (grad,) = torch.autograd.grad(out.loss.sum(), log_ratio)
    assert grad[0].item() == pytest.approx(0.7 * math.exp(20.0), rel=1e-10)
    assert grad[1].item() == pytest.approx(-1.5 * math.exp(-20.0), rel=1e-10)


def test_dcpo_bounds_depend_on_q():
    """Same (r, A) is LN for q = 0.9 (lower ~ 0.769) but M for q = 0.3 (lower = 0.5)."""
    cfg = method_config("dcpo")
    points = [(0.7, -0.7, 0.9), (0.7, -0.7, 0.3), (1.3, 1.5, 0.9), (1.3, 1.5, 0.3)]
    log_ratio, adv, old = _inputs(points)
    out = token_terms(cfg, log_ratio, adv, old)
    assert [Region(int(x)) for x in out.region] == [LN, M, HP, M]


def test_dispo_bounds_depend_on_sign_of_a():
    cfg = method_config("dispo")  # A>0: [0.8, 11]; A<0: [0, 101]
    points = [(0.5, 1.5, Q), (0.5, -0.7, Q), (50.0, 1.5, Q), (50.0, -0.7, Q)]
    log_ratio, adv, old = _inputs(points)
    out = token_terms(cfg, log_ratio, adv, old)
    assert [Region(int(x)) for x in out.region] == [LP, M, HP, M]
    assert out.psi.tolist() == pytest.approx([0.8, 0.5, 11.0, 50.0], rel=REL)
