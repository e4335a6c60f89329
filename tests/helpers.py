"""Inputs that put tokens in every region of every method, shared by the test modules."""

from __future__ import annotations

import math
import os

import pytest
import torch

import dgpo_ops
from dgpo_ops.methods import catalog


def cuda_ready() -> bool:
    """A GPU is visible and Triton compiles real kernels (the interpreter would run them on the CPU)."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on")


# CUDA tests run where a GPU is visible, in a process started with TRITON_INTERPRET=0
# (`TRITON_INTERPRET=0 python -m pytest -m cuda`); elsewhere they skip.
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(
    not cuda_ready(), reason="needs a CUDA device and TRITON_INTERPRET=0 (the CPU tests run the interpreter)")]


def requires_cuda(test):
    for mark in CUDA_MARKS:
        test = mark(test)
    return test

# Every method's test variants, from its row of the method table (dgpo_ops.methods.table.METHODS).
METHOD_VARIANTS = catalog.variants()


def response_scores(responses: int) -> torch.Tensor:
    """Scores 1, -1, 1, ...: their signs differ from those of ``logits_batch``'s advantages (0, +, -, +, ...) on
    every response after the first, so a method that splits responses by the score (topr) is told apart from one
    that splits them by the advantage."""
    return torch.tensor([(-1.0) ** b for b in range(responses)])


def for_method(method: str, options: dict, responses: int | None = None) -> dict:
    """``options`` as a method takes them: a method evaluated at its own sequence statistic (vespo) is already
    sequence-level and takes no importance_sampling_level (GSPO's option sets then run its sequence path); a method
    that reads the responses' scores (topr), or options with the positive-example NLL, get
    ``response_scores(responses)`` where ``responses`` is given."""
    spec = dgpo_ops.METHODS[catalog.resolve(method)[0]]
    if (spec.reads_scores or options.get("positive_nll_coef")) and responses is not None:
        options = {**options, "scores": response_scores(responses)}
    if spec.sequence_statistic is None:
        return options
    return {k: v for k, v in options.items() if k != "importance_sampling_level"}


# The variants the row kernels' epilogue evaluates: no sequence statistic of their own, no batch-level selection
TOKEN_LEVEL_VARIANTS = [v for v in METHOD_VARIANTS if dgpo_ops.LossOptions.build(v[0], **v[1]).token_local]


def docs_tool():
    """``docs/generate.py``, the checkout's tool that writes the docs' generated tables (not a module of the package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "generate.py"
    spec = importlib.util.spec_from_file_location("docs_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def method_route(name: str) -> tuple:
    """The route a method's terms take through the ops, from its row of the method table (``MethodSpec``): its own
    sequence statistic (None: per token) and whether the rollout weights enter it, its batch-level token selection
    (None: none) and whether it reads the responses' scores. Methods with none of these take the token-local route
    (``LossOptions.token_local``: the row kernels' epilogue). A layout (packed rows, the fused-linear op, a vocabulary
    split across processes) reaches a method's math only through its route: the math itself is checked per method
    (the parity against the reference, the kernel mirror, the golden values)."""
    spec = dgpo_ops.METHODS[name]
    statistic = spec.sequence_statistic
    return (statistic, statistic is not None and spec.statistic_folds_rollout_weights, spec.token_selection,
            spec.reads_scores)


def route_representatives(variants) -> list:
    """The first of ``variants`` (in table order) on each route of ``method_route``: a new route gets one as soon
    as the table has a method on it."""
    first = {}
    for variant in variants:
        first.setdefault(method_route(variant[0]), variant)
    return list(first.values())


# One method variant per route: what the layout grids run, each with all of its option sets
ROUTE_VARIANTS = route_representatives(METHOD_VARIANTS)


required_params = catalog.required_params  # what a call by name alone must add (dro's dro_beta)


def required_fields(name: str) -> dict:
    """``required_params`` as the trainer config's fields (``trainer/method_fields.py``)."""
    from dgpo_ops.trainer.method_fields import config_method_params

    params = {p.name: p for p in config_method_params(catalog.resolve(name)[0])}
    return {params[k].field.name: params[k].field.to_config(v) for k, v in required_params(name).items()}


def by_name(name: str, seed: int = 0) -> dict:
    """Keywords for calling a loss by ``name`` alone: its required parameters and a generator seeded with
    ``seed`` (a random selection, clip_cov's, then draws the same tokens on every path)."""
    return {**required_params(name), "generator": torch.Generator().manual_seed(seed)}


def variant_id(variant) -> str:
    name, params = variant
    return name + "".join(f"-{k}={v}" for k, v in params.items())


def trust_region(cfg) -> list[float]:
    """Ratios on and around the method's boundaries (per sign of A where they differ)."""
    edges = []
    for low_name, high_name in (("eps_low", "eps_high"), ("eps_low_pos", "eps_high_pos"), ("eps_low_neg", "eps_high_neg")):
        if hasattr(cfg, low_name):
            edges += [1.0 - getattr(cfg, low_name), 1.0 + getattr(cfg, high_name)]
    for name in ("dual_clip", "r_max"):
        value = getattr(cfg, name, None)
        if value is not None:
            edges += [value, 1.0 / value]
    return edges


def spanning_ratios(cfg) -> torch.Tensor:
    """Ratios covering every region: a log-spaced sweep plus each boundary, just below and above it."""
    ratios = [math.exp(x) for x in torch.linspace(-6.0, 6.0, 49).tolist()] + [1.0]
    for edge in trust_region(cfg):
        if edge > 0:
            ratios += [edge, edge * (1 - 1e-3), edge * (1 + 1e-3)]
    return torch.tensor(ratios, dtype=torch.float64)


def spanning_tokens(cfg, old_prob: float = 0.3):
    """(log_ratio, advantage, old_logp) in float64 for every spanning ratio and A in {+1.3, -0.7, 0}."""
    ratios = spanning_ratios(cfg)
    log_ratio = ratios.log().repeat(3)
    advantage = torch.tensor([1.3, -0.7, 0.0], dtype=torch.float64).repeat_interleave(len(ratios))
    old_logp = torch.full_like(log_ratio, math.log(old_prob))
    return log_ratio, advantage, old_logp


# Log-ratios that land in LN/LP (< log 0.8), M, HP/HN (r = 2) and beyond a dual clip of 3 (r = 4.95, 20).
LOG_RATIO_GRID = [-3.0, 0.7, -1.0, 1.6, 0.05, -0.4, 3.0, 0.2, -0.1]


def logits_batch(B, T, V, *, seed=0, dtype=torch.float32, ratio_spread=1.5, mask_fraction=0.2, per_token_adv=False,
                 logits=None, ref_logps=False):
    """Random logits with old log-probs set so that ratios spread over all regions.

    Returns a dict of inputs for reference_loss / fused_dgpo_loss. The old log-probs are the
    logits' own log-probs (in float64) minus a log-ratio; each response's log-ratios are a shuffled
    shuffled ``LOG_RATIO_GRID`` (scaled by ratio_spread / 1.5), and the responses alternate the sign
    of their advantage (the first has A = 0), so every region of every method gets tokens.
    ``logits`` may be given (e.g. a model's); they are returned as they are. Old log-probs that would be above
    0 (a ratio below the target's probability, which no policy gives) are 0. ``ref_logps``: with reference
    log-probs near the logits' own (for a call with beta > 0, the only one that takes them).
    """
    g = torch.Generator().manual_seed(seed)
    if logits is None:
        logits = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2.0).to(dtype)
    target = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) >= mask_fraction
    mask[:, 0] = True
    target[0, -1] = -100  # an ignored token besides the mask
    logp = torch.log_softmax(logits.double(), -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    grid = torch.tensor(LOG_RATIO_GRID, dtype=torch.float64).repeat(T // len(LOG_RATIO_GRID) + 1)[:T]
    grid = grid * (ratio_spread / 1.5)
    log_ratio = torch.empty(B, T, dtype=torch.float64)
    for b in range(B):  # the grid's first values go to the unmasked tokens, in random order
        kept = mask[b] & (target[b] != -100)
        order = torch.cat([kept.nonzero()[:, 0], (~kept).nonzero()[:, 0]])
        shuffled = torch.randperm(int(kept.sum()), generator=g)
        order[: len(shuffled)] = order[shuffled]
        log_ratio[b, order] = grid
    old_logps = (logp - log_ratio).clamp(max=0.0).float()
    reference = (logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).clamp(max=0.0).float()
    shape = (B, T) if per_token_adv else (B,)
    signs = torch.tensor([0.0] + [(-1.0) ** b for b in range(B - 1)])
    advantages = torch.rand(*shape, generator=g) + 0.2
    advantages = advantages * (signs if not per_token_adv else torch.sign(torch.randn(B, T, generator=g)))
    batch = dict(logits=logits, target_ids=target, advantages=advantages, mask=mask, old_logps=old_logps)
    return dict(batch, ref_logps=reference) if ref_logps else batch


def make_logits(hidden, weight, bias=None, logit_scale=1.0, softcap=None):
    """The logits the fused-linear op projects to, materialised: (hidden @ weight.T + bias) * logit_scale, softcapped."""
    y = hidden @ weight.T
    if bias is not None:
        y = y + bias
    y = y * logit_scale
    return softcap * torch.tanh(y / softcap) if softcap is not None else y


def linear_case(B=3, T=6, H=16, V=70, seed=0, dtype=torch.float32, bias=True, logit_scale=1.0, softcap=None,
                ref_logps=False):
    """hidden, weight, bias and loss inputs whose old log-probs put the model's tokens in every region
    (``ref_logps``: with reference log-probs, as ``logits_batch``)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.3 if bias else None
    logits = make_logits(hidden, weight, b, logit_scale, softcap)
    inputs = logits_batch(B, T, V, seed=seed, logits=logits, ref_logps=ref_logps)
    inputs.pop("logits")
    params = [t.to(dtype) if t is not None else None for t in (hidden, weight, b)]
    return params, inputs


def largest_allocations(fn) -> list[int]:
    """Bytes each op allocated itself while fn runs, largest first: an upper bound on every single
    allocation (an op that made two buffers counts as one of their sum, which only errs strict)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    return sorted(sizes, reverse=True)


def config(variant):
    name, params = variant
    return dgpo_ops.method_config(name, **params)


def value_error_message(call) -> str | None:
    """The message of the ``ValueError`` that ``call()`` raises, None if it raises none: what a worker
    process reports back for the parent's assertions."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return None
