"""What the kernels and their callers agree on: method, gate and region codes, parameter slots, the
log-ratio clamp, aggregation codes, input-error bits, and the layout of the per-token planes and
per-call status the kernels write; and the host's launch arithmetic (``next_power_of_2``, ``cdiv``).

A leaf module: it imports nothing from ``dgpo_ops``, so the dependencies run one way
(``dgpo_ops`` -> ``dgpo_ops.kernels``). Every constant here is an ``IntEnum`` member or a float, so a
kernel turns it into a ``tl.constexpr`` and the host uses the same member.
"""

from __future__ import annotations

import enum

LOG_RATIO_CLAMP = 20.0  # |log r| is clamped (straight-through) before L and psi are evaluated
# Log-ratios to the reference policy (the k3 KL) are clamped the same way before their exponential.
# The token's log-prob enters the objective floored here (straight-through): a -inf target logit
# (probability exactly 0) then gives a finite loss and gradient instead of -inf - -inf = nan.
LOGP_FLOOR = -1.0e6
# The kernels take every scalar option as an fp32 runtime argument: a Python float outside float32's
# range would be inf (or 0) there, so options are checked against these where they are read.
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny: the smallest normal float32
IGNORE_INDEX = -100  # target id of a token that is not scored (TRL's and torch's convention)
# A log-prob input (old_logps, ref_logps, rollout_logps) above this on a scored token is no log-probability:
# probabilities passed for log-probs, or log-probs shifted. A log-softmax is <= 0 however it is rounded
# (x - max <= 0 and log(sum exp) >= 0, and rounding keeps a sign: in bf16 too); a positive value comes only
# from a target logit minus a separately rounded log-sum-exp, which the frameworks form in fp32 (TRL's
# selective_log_softmax takes a row-wise log_softmax in bf16 and fp16; verl, vLLM and Megatron compute in
# fp32): a few ulps, about 1e-5. 1e-2 leaves room for fp16 too (half an ulp at |log-sum-exp| < 32 is 8e-3),
# and every probability above 1e-2 passed for a log-prob is still refused.
LOGP_ABOVE_ZERO_TOLERANCE = 1e-2
# The per-token inputs the prologue checks as log-probs (the rollout-correction stage checks rollout_logps,
# which it reads before any kernel).
LOG_PROBABILITY_INPUTS = ("old_logps", "ref_logps")
# The per-token inputs the prologue checks as importance weights: finite and >= 0 (a log-ratio passed for a ratio
# flips or zeroes the policy term of its tokens).
WEIGHT_INPUTS = ("rollout_weights",)


# Host-side launch arithmetic. triton.next_power_of_2 and triton.cdiv are ConstexprFunction objects
# (Triton >= 3.5) whose calls unwrap constexprs first: several microseconds each, on every launch.
def next_power_of_2(n: int) -> int:
    """The smallest power of 2 that is >= ``n``, and 0 for 0, as ``triton.next_power_of_2``."""
    if n < 0:
        raise ValueError(f"next_power_of_2 needs n >= 0, got {n}")
    return 1 << (n - 1).bit_length() if n else 0


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, as ``triton.cdiv``."""
    return -(-a // b)


class Region(enum.IntEnum):
    """Region code of a token (docs/math.md, "Regions"); DUAL replaces HN/LP where a dual clip fires."""

    M = 0
    LN = 1
    HP = 2
    LP = 3
    HN = 4
    DUAL = 5


class Gate(enum.IntEnum):
    SIGMOID = 0
    ERF = 1
    ARCTAN = 2
    SOFTSIGN = 3


class MethodId(enum.IntEnum):
    """Kernel-side switch of a per-token method (a constexpr); several table rows may share one id. Only a method
    the row kernels' epilogue evaluates has one (``LossOptions.token_local``): one evaluated at a sequence
    statistic, after a batch-level selection or from the responses' scores runs in the torch objective."""

    PPO_CLIP = 0  # PPO's clipped ratio: grpo
    DCPO = 1
    CAPPED_IS = 2  # cispo and dispo
    GRADIENT_PRESERVING = 3  # gppo and ce_gppo
    ASPO = 4
    DGPO = 5
    SAPO = 6
    REINFORCE = 7  # gpg: the plain policy gradient
    DPPO_TV = 8  # divergence-proximal: drop tokens whose probability moved too far (total variation)
    DPPO_KL = 9  # ... (binary KL)
    DRO = 10  # the plain policy gradient plus a quadratic penalty on the log-ratio (verl's dro)
    PRIME_DPPO = 11  # prime-rl's default: -A r on DPPO's TV-kept tokens plus a squared log-ratio penalty
    PRIME_IPO = 12  # ... its ipo: the same with a keep band symmetric in the probability's move
    BANDED_IS = 13  # SkyRL's rollout_is: the importance weight inside an open band, 0 outside


