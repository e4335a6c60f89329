"""No host-device synchronisation and a small op budget per forward + backward, so a
training step never waits on the device for the loss.

Every aten op the fused ops dispatch is recorded by a ``TorchDispatchMode``. An op that reads a
device value on the host (``_local_scalar_dense``: ``.item()``, ``float()``, ``tolist()``;
``is_nonzero``: ``bool()``; ``nonzero``; ``masked_select``; boolean-mask ``index``; ``equal``)
would be a synchronisation on CUDA, so it fails the test wherever it runs. Triton launches are not
aten ops; under the interpreter they copy their arguments with aten ops, which the recorder does
not count (it pauses inside the interpreter's launch and counts the launch instead).
"""

from __future__ import annotations

import pytest
import torch
from helpers import ROUTE_VARIANTS, TOKEN_LEVEL_VARIANTS, config, variant_id
from torch.utils._python_dispatch import TorchDispatchMode

import dgpo_ops
from dgpo_ops import corrections
from dgpo_ops.core.metrics import METRIC_NAMES

SYNCING_OPS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.nonzero.default",
               "aten.masked_select.default", "aten.equal.default"}
OP_BUDGET = 13  # dispatched aten ops per forward + backward of a token-level method on Triton, metrics included


class AtenRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.syncs: list[str] = []
        self.launches = 0
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            name = str(func)
            self.ops.append(name)
            boolean_index = name.startswith("aten.index.") and any(
                torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []) if i is not None)
            if name in SYNCING_OPS or boolean_index:
                self.syncs.append(name)
        return func(*args, **kwargs)


@pytest.fixture
def recorder(monkeypatch):
    rec = AtenRecorder()
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def counted_launch(self, *args, **kwargs):
        rec.launches += 1
        rec._paused += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            rec._paused -= 1

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted_launch)
    return rec


