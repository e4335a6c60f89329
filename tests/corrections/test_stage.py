"""The rollout-correction stage's plumbing: ``rollout_logps`` reach the stage on every route (reference, both
kernel sets, packed, fused linear, torch.compile) and, without a correction, change nothing but add the mismatch
metrics verl and TRL log; a correction of each family gives the same results on both kernel sets; wrong input
fails with a ValueError that names it."""

from __future__ import annotations

import pytest
import torch
from dgpo_ops.kernels.interface import LOGP_ABOVE_ZERO_TOLERANCE
from rollout_cases import ROUTES, mismatch_batch, run_route

import dgpo_ops
from dgpo_ops.corrections import (
    ArealCorrection,
    NemoRLCorrection,
    OpenRLHFCorrection,
    SkyRLCorrection,
    SwiftCorrection,
    TrlCorrection,
    VerlCorrection,
)

MISMATCH_METRICS = ("mismatch_kl_k1", "mismatch_kl_k3", "sampling_logp_difference_mean",
                    "sampling_logp_difference_max")


def expected_mismatch_metrics(batch):
    """verl's compute_offpolicy_metrics ``kl`` and ``k3_kl`` (masked means; no NaN in these inputs) and TRL's
    sampling_logp_difference over the scored tokens, re-derived here from their definitions."""
    mask = batch["mask"]
    old, rollout = batch["old_logps"][mask].double(), batch["rollout_logps"][mask].double()
    log_ratio = old - rollout
    return {
        "mismatch_kl_k1": (rollout - old).mean(),
        "mismatch_kl_k3": (torch.exp(log_ratio) - log_ratio - 1).mean(),
        "sampling_logp_difference_mean": log_ratio.abs().mean(),
        "sampling_logp_difference_max": log_ratio.abs().max(),
    }


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("drift", [0.05, 3.0])
def test_rollout_logps_give_the_mismatch_metrics_and_leave_the_loss(route, drift):
    batch = mismatch_batch(drift)
    with_logps, grad = run_route(route, batch, method="grpo")
    without = {k: v for k, v in batch.items() if k != "rollout_logps"}
    # the compiled runner's call takes rollout_logps: the same call, eager and without them
    plain, plain_grad = run_route("torch" if route == "compiled" else route, without, method="grpo")
    torch.testing.assert_close(with_logps.loss, plain.loss)
    torch.testing.assert_close(grad, plain_grad)
    for name, want in expected_mismatch_metrics(batch).items():
        torch.testing.assert_close(with_logps.metrics[name].double(), want, rtol=1e-5, atol=1e-6)
    assert not any(name in plain.metrics for name in MISMATCH_METRICS)