class KernelParam(enum.IntEnum):
    """Slots of the fp32 parameter vector the kernels read (runtime values: no recompile per value).

    Bounds are stored, not eps: computed in double and rounded once, they equal the fp32 values
    torch compares against, so the mirror's regions agree with the table's to the bit.
    """

    LOW_POS = 0  # trust region [low, high] for A >= 0 (every method but dispo uses these)
    HIGH_POS = 1
    LOW_NEG = 2  # ... and for A < 0
    HIGH_NEG = 3
    THRESHOLD_LOW = 4  # dcpo's eps of its bound on the old probability; dppo's divergence threshold for A <= 0
    THRESHOLD_HIGH = 5  # ... and for A > 0
    DUAL_CLIP = 6  # +inf when off
    LN_WEIGHT = 7  # gppo: beta1 * low
    HP_WEIGHT = 8  # gppo: beta2 * high
    N = 9
    M = 10
    RATIO_CAP = 11  # dcpo's ratio cap (r_max); dppo's importance-weight cap (is_cap)
    TAU_POS = 12
    TAU_NEG = 13
    DELTA = 14  # TRL's cap on the ratio (grpo); +inf when off
    PROXIMAL_BETA = 15  # the penalty (beta / 2) (l - l_old)^2: dro's, and prime-rl's with beta = 2 kl_tau
    ADV_SCALE = 16  # prime-rl's adv_tau: the advantage is scaled by it


NUM_KERNEL_PARAMS = len(KernelParam)


class Denominator(enum.IntEnum):
    """What an aggregation divides by (``dgpo_ops.core.aggregation``), unless a ``loss_normalizer`` is given."""

    TOKENS = 0  # scored tokens in the batch (at least 1)
    RESPONSES = 1  # B
    GRID = 2  # B * T
    ONE = 3
    SCORED_RESPONSES = 4  # the responses with at least one scored token (at least 1): ROLL's valid samples
    HORIZON = 5  # T, the grid's width: ROLL's seq-mean-token-sum-norm


# The denominators a grid's shape fixes, from (n_responses, width), before the clamp to at least 1; the others
# count scored tokens (``torch_twins.COUNTED_DENOMINATORS``, which checks that the two cover every member).
FIXED_DENOMINATORS = {
    Denominator.RESPONSES: lambda n_responses, width: n_responses,
    Denominator.GRID: lambda n_responses, width: n_responses * width,
    Denominator.HORIZON: lambda n_responses, width: width,
    Denominator.ONE: lambda n_responses, width: 1,
}


def fixed_denominator(denominator: Denominator, n_responses: int, width: int) -> int:
    """The size of a denominator of ``FIXED_DENOMINATORS`` on a grid of ``n_responses`` rows of ``width``."""
    if denominator not in FIXED_DENOMINATORS:
        raise ValueError(f"{denominator!r} counts scored tokens: no fixed size")
    return FIXED_DENOMINATORS[denominator](n_responses, width)


