"""The loss from per-token log-probs (``policy_loss(..., logps=...)``, ``dgpo_ops/ops/from_logps.py``): the
reference's loss and gradient when the log-probs are the logits' own, one method per route
(helpers.ROUTE_VARIANTS) with its option sets; ``token_scales``; the rollout-correction stage; its refusals, its
value checks and torch.compile."""

import pytest
import torch
from helpers import ROUTE_VARIANTS, for_method, logits_batch, variant_id

import dgpo_ops
from dgpo_ops import LossInputs, LossOptions, policy_loss
from dgpo_ops.core.aggregation import token_scales
from dgpo_ops.corrections import TrlCorrection

OPTION_SETS = {
    "plain": dict(),
    "kl_nll": dict(beta=0.05, kl_ratio_correction=True, positive_nll_coef=0.1),
    "gspo_seq_mean": dict(importance_sampling_level="sequence", aggregation="seq_mean_token_mean"),
    "normalizer_rollout_weights": dict(loss_normalizer=7.0, rollout_weights=True),
}
INPUT_NAMES = ("ref_logps", "rollout_weights", "loss_normalizer", "scores", "generator")


def case(seed=0):
    """A logits batch in float64, and the same tokens as log-probs: the targets' log-softmax, the ignored ones
    (-100) moved into the mask."""
    batch = logits_batch(3, 9, 17, seed=seed, dtype=torch.float64, ref_logps=True)
    logits = batch.pop("logits").requires_grad_()
    target = batch["target_ids"]
    logps = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    mask = batch["mask"] & (target != -100)
    return logits, batch, logps, mask


def split(options: dict, batch: dict, generator_seed=0):
    """``options`` as ``(LossInputs fields, LossOptions fields)``, each test input made from ``batch``."""
    inputs = {name: value for name, value in options.items() if name in INPUT_NAMES}
    if inputs.pop("rollout_weights", False):
        inputs["rollout_weights"] = torch.rand(batch["mask"].shape, generator=torch.Generator().manual_seed(1)) + 0.5
    if "beta" in options:
        inputs["ref_logps"] = batch["ref_logps"].double()
    inputs["generator"] = torch.Generator().manual_seed(generator_seed)
    return inputs, {name: value for name, value in options.items() if name not in INPUT_NAMES + ("rollout_weights",)}


@pytest.mark.parametrize("options", list(OPTION_SETS), ids=list(OPTION_SETS))
@pytest.mark.parametrize("variant", ROUTE_VARIANTS, ids=variant_id)
def test_equals_the_reference_on_the_logits_own_logps(variant, options):
    method, params = variant
    logits, batch, logps, mask = case()
    inputs, option_fields = split(for_method(method, OPTION_SETS[options], responses=3), batch)
    common = dict(advantages=batch["advantages"], old_logps=batch["old_logps"].double(), **inputs)
    expected = dgpo_ops.reference_loss(logits, batch["target_ids"], mask=batch["mask"], method=method, **params,
                                       **option_fields, **common)
    (expected_grad,) = torch.autograd.grad(expected.loss, logits)
    common["generator"] = torch.Generator().manual_seed(0)  # the same draw (clip_cov's selection)
    out = policy_loss(LossInputs(None, mask=mask, **common), LossOptions.build(method, **params, **option_fields),
                      logps=logps)
    (grad,) = torch.autograd.grad(out.loss, logits)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.logps, expected.logps)
    assert out.entropy is None
    for name in expected.metrics:
        if name != "entropy_mean":  # log-probs carry no entropy: 0
            torch.testing.assert_close(out.metrics[name], expected.metrics[name], msg=name)
    assert float(out.metrics["entropy_mean"]) == 0.0


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_token_scales_replace_the_aggregation(aggregation):
    _, batch, logps, mask = case(seed=1)
    inputs = LossInputs(None, batch["advantages"], mask, batch["old_logps"].double())
    by_aggregation = policy_loss(inputs, LossOptions.build("dgpo", aggregation=aggregation), logps=logps)
    scales = token_scales(mask, aggregation, dtype=torch.float64)
    options = LossOptions.build("dgpo")  # its own aggregation (token_mean): token_scales win over it
    by_scales = policy_loss(inputs, options, logps=logps, token_scales=scales)
    torch.testing.assert_close(by_scales.loss, by_aggregation.loss, rtol=1e-12, atol=1e-12)
    doubled = policy_loss(inputs, options, logps=logps, token_scales=2 * scales)
    torch.testing.assert_close(doubled.loss, 2 * by_aggregation.loss, rtol=1e-12, atol=1e-12)
    # a scale off the mask is never read
    off_mask = policy_loss(inputs, options, logps=logps, token_scales=torch.where(mask, scales, float("nan")))
    torch.testing.assert_close(off_mask.loss, by_aggregation.loss, rtol=1e-12, atol=1e-12)


