"""``LossOptions``: every non-tensor option of a loss call, in one validated dataclass (its tensors travel in
``dgpo_ops.core.inputs.LossInputs``). The public functions' keywords are these fields; the fused-linear op's
projection (``logit_scale``, ``softcap``, ``memory_budget``, ``logits_on_chip``) and the vocabulary split
(``vocab_parallel_group``) are fields too, so that one object carries a call's options through every route."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import torch

from dgpo_ops.core.aggregation import check_aggregation
from dgpo_ops.core.validation import FLOAT32_MAX, FLOAT32_TINY, VALIDATION_MODES, float32_magnitude_ok
from dgpo_ops.corrections.core import RolloutCorrection
from dgpo_ops.methods import gspo
from dgpo_ops.methods.base import MethodConfig
from dgpo_ops.methods.dgpo import DgpoConfig
from dgpo_ops.methods.table import METHODS, method_config

BACKENDS = ("auto", "triton", "torch")  # which kernels run (dgpo_ops.ops.backends)

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")

DEFAULT_MEMORY_BUDGET = 512 * 2**20  # bytes of the fused-linear op's logits and gradient tiles


# What the constructor's errors say: the usual way to make the options from a method's name and keywords.
BUILD_HINT = ("LossOptions.build(method_name, **options_and_method_params) builds them from a method's name, "
              "its parameters and the options, e.g. LossOptions.build('dgpo', n=1.0, beta=0.04)")


@dataclass(frozen=True)
class LossOptions:
    """One call's options (its tensors are ``LossInputs``): what the public functions take as keywords,
    ``DGPOTrainer`` builds from its config and the verl and SkyRL plugins from theirs, checked once, here,
    when made. ``LossOptions.build(method, **options_and_method_params)`` makes one from keywords. Each field
    is described once, in ``dgpo_ops.core.docstrings.ARGUMENTS`` (the public functions' docstrings)."""

    method: MethodConfig = field(default_factory=DgpoConfig)
    temperature: float = 1.0
    aggregation: str | None = None  # None: the method's own (MethodSpec.aggregation), else token_mean
    beta: float = 0.0  # KL (k3) coefficient to the reference policy
    kl_ratio_correction: bool = False  # multiply the KL by the importance ratio (TRL's use_bias_correction_kl)
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef * H
    # VAPO's positive-example NLL (NeMo-RL's positive_example_nll_weight): loss += coef * the mean -l over the
    # scored tokens of the responses whose score is > 0 (needs scores)
    positive_nll_coef: float = 0.0
    importance_sampling_level: str = "token"  # "sequence" is GSPO's ratio
    inplace: bool = False  # fused ops only: write d(loss)/d(logits) into the logits' storage
    backend: str = "auto"  # fused ops only
    validation: str = "auto"  # fused ops only: "immediate", "deferred" or "auto" (dgpo_ops.core.validation)
    # the stage that turns rollout_logps into rollout weights and rejections (dgpo_ops.corrections), run before
    # every route: the ops themselves never see it
    rollout_correction: RolloutCorrection | None = None
    # the fused-linear op's projection: logits = softcap * tanh(logit_scale * y / softcap) (or logit_scale * y),
    # y = hidden @ weight^T + bias, then / temperature
    logit_scale: float = 1.0
    softcap: float | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET  # bytes of logits and gradient tiles alive at once
    # True: the Triton kernels of kernels/linear_logits.py and linear_grad.py, the logits only in registers (no tile
    # buffers, no weight copy in the compute dtype; one more pass of products)
    logits_on_chip: bool = False
    # the process group over which the vocabulary is split (tensor parallelism); None: one process's whole vocabulary
    vocab_parallel_group: object = None

    def __new__(cls, *args, **kwargs):
        # The constructor takes the fields alone; a method's parameters (n=..., eps_high=...) reach it through
        # build, which this error points to (the dataclass's own says only "unexpected keyword argument").
        fields = cls.__dataclass_fields__
        unknown = [name for name in kwargs if name not in fields]
        if unknown or len(args) > len(fields):
            got = (f"unexpected keyword argument(s) {', '.join(unknown)}" if unknown
                   else f"{len(args)} positional arguments")
            raise TypeError(f"LossOptions takes its fields ({', '.join(fields)}), got {got}: "
                            f"{BUILD_HINT}")
        return super().__new__(cls)

    def __post_init__(self):
        if not isinstance(self.method, MethodConfig):
            got = f"{type(self.method).__name__} {self.method!r}" if isinstance(self.method, str) \
                else type(self.method).__name__
            raise ValueError(f"method must be a MethodConfig (dgpo_ops.method_config(name, **params)), "
                             f"got {got}: {BUILD_HINT}")
        for name, low_open in (("temperature", True), ("beta", False), ("positive_nll_coef", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)) or value < 0 or (low_open and value == 0):
                raise ValueError(f"{name} must be a finite number {'> 0' if low_open else '>= 0'}, got {value!r}")
        # The kernels multiply by 1 / temperature, beta and entropy_coef as float32 numbers.
        if not float32_magnitude_ok(self.temperature) or not float32_magnitude_ok(1.0 / self.temperature):
            raise ValueError(f"temperature must be a finite number > 0 whose inverse is finite in float32 "
                             f"({1 / FLOAT32_MAX:.2g} <= temperature <= {FLOAT32_MAX:.2g}), got {self.temperature!r}")
        if not float32_magnitude_ok(self.positive_nll_coef):
            raise ValueError(f"positive_nll_coef must be a finite number >= 0 that float32 holds, "
                             f"got {self.positive_nll_coef!r}")
        if not float32_magnitude_ok(self.beta):
            raise ValueError(f"beta must be a finite number >= 0 that float32 holds (at most {FLOAT32_MAX:.2g}), "
                             f"got {self.beta!r}")
        if isinstance(self.entropy_coef, bool) or not (
            isinstance(self.entropy_coef, (int, float)) and math.isfinite(self.entropy_coef)
        ) or not float32_magnitude_ok(self.entropy_coef):
            raise ValueError(f"entropy_coef must be a finite number that float32 holds (|entropy_coef| <= "
                             f"{FLOAT32_MAX:.2g}), got {self.entropy_coef!r}")
        if not isinstance(self.kl_ratio_correction, bool):  # a truthy string or 0.0 would read silently
            raise ValueError(f"kl_ratio_correction must be a bool, got {self.kl_ratio_correction!r}")
        if self.aggregation is None:  # resolved here, once: every path and the compiled ops read the name
            object.__setattr__(self, "aggregation", default_aggregation(self.method.name))
        check_aggregation(self.aggregation)
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                f"got {self.importance_sampling_level!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.validation not in VALIDATION_MODES:
            raise ValueError(f"validation must be one of {VALIDATION_MODES}, got {self.validation!r}")
        self._check_projection()
        if self.rollout_correction is not None and not isinstance(self.rollout_correction, RolloutCorrection):
            raise ValueError("rollout_correction must be a dgpo_ops.corrections.RolloutCorrection (e.g. "
                             f"TrlCorrection('token_truncate')) or None, got {self.rollout_correction!r}")
        if self.rollout_correction is not None:
            self.rollout_correction.check_options(self)
        if METHODS[self.method.name].sequence_statistic is not None and self.importance_sampling_level != "token":
            raise ValueError(f"{self.method.name} is evaluated at its own sequence statistic of each response's "
                             "log-ratios: leave importance_sampling_level at 'token'")

    def _check_projection(self):
        # float32 numbers in the kernels: a normal float32, so that neither it nor its inverse is 0 or inf
        if isinstance(self.logit_scale, bool) or not isinstance(self.logit_scale, (int, float)) or not math.isfinite(
                self.logit_scale) or not FLOAT32_TINY <= self.logit_scale <= FLOAT32_MAX:
            raise ValueError(f"logit_scale must be a finite number > 0 in float32's normal range, got "
                             f"{self.logit_scale!r}")
        if self.softcap is not None and (isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float))
                                         or not math.isfinite(self.softcap)
                                         or not FLOAT32_TINY <= self.softcap <= FLOAT32_MAX):
            raise ValueError(f"softcap must be None or a finite number > 0 in float32's normal range, got "
                             f"{self.softcap!r}")
        if isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int) or self.memory_budget < 1:
            raise ValueError(f"memory_budget must be a positive integer number of bytes, got {self.memory_budget!r}")
        if not isinstance(self.logits_on_chip, bool):
            raise ValueError(f"logits_on_chip must be True or False, got {self.logits_on_chip!r}")

    @property
    def sequence_statistic(self):
        """How token log-ratios become the one a method is evaluated at, ``(config, SequenceInputs) -> log-ratio``:
        None (per token), the method's own (``MethodSpec.sequence_statistic``) or GSPO's mean (importance sampling
        at sequence level)."""
        own = METHODS[self.method.name].sequence_statistic
        if own is not None:
            return own
        return gspo.mean_log_ratio if self.importance_sampling_level == "sequence" else None

    @property
    def sequence_reason(self) -> str | None:
        """Why each response's tokens must come together (for an error that names it), None at token level."""
        if METHODS[self.method.name].sequence_statistic is not None:
            return f"method {self.method.name!r} (evaluated at a statistic of each response's log-ratios)"
        return "importance_sampling_level='sequence'" if self.importance_sampling_level == "sequence" else None

    @property
    def sequence_level(self) -> bool:
        return self.sequence_statistic is not None

    @property
    def folds_rollout_weights(self) -> bool:
        """The rollout weights enter the method's own sequence statistic instead of multiplying its loss."""
        spec = METHODS[self.method.name]
        return spec.sequence_statistic is not None and spec.statistic_folds_rollout_weights

    @property
    def needs_scores(self) -> bool:
        """The call reads each response's score (``LossInputs.scores``): the method splits by it (topr), or the
        positive-example NLL picks its responses by it."""
        return METHODS[self.method.name].reads_scores or self.positive_nll_coef != 0.0

    @property
    def token_local(self) -> bool:
        """The method is per-token (``MethodSpec.token_local``) and this call adds nothing that reaches across
        tokens (GSPO's sequence-level ratio, the positive-example NLL), so the row kernels' epilogue can evaluate
        its terms where they finish a row."""
        return (METHODS[self.method.name].token_local and not self.sequence_level
                and self.positive_nll_coef == 0.0)  # its normaliser counts the positive responses' tokens

    @classmethod
    def build(cls, method="dgpo", **kwargs) -> "LossOptions":
        """Split keyword arguments into loss options and method parameters (validated by the method).

        The same arguments give the same (immutable) options: they are built and validated once.
        Under ``torch.compile`` they are built at trace time and enter the graph as a constant."""
        if torch.compiler.is_compiling():
            # Built at trace time; the traced code reads the object from a module dict by a constant
            # key, so the compiler sees a guarded global object, not one created in the graph.
            items = tuple((name, trace_constant(value)) for name, value in kwargs.items())
            return COMPILED_OPTIONS[_build_constant(method, items)]
        return _build_eager(method, kwargs)