class Normalizer(enum.IntEnum):
    """How a ``loss_normalizer`` reaches the prologue kernel."""

    ABSENT = 0
    VALUE = 1  # a Python number, checked on the host
    TENSOR = 2  # a one-element device tensor, read (and checked) on the device: no host sync


class InputError(enum.IntFlag):
    """Bits the prologue kernel sets for input it cannot score; ``dgpo_ops.core.validation`` names the argument."""

    TARGET_IDS = 1  # a target id outside [0, V) that is not IGNORE_INDEX
    MASK = 2  # a mask value other than 0 and 1
    ADVANTAGES = 4  # non-finite on a scored token
    OLD_LOGPS = 8
    REF_LOGPS = 16
    ROLLOUT_WEIGHTS = 32
    LOSS_NORMALIZER = 64  # non-finite or <= 0
    # Found by the layouts (dgpo_ops.layouts), not by the prologue kernel:
    CU_SEQLENS = 128  # cu_seqlens does not describe the packed tokens
    VOCAB_SHARES = 256  # the processes of vocab_parallel_group hold unequal shares or different tokens
    # Found beside the prologue, by torch ops on the device: a per-token float that only the torch objective
    # reads (each response's score) is non-finite on a scored token; Status.BAD_INPUT says which
    OBJECTIVE_INPUT = 512
    # Found by the rollout-correction stage (dgpo_ops.corrections.stage), by torch ops on the device:
    # rollout_logps above 0 beyond rounding on a scored token
    ROLLOUT_LOGPS = 1024
    # Found by the loss from log-probs (dgpo_ops.ops.from_logps), by torch ops on the device: the log-probs it is
    # given (the policy's own) above 0 beyond rounding on a scored token
    LOGPS = 2048


class Plane(enum.IntEnum):
    """Rows of the fp32 per-token workspace ``(NUM_PLANES, n_tokens)`` the row kernels write."""

    ROW_MAX = 0  # log-sum-exp = ROW_MAX + LOG_NORM, kept apart for precision
    LOG_NORM = 1
    LOGP = 2
    ENTROPY = 3
    TOKEN_LOSS = 4  # w L + beta KL - c H, before the aggregation scale
    DLOSS_DLOGP = 5  # its derivative in l, before the aggregation scale
    RATIO = 6  # exp of the clamped log ratio the method was evaluated at
    PSI = 7
    REGION = 8  # a Region code, as a float
    KL = 9


NUM_PLANES = len(Plane)


class SequenceStat(enum.IntEnum):
    """Rows of the int64 per-response workspace ``(NUM_SEQUENCE_STATS, B)`` the prologue writes."""

    TOKENS = 0  # scored tokens of the response
    ERRORS = 1  # InputError bits
    FIRST_BAD_TARGET = 2  # the first out-of-range target id of the response (valid with TARGET_IDS set)


NUM_SEQUENCE_STATS = len(SequenceStat)


class Status(enum.IntEnum):
    """Slots of the int64 per-call status vector (the prologue's last program writes it)."""

    ERRORS = 0  # InputError bits of the whole call
    BAD_TARGET = 1  # the first out-of-range target id in row-major order
    TOKENS = 2  # scored tokens of the whole call
    ARRIVED = 3  # prologue programs done (the last one to arrive reduces over the responses)
    BAD_INPUT = 4  # with InputError.OBJECTIVE_INPUT: which input (dgpo_ops.core.inputs.OBJECTIVE_FLOATS[i])


NUM_STATUS = len(Status)


class Stat(enum.IntEnum):
    """Slots of the fp32 per-call statistics vector: the metrics, as masked means over scored tokens."""

    LN_FRACTION = 0
    HP_FRACTION = 1
    LP_FRACTION = 2
    HN_FRACTION = 3
    DUAL_CLIP_FRACTION = 4
    RATIO_MEAN = 5
    EUR = 6  # effective update ratio: mean of psi / r, the share of the on-policy gradient kept
    ENTROPY_MEAN = 7
    KL_MEAN = 8


NUM_STATS = len(Stat)
