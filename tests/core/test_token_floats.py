"""Every per-token float of ``LossInputs`` (a field marked ``TokenFloat``) is checked, laid out and carried by
its mark alone: these tests run over ``TOKEN_FLOATS`` on the fused logits op, the fused-linear op, the
reference, the packed layout and the loss from log-probs, immediate and deferred, so a new field is tested
there without an edit here once ``READS_ALL`` names an option that reads it; the inputs only the torch
objective reads also through the compiled ops. (The split vocabulary reads the grid's inputs as the whole one
does.)"""

from __future__ import annotations

import pytest
import torch
from dgpo_ops.kernels.interface import (
    LOG_PROBABILITY_INPUTS,
    LOGP_ABOVE_ZERO_TOLERANCE,
    NUM_STATUS,
    WEIGHT_INPUTS,
    InputError,
    Status,
)
from dgpo_ops.ops.logits import logits_plan
from helpers import logits_batch

import dgpo_ops
from dgpo_ops.core.inputs import (
    OBJECTIVE_FLOATS,
    OP_TENSORS,
    TOKEN_FLOATS,
    LossInputs,
    TokenFloat,
)
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.validation import error_message

B, T, V, H = 3, 5, 17, 8
LENGTHS = (5, 3, 4)
# A call that reads every per-token float: the KL its reference log-probs, the positive-example NLL the
# scores.
READS_ALL = dict(method="dgpo", beta=0.1, positive_nll_coef=0.2)


def inputs(seed=0) -> dict:
    batch = logits_batch(B, T, V, seed=seed, per_token_adv=True, ref_logps=True)
    for name in LOG_PROBABILITY_INPUTS:  # at most -0.25, so that + 0.25 (a change of value) is a log-prob too
        batch[name] = batch[name] - 0.25
    g = torch.Generator().manual_seed(seed + 1)
    for name in TOKEN_FLOATS:
        batch.setdefault(name, torch.rand(B, T, generator=g) * 2 - (0 if name in WEIGHT_INPUTS else 0.5))
    for b, length in enumerate(LENGTHS):  # nothing beyond each response's length (the packed layout drops it)
        batch["target_ids"][b, length:] = -100
    return batch


def projection(seed=0):
    g = torch.Generator().manual_seed(seed + 2)
    float64 = dict(generator=g, dtype=torch.float64)
    return torch.randn(B, T, H, **float64), torch.randn(V, H, **float64)


ROUTES = {
    "fused": lambda batch: dgpo_ops.fused_dgpo_loss(**batch, **READS_ALL).loss,
    "reference": lambda batch: dgpo_ops.reference_loss(**batch, **READS_ALL).loss,
    "linear": lambda batch: dgpo_ops.fused_linear_dgpo_loss(
        *projection(), **{k: v for k, v in batch.items() if k != "logits"}, **READS_ALL).loss,
}


def per_response(value: torch.Tensor) -> torch.Tensor:
    """One value per response (its first token's), and the same spread over its tokens."""
    return value[:, 0].clone()


def test_the_marks_derive_the_tensors_of_every_route():
    """The marks as written on LossInputs (one dropped would shrink every grid below without a failure); a new
    one joins them, and the custom ops' tensors, where it stands among the fields."""
    per_token, per_response = TokenFloat(), TokenFloat(per_response=True)
    known = {"advantages": per_response, "old_logps": per_token, "ref_logps": per_token,
             "rollout_weights": per_token, "scores": per_response}
    assert {name: TOKEN_FLOATS.get(name) for name in known} == known
    assert {"target_ids", "mask", *known} <= set(OP_TENSORS)
    assert "scores" in OBJECTIVE_FLOATS
    assert not {"advantages", "old_logps", "ref_logps"} & set(OBJECTIVE_FLOATS)


@pytest.mark.parametrize("name", TOKEN_FLOATS)
@pytest.mark.parametrize("route", ROUTES)
def test_each_is_read_and_checked_on_every_route(route, name):
    batch = inputs()
    loss = ROUTES[route](batch)
    changed = dict(batch, **{name: batch[name] + 0.25})
    assert not torch.allclose(ROUTES[route](changed), loss), f"{name} is not read by READS_ALL on {route}"
    with pytest.raises(ValueError, match=f"{name} must have shape"):
        ROUTES[route](dict(batch, **{name: batch[name][:, :-1]}))
    with pytest.raises(ValueError, match=f"{name} must be a floating-point tensor"):
        ROUTES[route](dict(batch, **{name: batch[name].to(torch.int64)}))
    bad = batch[name].clone()
    bad[1, 1] = float("inf")
    with pytest.raises(ValueError, match=f"^{name} .*non-finite (or negative )?values on unmasked tokens"):
        ROUTES[route](dict(batch, **{name: bad}))


