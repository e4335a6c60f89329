"""``DGPOConfig``: TRL's ``GRPOConfig`` plus the policy loss of any method of the family.

The method fields are not written here: ``method_fields.py`` names the config field each method parameter is
read from, and every such field TRL's ``GRPOConfig`` lacks is added to ``DGPOConfig`` with its default and help
from the method table's specs (``_add_method_fields``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trl import GRPOConfig

from dgpo_ops.core.aggregation import AGGREGATIONS
from dgpo_ops.core.options import DEFAULT_MEMORY_BUDGET, LossOptions
from dgpo_ops.frameworks import trl
from dgpo_ops.methods.base import MethodConfig
from dgpo_ops.methods.catalog import POLICY_LOSSES, method_params
from dgpo_ops.methods.table import METHODS, NOT_METHODS, method_config, refuse_unknown_params, resolve

from .method_fields import config_default, config_help, config_method_params, config_params

FUSED_MODES = ("linear", "logits")
ADVANTAGE_ESTIMATORS = ("grpo", "dcpo")

TRL_FIELDS = frozenset(f.name for f in dataclasses.fields(GRPOConfig))
# loss_aggregation's values, as its help and the class docstring list them
AGGREGATION_NAMES = f"{', '.join(list(AGGREGATIONS)[:-1])} or {list(AGGREGATIONS)[-1]}"


def method_field_names() -> tuple[str, ...]:
    """The config fields method parameters are read from (TRL's and the added ones), in table order."""
    return tuple(config_params())


def unread_method_fields(policy_loss: str) -> tuple[str, ...]:
    """The method fields ``DGPOConfig`` adds (TRL's own keep TRL's meaning) that the method or alias
    ``policy_loss`` does not read: set for it, they would be ignored."""
    read = {p.field.name for p in config_method_params(resolve(policy_loss)[0]) if p.field is not None}
    return tuple(name for name in config_params() if name not in TRL_FIELDS and name not in read)


def _add_method_fields(cls):
    """Add to ``cls`` (before ``@dataclass``) a field for every method config field TRL lacks."""
    for name, params in config_params().items():
        if name in TRL_FIELDS:
            continue
        default = config_default(params)
        if params[0].spec.choices is not None:
            annotation = str
        else:
            annotation = float | None if default is None or any(p.spec.optional for p in params) else float
        cls.__annotations__[name] = annotation
        setattr(cls, name, field(default=default, metadata={"help": config_help(params)}))
    return cls


@dataclass
@_add_method_fields
class DGPOConfig(GRPOConfig):
    # An f-string: the aggregations are listed from dgpo_ops.core.aggregation.AGGREGATIONS.
    __doc__ = rf"""
    [`~trl.GRPOConfig`] with the policy loss chosen among dgpo-ops' methods. Every `GRPOConfig` field keeps its TRL
    meaning (`tests/trainer/test_trainer_conformance.py` checks each against `GRPOTrainer`), except that `epsilon`
    defaults to None: each method's own default from the table (dcpo's eps_low is 0.16, cispo's cap 5).

    Which objective trains (`policy_loss` and `loss_type`): a `DGPOConfig` with only `GRPOConfig` fields trains
    what `GRPOConfig` trains.

    * `policy_loss` unset (None): the objective TRL's `loss_type` names, with its aggregation: `grpo`, `bnpo`,
      `dr_grpo`, `dapo` (TRL's default) and `luspo` are TRL's clipped objective (`policy_loss="grpo"`, which reads
      `delta` too; other methods refuse it), `cispo`, `sapo` and `vespo` their own (`vespo` from the method table; refused as not
      yet fused by a table without it).
    * `policy_loss` set: that method; `loss_type` then picks the aggregation only. `cispo`, `sapo` and `vespo`
      name an objective, so with another `policy_loss` they are a `ValueError` (their aggregations are
      `loss_type="dapo"`, `"grpo"` and `"dapo"`). A method whose authors or framework fix its aggregation
      aggregates by it unless `loss_aggregation` is set (dcpo: `seq_sum_token_mean`, geo_mean:
      `seq_mean_token_mean`; `MethodSpec.aggregation`).

    After `__post_init__`, `policy_loss` holds the method resolved (a copy of the config resolves the same way).

    Parameters:
        policy_loss (`str`, defaults to None): a method or alias of `dgpo_ops.methods.catalog.POLICY_LOSSES`; None:
            the objective `loss_type` names. `dapo` is grpo with DAPO's clip-higher: `epsilon_high=0.28` unless
            `epsilon_high` is set (TRL's `loss_type="dapo"` is the aggregation only).
        dgpo_n, dgpo_m, dual_clip, gppo_beta1, gppo_beta2, dcpo_r_max, dispo_eps_*, sapo_gate: the methods' own
            parameters, added from the method table (each field's help names the methods that read it, its
            range, and what None means); docs/methods.md's table shows which field feeds which parameter.
        loss_aggregation: {AGGREGATION_NAMES}; None follows the method's own (dcpo: seq_sum_token_mean,
            geo_mean: seq_mean_token_mean), else `loss_type`.
        positive_nll_coef: VAPO's positive-example NLL (NeMo-RL's `positive_example_nll_weight`; docs/math.md): the
            responses with a score (the weighted sum of their rewards, TRL's `reward`) > 0 add this weight times
            their tokens' mean NLL; 0 (default): off.
        advantage_estimator: `"grpo"` (TRL's group advantages) or `"dcpo"` (smooth advantage standardisation).
        fused: `"linear"` (hidden states + lm_head, logits never whole) or `"logits"` (the model's logits).
        fused_memory_budget: bytes of the logits and gradient tiles of `fused="linear"` (a positive integer). The
            tiles are in the compute dtype (the autocast dtype, else the lm_head weight's; the logits fp32 with a
            softcap).
        fused_logits_on_chip: `fused="linear"` through Triton kernels that keep the logits in registers (no
            tiles, no bf16 weight copy under autocast; CUDA only; not yet measured on a GPU, so off by default).
        max_nonfinite_steps: an optimizer step whose gradients are not finite is skipped with a warning naming the
            step and the first such parameter; this many consecutive skips stop the run with an error.

    For `cispo`, `epsilon_high` is TRL's weight cap itself (dgpo-ops' `1 + eps_high`), and there is no lower clip.
    """

    policy_loss: str | None = field(default=None, metadata={
        "help": f"Policy loss: one of {', '.join(POLICY_LOSSES)}; None: the objective TRL's loss_type names (its "
                "default, dapo: TRL's clipped objective, grpo)."})
    # TRL's epsilon (0.2 there) with None by default: each method's own eps_low from the table unless set (dcpo's
    # is 0.16), and epsilon_high left None falls back to it, so cispo's cap and dcpo's eps_high keep theirs too.
    epsilon: float | None = field(default=None, metadata={"help": config_help(config_params()["epsilon"])})
    loss_aggregation: str | None = field(default=None, metadata={
        "help": f"Aggregation: {AGGREGATION_NAMES}; None follows loss_type (dcpo: seq_sum_token_mean)."})
    positive_nll_coef: float = field(default=0.0, metadata={
        "help": "VAPO's positive-example NLL (NeMo-RL's positive_example_nll_weight): this weight times the mean NLL "
                "of the tokens of the responses whose score (the weighted sum of their rewards) is > 0; 0: off."})
    advantage_estimator: str = field(default="grpo", metadata={"help": "Advantages: grpo or dcpo."})
    fused: str = field(default="linear", metadata={"help": "linear (hidden states + lm_head) or logits."})
    fused_memory_budget: int = field(default=512 * 2**20, metadata={
        "help": "Bytes of the logits and gradient tiles of fused='linear', in the compute dtype (the logits fp32 "
                "with a softcap)."})
    fused_logits_on_chip: bool = field(default=False, metadata={
        "help": "fused='linear' with the logits only in registers (Triton, CUDA): no tiles, no weight copy."})
    max_nonfinite_steps: int = field(default=3, metadata={
        "help": "Optimizer steps with non-finite gradients are skipped; this many in a row stop the run."})

    def __post_init__(self):
        self._resolve_objective()  # before TRL's checks, which read loss_type
        super().__post_init__()
        if self.policy_loss not in POLICY_LOSSES:
            hint = f"; {NOT_METHODS[self.policy_loss]}" if self.policy_loss in NOT_METHODS else ""
            raise ValueError(f"policy_loss must be one of {', '.join(POLICY_LOSSES)}, "
                             f"got {self.policy_loss!r}{hint}")
        if self.fused not in FUSED_MODES:
            raise ValueError(f"fused must be one of {FUSED_MODES}, got {self.fused!r}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {self.advantage_estimator!r}")
        if self.loss_aggregation is not None and self.loss_aggregation not in AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be None or one of {', '.join(AGGREGATIONS)}")
        if (isinstance(self.fused_memory_budget, bool) or not isinstance(self.fused_memory_budget, int)
                or self.fused_memory_budget < 1):
            raise ValueError(f"fused_memory_budget must be a positive integer number of bytes, got "
                             f"{self.fused_memory_budget!r}")
        if not isinstance(self.fused_logits_on_chip, bool):
            raise ValueError(f"fused_logits_on_chip must be True or False, got {self.fused_logits_on_chip!r}")
        if self.fused_logits_on_chip and self.fused != "linear":
            raise ValueError(f"fused_logits_on_chip=True applies to fused='linear', not fused={self.fused!r}")
        if self.fused_memory_budget != DEFAULT_MEMORY_BUDGET and self.fused != "linear":
            raise ValueError(f"fused_memory_budget applies to fused='linear' (its logits tiles), not "
                             f"fused={self.fused!r}, which reads whole logits")
        self._refuse_unread_advantage_fields()
        if isinstance(self.max_nonfinite_steps, bool) or not isinstance(self.max_nonfinite_steps, int) or \
                self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps must be an integer >= 1, got {self.max_nonfinite_steps!r}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1] (TRL's rho), got {self.top_entropy_quantile!r}")
        # The chosen method with the shared fields (epsilon, ...), now, not at the first step; and first, so that
        # a bad field it reads is reported as its own (dppo_kl's dppo_is_cap, not dppo_tv's, which reads it too).
        self.loss_options()
        # Every method's fields, whichever method is chosen: a bad value fails here, not when a later run
        # switches policy_loss. Fields read with an offset (cispo's cap) only mean something to their method.
        for method in METHODS:
            self._build_method(method, fields_only=True)
        self._check_delta()
        self._refuse_unread_fields()

    def _refuse_unread_advantage_fields(self) -> None:
        """DCPO's smooth advantages are standardised from each prompt's weighted reward sum
        (``trainer/scores.py``): TRL's reward scaling and multi-objective aggregation, which only its group
        advantages read, would be set and ignored."""
        if self.advantage_estimator != "dcpo":
            return
        for name, default in (("scale_rewards", "group"), ("multi_objective_aggregation", "sum_then_normalize")):
            value = getattr(self, name, default)
            if value != default:
                raise ValueError(f"{name}={value!r} shapes TRL's group advantages; advantage_estimator='dcpo' makes "
                                 f"its own smooth advantages from the weighted reward sum and reads no {name}: "
                                 f"leave it at {default!r}, or use advantage_estimator='grpo'")

    def _resolve_objective(self) -> None:
        """``policy_loss`` from ``loss_type`` when unset, and the check of the two (the class docstring's rule)."""
        loss_type, policy_loss = self.loss_type, self.policy_loss
        named = trl.SPEC.loss_type(loss_type).method  # TRL's spec: unknown loss types raise
        if policy_loss is None:
            policy_loss = named
        elif loss_type in trl.OBJECTIVE_LOSS_TYPES and policy_loss in POLICY_LOSSES and \
                resolve(policy_loss)[0] != named:
            same = trl.same_aggregation(loss_type)
            raise ValueError(
                f"loss_type={loss_type!r} names TRL's {loss_type} objective, but policy_loss={policy_loss!r} asks for "
                f"another: drop one. For {policy_loss} with {loss_type}'s aggregation pass loss_type={same!r} "
                f"(or loss_aggregation); for {loss_type} leave policy_loss unset")
        self.policy_loss = policy_loss

    def _table_reads_delta(self) -> bool:
        """Whether the chosen method has TRL's ``delta`` (the table's grpo: TRL's two-sided clip)."""
        return any(p.name == "delta" for p in method_params(resolve(self.policy_loss)[0]))

    def _check_delta(self) -> None:
        """TRL's ``delta`` (INTELLECT-2's two-sided clip) is a parameter of TRL's clipped objective (the table's grpo
        reads it): with a method that does not, it would be ignored, so it is refused."""
        if self.delta is None or self._table_reads_delta():
            return
        method = self.method()
        has_dual = "dual_clip" in {f.name for f in dataclasses.fields(method)}
        raise ValueError(
            f"delta is TRL's two-sided clip of its clipped objective (policy_loss='grpo'), which "
            f"policy_loss={self.policy_loss!r} does not have: " + (
                "set dual_clip, its cap on the ratio of negative-advantage tokens" if has_dual
                else f"{method.name} has no such cap; use policy_loss='grpo' (or leave it unset) with delta"))

    def _refuse_unread_fields(self) -> None:
        """A method field this class adds (TRL's own keep TRL's meaning), set away from its default, that the
        chosen method does not read would be ignored: refused with the message ``method_config`` gives the
        same keyword (``fused_dgpo_loss(method="grpo", n=2.0)``), naming the fields."""
        method, params_of = resolve(self.policy_loss)[0], config_params()
        unread = {name: params_of[name] for name in unread_method_fields(method)
                  if getattr(self, name) != self.__dataclass_fields__[name].default}
        if not unread:
            return
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in unread)
        try:
            refuse_unknown_params(METHODS[method].config, [params[0].name for params in unread.values()])
        except ValueError as error:
            owners = ", ".join(sorted({p.method for params in unread.values() for p in params}))
            raise ValueError(f"DGPOConfig(policy_loss={self.policy_loss!r}, {fields}): {error}. Those "
                             f"fields are parameters of {owners}: leave them unset, or pick a policy_loss "
                             "that takes them") from None

    def _build_method(self, name: str, fields_only: bool = False) -> MethodConfig | None:
        """The method config of a method or alias from this config's fields (``method_fields.config_field``).
        ``fields_only``: check the values the fields give the method, parameter by parameter, and build nothing
        (a method that is not chosen may lack a required parameter, dro's ``dro_beta``)."""
        method, alias_params = resolve(name)
        values, sources = {}, {}
        for p in config_method_params(method):
            source = p.field
            if source is None or (fields_only and source.offset):
                continue
            field_name, value = source.name, getattr(self, source.name)
            if value is None and p.name in alias_params:
                continue  # the alias's preset
            if value is None and source.fallback is not None:
                field_name, value = source.fallback, getattr(self, source.fallback)
            if value is None:
                continue  # the method's own default
            values[p.name] = source.from_config(value)
            sources[field_name] = f"{field_name}={value!r}" + (
                f" (-> {p.name}={values[p.name]!r})" if source.offset else "")
        if self.delta is not None and "delta" not in values and any(p.name == "delta" for p in method_params(method)):
            values["delta"] = self.delta  # TRL's two-sided clip: the grpo row's delta, read from TRL's field
            sources["delta"] = f"delta={self.delta!r}"
        try:
            if fields_only:
                for p in method_params(method):
                    if p.name in values:
                        p.spec.check(method, p.name, values[p.name])
                return None
            return method_config(method, **{**alias_params, **values})
        except ValueError as error:
            chosen = [] if fields_only else [f"policy_loss={name!r}"]
            raise ValueError(f"DGPOConfig({', '.join([*chosen, *sources.values()])}): {error}") from None

    @property
    def aggregation(self) -> str:
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        # a method's own (dcpo, geo_mean: methods TRL lacks, whose loss_type has no opinion on them), else the row
        # of TRL's loss_type (dgpo_ops.frameworks.trl), which the trainer divides by
        own = METHODS[resolve(self.policy_loss)[0]].aggregation
        return own or f"{trl.SPEC.name}:{trl.SPEC.loss_type(self.loss_type).aggregation}"

    def method(self) -> MethodConfig:
        return self._build_method(self.policy_loss)

    def loss_options(self) -> LossOptions:
        return LossOptions(
            method=self.method(),
            temperature=self.temperature,
            aggregation=self.aggregation,
            beta=self.beta,
            kl_ratio_correction=bool(self.use_bias_correction_kl),
            entropy_coef=self.entropy_coef,
            positive_nll_coef=self.positive_nll_coef,
            importance_sampling_level=self.importance_sampling_level,
        )

    @classmethod
    def from_grpo_config(cls, args: GRPOConfig) -> "DGPOConfig":
        """A plain ``GRPOConfig``'s fields as a ``DGPOConfig``: its ``loss_type`` names the objective, as in TRL."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig) if f.init}
        # GRPOConfig.__post_init__ derived one of these two from the other; given both, it refuses.
        values["generation_batch_size"] = None
        # TRL's epsilon (0.2) is explicit there; DGPOConfig's None means the method's default, TRL's for grpo.
        return cls(**values)