def loss_inputs(B=2, T=8, V=50, seed=0, int_mask=False, ref_logps=False):
    """``ref_logps``: with reference log-probs, for a call with beta > 0."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    mask = torch.rand(B, T, generator=g) > 0.2
    inputs = dict(
        logits=logits,
        target_ids=torch.randint(0, V, (B, T), generator=g),
        advantages=torch.randn(B, generator=g),
        mask=mask.to(torch.int64) if int_mask else mask,
        old_logps=-torch.rand(B, T, generator=g) * 3,
    )
    reference = -torch.rand(B, T, generator=g) * 3
    return dict(inputs, ref_logps=reference) if ref_logps else inputs


def run_logits(inputs, **options):
    out = dgpo_ops.fused_dgpo_loss(**inputs, validation="deferred", **options)
    out.loss.backward()
    return out


def recorded(recorder, fn):
    fn()  # compile / fill caches outside the recording: the steady state is what a training loop runs
    recorder.ops.clear()
    recorder.syncs.clear()
    recorder.launches = 0
    with recorder:
        fn()
    dgpo_ops.raise_deferred_errors()  # clean inputs: nothing to raise
    return recorder


# The token-local route's representative: the launches and ops of the call are the route's; what a method
# adds on the host is its kernel parameters, checked for every method below.
TOKEN_LOCAL_REPRESENTATIVES = [variant for variant in TOKEN_LEVEL_VARIANTS if variant in ROUTE_VARIANTS]


def test_every_token_level_method_lowers_to_host_floats():
    """What a per-token method adds to the call on the host: its kernel parameters, Python floats copied to
    the device once per (config, device) (``kernel_params_on``), so no method reads a device value."""
    for variant in TOKEN_LEVEL_VARIANTS:
        values = config(variant).kernel_params()
        assert values and all(type(value) is float for value in values), (variant, values)


@pytest.mark.parametrize("variant", TOKEN_LOCAL_REPRESENTATIVES, ids=variant_id)
def test_triton_token_level_has_no_sync_and_stays_in_budget(recorder, variant):
    name, params = variant
    inputs = loss_inputs()
    rec = recorded(recorder, lambda: run_logits(inputs, method=name, backend="triton", **params))
    assert rec.syncs == [], rec.syncs
    assert len(rec.ops) <= OP_BUDGET, rec.ops
    assert rec.launches == 3, "row forward, prologue (which finalizes), row backward"


@pytest.mark.parametrize("options", [
    dict(beta=0.05, entropy_coef=0.01, temperature=0.7),
    dict(aggregation="seq_mean_token_mean", kl_ratio_correction=True, beta=0.1),
    dict(loss_normalizer="tensor"),
    dict(int_mask=True, rollout_weights=True, inplace=True),
], ids=["kl_entropy_temperature", "seq_mean_kl_ratio", "normalizer_tensor", "int_mask_weights_inplace"])
def test_triton_options_have_no_sync_and_stay_in_budget(recorder, options):
    options = dict(options)
    inputs = loss_inputs(int_mask=options.pop("int_mask", False), ref_logps=bool(options.get("beta")))
    if options.pop("rollout_weights", False):
        inputs["rollout_weights"] = torch.rand(2, 8) + 0.5
    if options.get("loss_normalizer") == "tensor":
        options["loss_normalizer"] = torch.tensor(11.0)
    if options.get("inplace"):
        leaf = inputs["logits"]
        fn = lambda: run_logits({**inputs, "logits": leaf * 1.0}, backend="triton", **options)  # noqa: E731
    else:
        fn = lambda: run_logits(inputs, backend="triton", **options)  # noqa: E731
    rec = recorded(recorder, fn)
    assert rec.syncs == [], rec.syncs
    # the inplace case adds the leaf's `* 1.0` and its backward: two ops that are the caller's
    assert len(rec.ops) <= OP_BUDGET + (3 if options.get("inplace") else 0), rec.ops


def test_reading_the_metrics_costs_one_op_each_and_no_sync(recorder):
    inputs = loss_inputs()
    holder = {}
    rec = recorded(recorder, lambda: holder.update(out=run_logits(inputs, backend="triton")))
    rec.ops.clear()
    with rec:
        values = [holder["out"].metrics[name] for name in holder["out"].metrics]
    assert len(values) == len(METRIC_NAMES)
    assert rec.syncs == [] and len(rec.ops) == len(values)


@pytest.mark.parametrize("level", ["token", "sequence", "vespo", "geo_mean", "clip_cov", "kl_cov", "topr"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_every_route_is_sync_free(recorder, backend, level):
    """Token level, GSPO's sequence ratio, the methods' own sequence statistics (vespo's and geo_mean's, with
    rollout weights folded in), the batch-level selections (clip_cov draws at random, kl_cov ranks: the
    counts stay on the device) and the responses' scores (topr's split, the positive-example NLL; their
    deferred check runs beside the prologue)."""
    inputs = loss_inputs(ref_logps=True)
    options = dict(aggregation="seq_mean_token_mean", entropy_coef=0.01, beta=0.02)
    if level == "topr":
        options.update(method="topr", scores=torch.tensor([1.0, -1.0]), positive_nll_coef=0.1)
    elif level in ("vespo", "geo_mean", "clip_cov", "kl_cov"):
        options.update(method=level, rollout_weights=torch.rand(inputs["target_ids"].shape) + 0.5)
        if level == "clip_cov":
            options.update(generator=torch.Generator().manual_seed(0), clip_cov_lb=-2.0, clip_cov_ub=2.0)
    else:
        options.update(importance_sampling_level=level)
    rec = recorded(recorder, lambda: run_logits(inputs, backend=backend, **options))
    assert rec.syncs == [], rec.syncs


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("backend", ["triton", "torch", "on_chip"])
def test_fused_linear_is_sync_free(recorder, backend, level):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 8, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    inputs = loss_inputs()
    inputs.pop("logits")
    on_chip = backend == "on_chip"
    options = dict(importance_sampling_level=level, aggregation="seq_mean_token_mean",
                   backend="triton" if on_chip else backend, logits_on_chip=on_chip,
                   validation="deferred", memory_budget=50 * 4 * 4, loss_normalizer=torch.tensor(3.0))

    def step():
        out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **inputs, **options)
        out.loss.backward()

    rec = recorded(recorder, step)
    assert rec.syncs == [], rec.syncs


@pytest.mark.parametrize("level", ["token", "sequence", "geo_mean", "clip_cov"])
def test_the_loss_from_logps_is_sync_free(recorder, level):
    """The log-prob route (the verl and SkyRL plugins' call) under deferred validation, with per-token scales."""
    inputs = loss_inputs()
    target = inputs["target_ids"]
    logps = torch.log_softmax(inputs["logits"], -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    logps = logps.detach().requires_grad_()
    mask = inputs["mask"].bool() & (target != -100)
    method, fields, generator = "grpo", {}, None
    if level == "sequence":
        fields = dict(importance_sampling_level="sequence")
    elif level == "clip_cov":  # a random selection: the counts stay on the device
        method, fields, generator = level, dict(clip_cov_lb=-2.0, clip_cov_ub=2.0), torch.Generator().manual_seed(0)
    elif level == "geo_mean":
        method = level
    options = dgpo_ops.LossOptions.build(method, validation="deferred", **fields)
    batch = dgpo_ops.LossInputs(None, inputs["advantages"], mask, inputs["old_logps"], generator=generator,
                                rollout_weights=torch.rand(mask.shape) + 0.5)

    def step():
        out = dgpo_ops.policy_loss(batch, options, logps=logps, token_scales=mask / mask.sum())
        out.loss.backward()

    rec = recorded(recorder, step)
    assert rec.syncs == [], rec.syncs


def test_the_recorder_catches_a_sync(recorder):
    # immediate validation reads values on the host: the same recorder must flag it
    inputs = loss_inputs()
    rec = recorded(recorder, lambda: dgpo_ops.fused_dgpo_loss(**inputs, validation="immediate").loss.backward())
    assert {"aten._local_scalar_dense.default", "aten.is_nonzero.default"} & set(rec.syncs), rec.syncs


CORRECTIONS = {
    "trl_sequence_mask": corrections.TrlCorrection("sequence_mask", 0.5, 3.0),
    "verl_is_rs": corrections.VerlCorrection(rollout_is="sequence", rollout_is_batch_normalize=True,
                                             rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2.0,1.0"),
    "openrlhf_seq_mask_tis": corrections.OpenRLHFCorrection("seq", "mask", is_correction_threshold=(0.5, 2.0)),
    "nemo_rl_seq_mask_tis": corrections.NemoRLCorrection("seq-mask-tis", 2.0, 0.5),
    "swift_sequence_truncate": corrections.SwiftCorrection("sequence_truncate"),
    "skyrl": corrections.SkyRLCorrection("sequence", sequence_mask_metric="geometric", geo_mask_low=0.5,
                                         geo_mask_high=2.0, outlier_token_is_threshold_high=10.0),
    "areal_m2po_sequence": corrections.ArealCorrection(level="sequence", agg="max", upper=3.0, m2_threshold=0.2),
}


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_rollout_corrections_are_sync_free(recorder, name):
    """The rollout-correction stage (M2PO's sort and suffix mean, verl's batch normalisation guard, the
    sequence reductions) reads nothing on the host. It runs before the op, the same for both kernel sets;
    the Triton kernels given rollout weights are sync-free in
    test_triton_options_have_no_sync_and_stay_in_budget."""
    inputs = loss_inputs()
    drift = torch.randn(inputs["old_logps"].shape, generator=torch.Generator().manual_seed(2))
    inputs["rollout_logps"] = (inputs["old_logps"] + drift).clamp(max=0)  # log-probs: <= 0
    rec = recorded(recorder, lambda: run_logits(inputs, backend="torch", method="grpo",
                                                rollout_correction=CORRECTIONS[name]))
    assert rec.syncs == [], rec.syncs