@pytest.mark.parametrize("name", TOKEN_FLOATS)
@pytest.mark.parametrize("route", ROUTES)
def test_a_per_response_value_equals_it_spread_over_the_tokens(route, name):
    batch = inputs(seed=3)
    one = per_response(batch[name])
    if TOKEN_FLOATS[name].per_response:
        spread = ROUTES[route](dict(batch, **{name: one[:, None].expand(B, T)}))
        torch.testing.assert_close(ROUTES[route](dict(batch, **{name: one})), spread)
    else:
        with pytest.raises(ValueError, match=rf"{name} must have shape \({B}, {T}\), got \({B},\)"):
            ROUTES[route](dict(batch, **{name: one}))


def packed(batch: dict) -> tuple[dict, torch.Tensor]:
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return {name: torch.cat([value[b, :n] for b, n in enumerate(LENGTHS)]) if value.dim() >= 2 else value
            for name, value in batch.items()}, cu


@pytest.mark.parametrize("name", TOKEN_FLOATS)
def test_packed_sequences_pad_each_as_the_padded_grid_reads_it(name):
    batch = inputs(seed=5)
    want = dgpo_ops.fused_dgpo_loss(**batch, **READS_ALL, aggregation="seq_mean_token_mean").loss
    flat, cu = packed(batch)
    got = dgpo_ops.fused_dgpo_loss(**flat, cu_seqlens=cu, **READS_ALL, aggregation="seq_mean_token_mean").loss
    torch.testing.assert_close(got, want)
    one = per_response(batch[name])
    flat_one = dict(flat, **{name: one})
    if TOKEN_FLOATS[name].per_response:
        want = dgpo_ops.fused_dgpo_loss(**dict(batch, **{name: one}), **READS_ALL).loss
        got = dgpo_ops.fused_dgpo_loss(**flat_one, cu_seqlens=cu, **READS_ALL).loss
        torch.testing.assert_close(got, want)
    else:
        with pytest.raises(ValueError, match=f"{name} must have shape .* for packed tokens"):
            dgpo_ops.fused_dgpo_loss(**flat_one, cu_seqlens=cu, **READS_ALL)


def logps_route(batch: dict, **options):
    """The loss from log-probs (verl's and SkyRL's call), its log-probs the logits' own."""
    batch = dict(batch)
    logits, target_ids = batch.pop("logits"), batch.pop("target_ids")
    mask = batch.pop("mask") & (target_ids != -100)
    logps = torch.log_softmax(logits, -1).gather(-1, target_ids.clamp(min=0)[..., None])[..., 0]
    logps = logps.detach().requires_grad_(True)
    options = {**READS_ALL, **options}
    out = dgpo_ops.policy_loss(LossInputs(target_ids=None, mask=mask, **batch),
                               LossOptions.build(options.pop("method"), **options), logps=logps)
    return out.loss, logps


def deferred(route: str, batch: dict, **options):
    """``(loss, the gradient of the input that carries it)`` of one call under deferred validation."""
    options = {**READS_ALL, **options, "validation": "deferred"}
    if route == "logps":
        loss, leaf = logps_route(batch, **options)
    elif route == "linear":
        hidden, weight = projection()
        leaf = hidden.requires_grad_(True)
        fields = {k: v for k, v in batch.items() if k != "logits"}
        loss = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **fields, **options).loss
    else:
        leaf = batch["logits"].requires_grad_(True)
        if route == "packed":
            flat, cu = packed(batch)
            loss = dgpo_ops.fused_dgpo_loss(**flat, cu_seqlens=cu, **options).loss
        else:
            loss = dgpo_ops.fused_dgpo_loss(**batch, **options).loss
    loss.backward()
    return loss, leaf.grad


DEFERRED_ROUTES = ["fused", "linear", "packed", "logps"]