def test_nan_inference_logps_are_left_out_of_every_mismatch_metric():
    """TRL leaves a token without an inference log-prob out of its logp difference; the KL estimates average
    over the same tokens (not counting it as a 0 in the mean), so the four metrics describe one set."""
    batch = mismatch_batch(1.0, nan_tokens=True)
    out = dgpo_ops.reference_loss(**batch, method="grpo")
    finite = batch["mask"] & ~torch.isnan(batch["rollout_logps"])
    want = expected_mismatch_metrics({**batch, "mask": finite})
    for name, value in want.items():
        torch.testing.assert_close(out.metrics[name].double(), value, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("fn", ["reference_loss", "fused_dgpo_loss"])
def test_wrong_rollout_logps_fail_loudly(fn):
    batch = mismatch_batch(0.5)
    call = getattr(dgpo_ops, fn)
    with pytest.raises(ValueError, match="rollout_logps need old_logps"):
        call(**{**batch, "old_logps": None}, method="grpo")
    with pytest.raises(ValueError, match="rollout_logps must have the shape of target_ids"):
        call(**{**batch, "rollout_logps": batch["rollout_logps"][:, :-1]}, method="grpo")
    with pytest.raises(ValueError, match="rollout_logps must be a floating-point tensor"):
        call(**{**batch, "rollout_logps": batch["target_ids"]}, method="grpo")


@pytest.mark.parametrize("bad", ["one boundary", "no boundary", "2-D", "float", "padded tokens"])
def test_a_bad_cu_seqlens_fails_loudly_before_the_stage_uses_it(bad):
    """The stage maps packed tokens to their responses before the route checks cu_seqlens: a cu_seqlens it
    cannot read is refused by name there, not with an indexing error."""
    from rollout_cases import pack

    from dgpo_ops.corrections import TrlCorrection

    batch = mismatch_batch(0.5)
    packed, cu = pack(batch)
    cu = {"one boundary": cu[:1], "no boundary": cu[:0], "2-D": cu[None], "float": cu.float(),
          "padded tokens": cu}[bad]
    if bad == "padded tokens":
        packed = batch
    with pytest.raises(ValueError, match="cu_seqlens"):
        dgpo_ops.fused_dgpo_loss(**packed, cu_seqlens=cu, method="grpo", rollout_correction=TrlCorrection())


def test_a_rejection_keeps_the_callers_mask_values_and_their_checks():
    """A rejection zeroes the caller's mask where it rejects and leaves its values elsewhere: a mask that is not
    0/1 is still refused, an integer mask still works."""
    from dgpo_ops.corrections import VerlCorrection

    batch = mismatch_batch(2.0)
    correction = VerlCorrection(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    as_int = dgpo_ops.reference_loss(**{**batch, "mask": batch["mask"].long()}, rollout_correction=correction)
    as_bool = dgpo_ops.reference_loss(**batch, rollout_correction=correction)
    torch.testing.assert_close(as_int.loss, as_bool.loss)
    assert 0 < float(as_bool.metrics["rollout_masked_fraction"]) < 1
    halves = batch["mask"].float() * 0.5
    with pytest.raises(ValueError, match="mask"):
        dgpo_ops.reference_loss(**{**batch, "mask": halves}, rollout_correction=correction)


def test_the_module_holds_the_correction():
    from dgpo_ops.corrections import TrlCorrection

    batch = mismatch_batch(1.0)
    correction = TrlCorrection("token_truncate", 0.5, 2.0)
    module = dgpo_ops.DGPOLoss("grpo", rollout_correction=correction)
    assert "TrlCorrection" in repr(module)
    logits = batch.pop("logits")
    rollout_logps = batch.pop("rollout_logps")
    got = module(logits, **batch, rollout_logps=rollout_logps)
    want = dgpo_ops.fused_dgpo_loss(logits, **batch, rollout_logps=rollout_logps, method="grpo",
                                    rollout_correction=correction)
    torch.testing.assert_close(got.loss, want.loss)
    assert dgpo_ops.LossOptions.build("grpo", rollout_correction=correction) is module.options  # built once


NON_FINITE = {
    # OpenRLHF's weight of a token the engine gave no log-prob is NaN
    "nan_logps": (dict(nan_tokens=True), "OpenRLHFCorrection", "on 2 scored token\\(s\\), 2 of them with a NaN"),
    # TRL's sequence product without clip_max overflows float32 on a long response that drifts by 30 nats a token
    "overflow": (dict(), "TrlCorrection", "on 6 scored token\\(s\\), 0 of them with a NaN"),
}


def non_finite_case(case):
    from dgpo_ops.corrections import OpenRLHFCorrection, TrlCorrection

    flags, _, _ = NON_FINITE[case]
    batch = mismatch_batch(0.5, seed=8, **flags)
    if case == "overflow":
        batch["rollout_logps"][0] = batch["old_logps"][0] - 30.0
        return batch, TrlCorrection("sequence_truncate", vllm_importance_sampling_clip_min=0.5,
                                    vllm_importance_sampling_clip_max=None)
    return batch, OpenRLHFCorrection("token", "clip")


@pytest.mark.parametrize("case", sorted(NON_FINITE))
@pytest.mark.parametrize("fn", ["reference_loss", "fused_dgpo_loss"])
def test_non_finite_weights_are_refused_by_the_corrections_name(case, fn):
    """The weights the stage computes are not the caller's rollout_weights: the error names the correction,
    rollout_logps and how many tokens, and why."""
    batch, correction = non_finite_case(case)
    _, name, count = NON_FINITE[case]
    with pytest.raises(ValueError, match=f"rollout_correction {name}\\(.*non-finite weights from rollout_logps.*{count}"):
        getattr(dgpo_ops, fn)(**batch, method="grpo", rollout_correction=correction)


def test_non_finite_weights_under_deferred_validation_name_the_correction_later():
    """Deferred validation reads nothing now: a NaN loss, then the route's error, which says the weights may be a
    rollout_correction's."""
    batch, correction = non_finite_case("nan_logps")
    dgpo_ops.raise_deferred_errors()
    out = dgpo_ops.fused_dgpo_loss(**batch, method="grpo", rollout_correction=correction, validation="deferred")
    assert torch.isnan(out.loss)
    with pytest.raises(ValueError, match="computed by a rollout_correction from rollout_logps"):
        dgpo_ops.raise_deferred_errors()


def test_non_finite_weights_under_compile_name_the_correction():
    """Under torch.compile the stage reads nothing on the host (fullgraph); the compiled route's check refuses
    the weights, saying they may be a rollout_correction's."""
    batch, correction = non_finite_case("nan_logps")
    with pytest.raises(ValueError, match="computed by a rollout_correction from rollout_logps"):
        run_route("compiled", batch, method="grpo", rollout_correction=correction)


@pytest.mark.parametrize("validation", ["immediate", "deferred"])
@pytest.mark.parametrize("bad", ["old_logps", "mask"])
def test_a_rejection_does_not_hide_a_value_the_routes_refuse(bad, validation):
    """M2PO drops the tokens of largest (behave - prox)^2 first; a NaN old log-prob or a mask value of 0.5 on a
    scored token is refused all the same (by the route's check, immediate or deferred), as without a correction
    and as AReaL refuses it, instead of leaving the mask unnoticed."""
    from dgpo_ops.corrections import m2po

    batch = mismatch_batch(0.3, seed=3)
    batch["mask"] = batch["mask"].float()
    batch["rollout_logps"][1, 0] = batch["old_logps"][1, 0] - 30.0  # the largest m2: M2PO drops it first
    if bad == "old_logps":
        batch["old_logps"][1, 0] = float("nan")
    else:
        batch["mask"][1, 0] = 0.5
    batch["advantages"] = batch["advantages"].float()
    message = "old_logps has non-finite" if bad == "old_logps" else "mask must hold only 0 and 1"
    logits = batch.pop("logits").requires_grad_(True)
    with pytest.raises(ValueError, match=message):
        out = dgpo_ops.fused_dgpo_loss(logits, **batch, method="grpo", rollout_correction=m2po(0.04),
                                       validation=validation, backend="torch")
        out.loss.backward()
        dgpo_ops.raise_deferred_errors()
    with pytest.raises(ValueError, match=message):
        dgpo_ops.reference_loss(logits, **batch, method="grpo", rollout_correction=m2po(0.04))


# One correction of each family, token- and sequence-level, masking and truncating: each family's modes
# are checked against its framework on the other routes (rollout_cases.CORRECTION_ROUTES), and on the
# Triton kernels here.
EVERY_FAMILY = [TrlCorrection("token_mask", 0.5, 2.0), TrlCorrection("sequence_truncate", 0.2, 3.0),
                VerlCorrection(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05),
                ArealCorrection(level="sequence", action="clamp", upper=1.2, lower=0.9),
                OpenRLHFCorrection(), NemoRLCorrection(truncated_importance_sampling_type="icepop",
                                                       truncated_importance_sampling_ratio=3.0,
                                                       truncated_importance_sampling_ratio_min=0.3),
                SkyRLCorrection(tis_ratio_type="token", sequence_mask_metric="geometric"), SwiftCorrection()]


@pytest.mark.parametrize("correction", EVERY_FAMILY, ids=lambda c: type(c).__name__)
def test_a_correction_gives_the_same_on_both_kernel_sets(correction):
    batch = mismatch_batch(0.4, seed=3)
    kwargs = dict(method="grpo", aggregation="seq_mean_token_mean")
    twins, twins_grad = run_route("torch", batch, rollout_correction=correction, **kwargs)
    kernels, kernels_grad = run_route("triton", batch, rollout_correction=correction, **kwargs)
    uncorrected, _ = run_route("torch", batch, **kwargs)
    assert abs(float(twins.loss) - float(uncorrected.loss)) > 1e-4  # the correction weighs these tokens
    torch.testing.assert_close(kernels.loss, twins.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernels_grad, twins_grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernels.logps, twins.logps, rtol=1e-5, atol=1e-6)
    for name in dgpo_ops.core.metrics.METRIC_NAMES:
        torch.testing.assert_close(kernels.metrics[name], twins.metrics[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("correction", [None, VerlCorrection(rollout_is="token")],
                         ids=["metrics_only", "verl"])
@pytest.mark.parametrize("route", ("reference", "torch", "packed", "linear"))
def test_rollout_logps_above_zero_are_refused_by_name(route, correction):
    """Probabilities passed for the engine's log-probs gave a finite loss (and mismatch metrics) of another
    value; a value within rounding of 0 is a log-prob."""
    batch = mismatch_batch(0.5)
    probabilities = {**batch, "rollout_logps": batch["rollout_logps"].exp()}
    with pytest.raises(ValueError, match="^rollout_logps has values above 0 .*not probabilities"):
        run_route(route, probabilities, method="grpo", rollout_correction=correction)
    rounded = batch["rollout_logps"].clone()
    rounded[0, 0] = LOGP_ABOVE_ZERO_TOLERANCE / 2
    out, _ = run_route(route, {**batch, "rollout_logps": rounded}, method="grpo",
                       rollout_correction=correction)
    assert torch.isfinite(out.loss)


@pytest.mark.usefixtures("no_pending_checks")
@pytest.mark.parametrize("route", ("torch", "triton", "packed", "linear"))
def test_deferred_rollout_logps_above_zero_give_nan_now_and_are_named_later(route):
    batch = mismatch_batch(0.5)
    shifted = batch["rollout_logps"].clone()
    shifted[0, 0] = 0.5
    out, grad = run_route(route, {**batch, "rollout_logps": shifted}, method="grpo", validation="deferred")
    assert torch.isnan(out.loss) and torch.isnan(grad).any()
    with pytest.raises(ValueError, match="^rollout_logps has values above 0 .*found on the device in an "
                                         "earlier policy_loss call"):
        dgpo_ops.raise_deferred_errors()


def test_rollout_logps_above_zero_under_compile_give_a_nan_loss():
    """One graph reads nothing on the host and queues no check: the loss is NaN, unnamed."""
    batch = mismatch_batch(0.5)
    shifted = batch["rollout_logps"].clone()
    shifted[0, 0] = 0.5
    out, _ = run_route("compiled", {**batch, "rollout_logps": shifted}, method="grpo")
    assert torch.isnan(out.loss)
