"""The interface's codes as ``tl.constexpr`` values, for use inside kernels as ``codes.NAME``.

Generated from the enums of ``interface`` (``PLANE_LOGP``, ``REGION_LN``, ``METHOD_DGPO``,
``PARAM_LOW_POS``, ``STAT_EUR``, ``STATUS_ERRORS``, ``SEQ_TOKENS``, ``ERR_TARGET_IDS``,
``DENOMINATOR_TOKENS``, ``NORMALIZER_TENSOR``, ``GATE_ERF``, ...), so the kernels and the host read
the same numbers.

Why a module attribute and not a module-level constexpr of each kernel file: Triton re-checks every
global a kernel reads, at every launch, for a change since it was compiled (about 2 us apiece on
the H100 machine's CPU, and a kernel with its helpers reads 15-20 of them). A module's attribute is
resolved at compile time and never re-checked.
"""

import triton.language as tl

from .interface import (
    IGNORE_INDEX as _IGNORE_INDEX,
)
from .interface import (
    LOG_RATIO_CLAMP as _LOG_RATIO_CLAMP,
)
from .interface import (
    LOGP_ABOVE_ZERO_TOLERANCE as _LOGP_ABOVE_ZERO_TOLERANCE,
)
from .interface import (
    LOGP_FLOOR as _LOGP_FLOOR,
)
from .interface import (
    Denominator,
    Gate,
    InputError,
    KernelParam,
    MethodId,
    Normalizer,
    Plane,
    Region,
    SequenceStat,
    Stat,
    Status,
)

_ENUMS = {
    "PLANE": Plane,
    "REGION": Region,
    "METHOD": MethodId,
    "GATE": Gate,
    "PARAM": KernelParam,
    "STAT": Stat,
    "STATUS": Status,
    "SEQ": SequenceStat,
    "ERR": InputError,
    "DENOMINATOR": Denominator,
    "NORMALIZER": Normalizer,
}

for _prefix, _enum in _ENUMS.items():
    for _member in _enum:
        globals()[f"{_prefix}_{_member.name}"] = tl.constexpr(int(_member.value))

LOG_RATIO_CLAMP = tl.constexpr(_LOG_RATIO_CLAMP)
LOGP_FLOOR = tl.constexpr(_LOGP_FLOOR)
LOGP_ABOVE_ZERO_TOLERANCE = tl.constexpr(_LOGP_ABOVE_ZERO_TOLERANCE)
IGNORE_INDEX = tl.constexpr(_IGNORE_INDEX)
NAN_PROPAGATING = tl.constexpr(tl.PropagateNan.ALL)
NO_TOKEN = tl.constexpr(2**31 - 1)  # past every token and response index (both are int32-sized)
LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln 2: exp(z) = 2^(z log2 e)
LN2 = tl.constexpr(0.6931471805599453)
# The row forward's exponents (base 2) are floored here: 2^-1024 is 0 in fp32 and 0 x -1024 is 0, where a -inf
# logit's own exponent would give 0 x -inf = nan; every exponent under -150 gives 0 either way.
EXP2_FLOOR = tl.constexpr(-1024.0)
HALF_SQRT_PI_OVER_2 = tl.constexpr(1.2533141373155003)  # sqrt(pi / 2)
INV_SQRT2 = tl.constexpr(0.7071067811865476)