@pytest.mark.usefixtures("no_pending_checks")
@pytest.mark.parametrize("name", TOKEN_FLOATS)
@pytest.mark.parametrize("route", DEFERRED_ROUTES)
def test_deferred_a_non_finite_value_gives_nan_now_and_names_it_later(route, name):
    batch = inputs(seed=7)
    batch["mask"] = batch["mask"].clone()
    batch["mask"][1, 0] = False
    unscored = batch[name].clone()
    unscored[1, 0] = float("nan")  # where no token is scored: not an error
    unscored_loss, _ = deferred(route, dict(batch, **{name: unscored}))
    assert torch.isfinite(unscored_loss)
    dgpo_ops.raise_deferred_errors()
    bad = batch[name].clone()
    bad[1, 1] = float("nan")  # a scored token
    loss, grad = deferred(route, dict(batch, **{name: bad}))
    assert torch.isnan(loss) and torch.isnan(grad).any()
    if route == "logps":  # as the frameworks' own losses: no error queued, a NaN loss
        return
    with pytest.raises(ValueError, match=f"^{name} .*non-finite (or negative )?values on unmasked tokens"):
        dgpo_ops.raise_deferred_errors()


@pytest.mark.usefixtures("no_pending_checks")
@pytest.mark.parametrize("name", OBJECTIVE_FLOATS)
def test_deferred_checks_the_inputs_a_completed_batch_brings(name):
    """The fused-linear op runs its prologue before the first sweep; inputs made from that sweep
    (``complete_batch``: a trainer's) are checked when they arrive."""
    batch = inputs(seed=9)
    hidden, weight = projection()
    fields = {k: v for k, v in batch.items() if k != "logits"}
    options = LossOptions.build(**{**READS_ALL, "validation": "deferred"})
    bad = batch[name].clone()
    bad[0, 0] = float("nan")
    first = LossInputs(**fields)
    batch_with_bad = first._replace(**{name: bad})
    loss = dgpo_ops.policy_loss(first, options, hidden=hidden, weight=weight,
                                complete_batch=lambda logps, entropy: batch_with_bad).loss
    assert torch.isnan(loss)
    with pytest.raises(ValueError, match=f"^{name} has non-finite values"):
        dgpo_ops.raise_deferred_errors()


def test_a_deferred_error_names_the_objective_input_at_its_place():
    status = torch.zeros(NUM_STATUS, dtype=torch.int64)
    status[Status.ERRORS] = int(InputError.OBJECTIVE_INPUT)
    status[Status.BAD_INPUT] = 1
    assert error_message(status, 10, objective_inputs=("first", "second")).startswith("second has non-finite")


@pytest.mark.parametrize("name", OBJECTIVE_FLOATS)
def test_a_call_passing_an_objective_input_runs_the_torch_objective(name):
    """The kernels' epilogue reads none of them: a call that passes one takes the objective route, so no
    option that reads it can be skipped by the epilogue (whatever ``LossOptions.token_local`` says of it)."""
    batch = inputs()
    logits = batch.pop("logits")
    options = LossOptions.build("dgpo")
    assert options.token_local
    without = {key: value for key, value in batch.items() if key not in (*OBJECTIVE_FLOATS, "ref_logps")}
    assert logits_plan(logits, LossInputs(**without), options, True, True).uses_epilogue
    passed = LossInputs(**without, **{name: batch[name]})
    assert not logits_plan(logits, passed, options, True, True).uses_epilogue


@pytest.mark.parametrize("token_local", [True, False], ids=["token_local", "reads_all"])
@pytest.mark.parametrize("name", OBJECTIVE_FLOATS)
def test_compiled_calls_carry_each_objective_input_as_eager_ones(name, token_local):
    """Through the custom ops (one graph): the loss and gradient of a call passing the input equal the eager
    call's, also where the method alone would run the epilogue (the backward then reads the coefficients)."""
    batch = inputs(seed=11)
    logits = batch.pop("logits")
    options = dict(method="dgpo", beta=0.1) if token_local else READS_ALL
    without = {key: value for key, value in batch.items() if key not in OBJECTIVE_FLOATS or key == name}

    def loss_of(x):
        return dgpo_ops.fused_dgpo_loss(x * 1.0, **without, **options).loss

    eager, compiled = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    want = loss_of(eager)
    want.backward()
    torch._dynamo.reset()
    got = torch.compile(loss_of, fullgraph=True, backend="aot_eager")(compiled)
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled.grad, eager.grad)