def test_the_rollout_correction_runs_before_it():
    logits, batch, logps, mask = case(seed=2)
    rollout = batch["old_logps"].double() + 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(3),
                                                              dtype=torch.float64)
    correction = TrlCorrection(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.2)
    common = dict(advantages=batch["advantages"], old_logps=batch["old_logps"].double(), rollout_logps=rollout)
    expected = dgpo_ops.reference_loss(logits, batch["target_ids"], mask=batch["mask"], method="grpo",
                                       rollout_correction=correction, **common)
    out = policy_loss(LossInputs(None, mask=mask, **common), LossOptions.build("grpo", rollout_correction=correction),
                      logps=logps)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-12, atol=1e-12)
    assert set(out.metrics) == set(expected.metrics)
    for name in set(expected.metrics) - set(dgpo_ops.core.metrics.METRIC_NAMES):
        torch.testing.assert_close(out.metrics[name], expected.metrics[name], msg=name)


REFUSALS = {
    "target_ids": (dict(target_ids=True), {}, {}, "takes no target_ids"),
    "entropy_coef": ({}, dict(entropy_coef=0.1), {}, "need entropies"),
    "entropy_weights": (dict(entropy_weights=True), {}, {}, "need entropies"),
    "cu_seqlens": (dict(cu_seqlens=True), {}, {}, "describe logits"),
    "projection": ({}, dict(softcap=30.0), {}, "apply to the loss from hidden states"),
    "scales_and_normalizer": (dict(loss_normalizer=3.0), {}, dict(token_scales=True), "pass one of them"),
    "three_dims": ({}, {}, dict(logps_3d=True), r"\(batch, response_length\)"),
    "two_sources": ({}, {}, dict(logits=True), "one source"),
    "scales_of_another_shape": ({}, {}, dict(token_scales_shape=(3, 8)), "token_scales must have shape"),
    "mask_elsewhere": (dict(mask_on_meta=True), {}, {}, "mask is on meta but logps are on cpu"),
    # the log-probs are the model's as it gave them: a temperature here would be applied to nothing
    "temperature": ({}, dict(temperature=0.7), {}, "temperature and inplace apply to logits"),
    "inplace": ({}, dict(inplace=True), {}, "temperature and inplace apply to logits"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals(name):
    input_changes, option_changes, call_changes, message = REFUSALS[name]
    _, batch, logps, mask = case()
    fields = dict(target_ids=None, advantages=batch["advantages"], mask=mask, old_logps=batch["old_logps"].double())
    if input_changes.get("target_ids"):
        fields["target_ids"] = batch["target_ids"]
    if input_changes.get("entropy_weights"):
        fields["entropy_weights"] = torch.ones(mask.shape, dtype=torch.float64)
    if input_changes.get("cu_seqlens"):
        fields["cu_seqlens"] = torch.tensor([0, 9, 18, 27], dtype=torch.int32)
    if "loss_normalizer" in input_changes:
        fields["loss_normalizer"] = input_changes["loss_normalizer"]
    if input_changes.get("mask_on_meta"):
        fields["mask"] = mask.to("meta")
    call = dict(logps=logps)
    if call_changes.get("token_scales"):
        call["token_scales"] = mask.double()
    if "token_scales_shape" in call_changes:
        call["token_scales"] = torch.ones(call_changes["token_scales_shape"], dtype=torch.float64)
    if call_changes.get("logps_3d"):
        call["logps"] = logps[..., None]
    if call_changes.get("logits"):
        call["logits"] = torch.zeros(3, 9, 17)
    with pytest.raises(ValueError, match=message):
        policy_loss(LossInputs(**fields), LossOptions.build("grpo", **option_changes), **call)


def test_token_scales_need_the_logps_source():
    logits, batch, _, _ = case()
    inputs = LossInputs(batch["target_ids"], batch["advantages"], batch["mask"])
    with pytest.raises(ValueError, match="token_scales apply to the loss from log-probs"):
        policy_loss(inputs, LossOptions.build("grpo"), logits=logits.detach(), token_scales=torch.ones(3, 9))


@pytest.mark.usefixtures("no_pending_checks")
@pytest.mark.parametrize("bad", ["advantages", "old_logps", "token_scales", "mask"])
def test_values_checked_when_immediate_and_not_when_deferred(bad):
    _, batch, logps, mask = case()
    fields = dict(advantages=batch["advantages"][:, None].expand(3, 9).clone(), mask=mask.double(),
                  old_logps=batch["old_logps"].double())
    scales = mask.double() / mask.sum()
    spot = mask.nonzero()[0].tolist()
    if bad == "mask":
        fields["mask"][tuple(spot)] = 0.5
    elif bad == "token_scales":
        scales[tuple(spot)] = float("inf")
    else:
        fields[bad][tuple(spot)] = float("nan")
    inputs = LossInputs(None, **fields)
    with pytest.raises(ValueError, match=f"{bad} (has non-finite values|must hold only 0 and 1)"):
        policy_loss(inputs, LossOptions.build("grpo", validation="immediate"), logps=logps, token_scales=scales)
    out = policy_loss(inputs, LossOptions.build("grpo", validation="deferred"), logps=logps, token_scales=scales)
    if bad != "mask":  # deferred: nothing read on the host, the bad value reaches the loss as the frameworks' do
        assert not torch.isfinite(out.loss)
    if bad == "old_logps":  # and a log-prob input is named later, as the fused ops' deferred errors are
        with pytest.raises(ValueError, match="old_logps has non-finite values .*found on the device in an "
                                             "earlier policy_loss call"):
            dgpo_ops.raise_deferred_errors()


@pytest.mark.usefixtures("no_pending_checks")
def test_logps_above_zero_are_refused_now_or_named_later():
    """Probabilities passed as the policy's log-probs give a finite, wrong loss: refused on a scored token (now, or
    NaN now and named later under deferred validation). Above 0 where nothing is scored, and a NaN (the model's,
    as a NaN logit is), are no error."""
    _, batch, logps, mask = case()
    inputs = LossInputs(None, batch["advantages"], mask, batch["old_logps"].double())
    unscored = logps.detach().clone()
    unscored[~mask] = 0.5
    unscored[tuple(mask.nonzero()[0].tolist())] = float("nan")
    for validation in ("immediate", "deferred"):
        out = policy_loss(inputs, LossOptions.build("grpo", validation=validation), logps=unscored)
        assert torch.isnan(out.loss)
    dgpo_ops.raise_deferred_errors()
    probabilities = logps.detach().exp()
    with pytest.raises(ValueError, match=r"^logps has values above 0 on unmasked tokens"):
        policy_loss(inputs, LossOptions.build("grpo", validation="immediate"), logps=probabilities)
    out = policy_loss(inputs, LossOptions.build("grpo", validation="deferred"), logps=probabilities)
    assert torch.isnan(out.loss)
    # the next call reads the queue, even one that validates its own values now
    with pytest.raises(ValueError, match=r"^logps has values above 0 .*found on the device in an earlier policy_loss"):
        policy_loss(inputs, LossOptions.build("grpo", validation="immediate"), logps=logps.detach())


SEQUENCE_KL = dict(importance_sampling_level="sequence", aggregation="seq_mean_token_mean", beta=0.05)


@pytest.mark.parametrize("options", [dict(), SEQUENCE_KL], ids=["token", "sequence_kl"])
def test_compiles_in_one_graph_and_equals_eager(options):
    """Under torch.compile(fullgraph=True) nothing is read on the host (no value checks there, as under deferred
    validation), so the route traces in one graph."""
    _, batch, logps, mask = case(seed=4)
    logps = logps.detach().float().requires_grad_()
    inputs = LossInputs(None, batch["advantages"], mask, batch["old_logps"],
                        ref_logps=batch["ref_logps"] if options.get("beta") else None)
    loss_options = LossOptions.build("dgpo", **options)

    def loss(leaf):
        return policy_loss(inputs, loss_options, logps=leaf, token_scales=mask / 10.0).loss

    torch._dynamo.reset()
    eager, compiled = loss(logps), torch.compile(loss, fullgraph=True, backend="aot_eager")(logps)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(compiled, logps)[0], torch.autograd.grad(eager, logps)[0],
                               rtol=1e-6, atol=1e-7)