def default_aggregation(method: str) -> str:
    """The aggregation of a call that names none: the method's own, where its authors or framework fix one
    (geo_mean: verl's mean over responses; dcpo: DCPO's only-token-mean), else token_mean."""
    return METHODS[method].aggregation or "token_mean"


def trace_constant(value):
    """``value`` as a Python constant while ``torch.compile`` traces. A float option that changed between
    compiled calls reaches the next trace symbolic (dynamo makes such a float dynamic to spare recompiles),
    and the options are a trace-time constant, validated once: so the float is specialised here, with a
    guard on its value, and each new value compiles the graph again (``torch._dynamo.config.
    recompile_limit`` applies). Dynamo specialises the key of ``itertools.groupby`` to a constant; outside a
    trace this is the value itself."""
    if isinstance(value, RolloutCorrection):  # as its field values, each specialised (_build_eager rebuilds it)
        name, fields = value.as_constants()
        return CORRECTION_MARK, name, tuple((field, trace_constant(v)) for field, v in fields)
    return next(itertools.groupby((value,)))[0]


CORRECTION_MARK = "rollout_correction constants"  # a traced RolloutCorrection's constants (trace_constant)


def _build_eager(method, kwargs) -> LossOptions:
    if any(isinstance(value, tuple) for value in kwargs.values()):  # a traced RolloutCorrection's constants
        kwargs = {name: RolloutCorrection.from_constants(value[1:]) if isinstance(value, tuple) and value
                  and value[0] == CORRECTION_MARK else value for name, value in kwargs.items()}
    try:
        key = tuple([(name, type(value), value) for name, value in sorted(kwargs.items())])
        return _build_cached(method, type(method), key)
    except TypeError:  # an unhashable argument: build it uncached (validation names it)
        return _build(LossOptions, method, kwargs)


def _build(cls, method, kwargs) -> LossOptions:
    option_names = cls.__dataclass_fields__.keys() - {"method"}
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in option_names}
    return cls(method=method_config(method, **kwargs), **options)


COMPILED_OPTIONS: dict[str, LossOptions] = {}


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)``, which marks ``fn`` and returns it
    (torch/_dynamo/decorators.py: dynamo reads the mark when it traces a call), without importing
    ``torch._dynamo``: that import is 1.2 s, over a third of ``import dgpo_ops``, in every process that never
    compiles (tests/ops/test_compile.py compares the marks)."""
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result
def _build_constant(method, items) -> str:
    options = _build_eager(method, dict(items))
    key = repr(options)
    COMPILED_OPTIONS.setdefault(key, options)
    return key


@functools.lru_cache(maxsize=512)
def _build_cached(method, _method_type, key) -> LossOptions:
    return _build(LossOptions, method, {name: value for name, _, value in key})