def immediate(route: str, batch: dict):
    """The loss of one call on ``route`` under immediate validation (the CPU's default)."""
    if route == "packed":
        flat, cu = packed(batch)
        return dgpo_ops.fused_dgpo_loss(**flat, cu_seqlens=cu, **READS_ALL).loss
    if route == "logps":
        return logps_route(batch)[0]
    return ROUTES[route](batch)


@pytest.mark.parametrize("mistake", ["probabilities", "shifted"])
@pytest.mark.parametrize("name", LOG_PROBABILITY_INPUTS)
@pytest.mark.parametrize("route", [*ROUTES, "packed", "logps"])
def test_a_log_prob_above_zero_is_refused_by_name(route, name, mistake):
    """Probabilities passed for log-probs (``old.exp()``), or log-probs shifted above 0, gave a finite loss of
    another value; a value within rounding of 0 is a log-prob."""
    batch = inputs()
    bad = batch[name].exp() if mistake == "probabilities" else batch[name] + 10.0
    with pytest.raises(ValueError, match=f"^{name} .*values above 0 .*not probabilities"):
        immediate(route, dict(batch, **{name: bad}))
    rounded = batch[name].clone()
    rounded[0, 0] = LOGP_ABOVE_ZERO_TOLERANCE / 2  # a log-softmax and a log-sum-exp rounded apart
    assert torch.isfinite(immediate(route, dict(batch, **{name: rounded})))


@pytest.mark.usefixtures("no_pending_checks")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", LOG_PROBABILITY_INPUTS)
@pytest.mark.parametrize("route", DEFERRED_ROUTES)
def test_deferred_a_log_prob_above_zero_gives_nan_now_and_names_it_later(route, name, backend):
    """The prologue kernel and its torch twin set the input's bit, and the loss from log-probs queues it."""
    if route in ("logps", "linear") and backend == "triton":  # the prologue is the fused route's
        pytest.skip("the loss from log-probs runs no kernel; the linear route's inputs here are float64")
    batch = inputs(seed=7)
    batch["mask"] = batch["mask"].clone()
    batch["mask"][1, 1] = True
    rounded = batch[name].clone()
    rounded[1, 1] = LOGP_ABOVE_ZERO_TOLERANCE / 2
    loss, _ = deferred(route, dict(batch, **{name: rounded}), backend=backend)
    assert torch.isfinite(loss)
    dgpo_ops.raise_deferred_errors()
    bad = batch[name].clone()
    bad[1, 1] = 0.5  # a probability
    loss, grad = deferred(route, dict(batch, **{name: bad}), backend=backend)
    assert torch.isnan(loss) and torch.isnan(grad).any()
    with pytest.raises(ValueError, match=f"^{name} .*values above 0 .*found on the device in an earlier"):
        dgpo_ops.raise_deferred_errors()


@pytest.mark.parametrize("name", WEIGHT_INPUTS)
@pytest.mark.parametrize("route", ROUTES)
def test_a_weight_below_zero_is_refused_on_every_route(route, name):
    """An importance weight is >= 0: a log-ratio passed for a ratio would flip or zero its tokens' policy terms.
    Where no token is scored it is no error; 0 is a weight."""
    batch = inputs(seed=9)
    batch["mask"] = batch["mask"].clone()
    batch["mask"][1, 0] = False
    weights = batch[name].clone()
    weights[1, 0], weights[0, 1] = -0.5, 0.0  # not scored; a zero weight
    assert torch.isfinite(ROUTES[route](dict(batch, **{name: weights})))
    weights[1, 1] = -1e-6  # a scored token
    with pytest.raises(ValueError, match=rf"^{name} .*negative values on unmasked tokens: importance weights are >= 0"):
        ROUTES[route](dict(batch, **{name: weights}))


@pytest.mark.usefixtures("no_pending_checks")
@pytest.mark.parametrize("name", WEIGHT_INPUTS)
@pytest.mark.parametrize("route", DEFERRED_ROUTES)
def test_deferred_a_weight_below_zero_gives_nan_now_and_names_it_later(route, name):
    batch = inputs(seed=11)
    weights = batch[name].clone()
    weights[1, 1] = -0.5
    loss, _ = deferred(route, dict(batch, **{name: weights}))
    assert torch.isnan(loss)
    with pytest.raises(ValueError, match=rf"^{name} .*negative values on unmasked tokens"):
        dgpo_ops.raise_deferred_errors()
