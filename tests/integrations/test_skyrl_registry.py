"""dgpo-ops inside SkyRL 0.3.0, against SkyRL's own code: its policy-loss registry, its losses, its trainer's
normalisation (``apply_loss_reduction_to_advantages_minibatch``, then a sum over each micro-batch), its off-policy
correction, its config and its entrypoint. SkyRL pins what the main suite cannot take, so these run in a venv of their
own (``.ci/skyrl_cpu.sh``, which fails if they are skipped there); the main suite skips this module."""

import importlib.util
import pathlib
import pickle
import subprocess
import sys
import typing

import pytest
import torch

if sys.version_info < (3, 12) and importlib.util.find_spec("skyrl") is not None:
    # skyrl 0.3.0 says Python >= 3.11, but its skyrl.tinker.types (imported by every skyrl.backends module) puts a
    # typing.TypedDict in a pydantic model, which pydantic refuses before 3.12; typing_extensions' is the one it
    # takes. Set in SkyRL's venv only (the main suite has no skyrl), before SkyRL is imported (the subprocess below
    # does the same).
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict
skyrl = pytest.importorskip("skyrl.backends.skyrl_train.utils.ppo_utils",
                            reason="SkyRL runs in its own venv: bash .ci/skyrl_cpu.sh")

from helpers import required_params, value_error_message
from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import compute_off_policy_correction
from skyrl.backends.skyrl_train.utils.ppo_utils import (
    PolicyLossRegistry,
    apply_loss_reduction_to_advantages_minibatch,
)
from skyrl.train.config import AlgorithmConfig as SkyRLAlgorithmConfig
from skyrl.train.config.config import ClipCovConfig, OffPolicyCorrectionConfig

from dgpo_ops import LossInputs, policy_loss, reference_loss
from dgpo_ops.integrations import skyrl as dgpo_skyrl
from dgpo_ops.integrations.skyrl_params import LOSS_TYPES, params_from_skyrl
from dgpo_ops.methods.catalog import POLICY_LOSSES, variants

B, T, MICRO = 8, 7, 4  # one mini-batch of 8 responses, 2 micro-batches of 4 (SkyRL's micro_train_batch_size_per_gpu)
PROMPTS = [(0, 2), (2, 4), (4, 6), (6, 8)]  # 2 responses per prompt, for prompt_mean
REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean")
CORRECTIONS = {
    "none": {},
    "token_tis": {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.5},
    "sequence_tis_geometric": {"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 1.5,
                               "sequence_mask_metric": "geometric", "geo_mask_low": 0.95, "geo_mask_high": 1.05},
    "masks": {"outlier_token_is_threshold_high": 3.0, "token_mask_is_threshold_low": 0.75,
              "token_mask_is_threshold_high": 1.4, "sequence_mask_metric": "product", "product_mask_low": 0.2,
              "product_mask_high": 5.0},
}


def rollout(seed: int = 0, drift: float = 0.5):
    """fp64 per-token log-probs (the loss's input), old and rollout log-probs ``drift`` nats apart (in standard
    deviations), one advantage per response, a ragged 0/1 loss mask with a fully masked response."""
    g = torch.Generator().manual_seed(seed)
    logp = -3.0 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.05
    old = (logp + drift * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    roll = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    advantages = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    mask[5] = 0.0
    return logp, old, roll, advantages, mask


def skyrl_advantages(advantages, mask, reduction):
    """The advantages as SkyRL's trainer hands them to the loss: divided by the reduction's mini-batch count."""
    return apply_loss_reduction_to_advantages_minibatch(advantages, mask, reduction, MICRO, T,
                                                        PROMPTS if reduction == "prompt_mean" else None)


def through_registry(loss_type, config, logp, old, advantages, mask, roll):
    """Each micro-batch's loss through SkyRL's registry, and d (their sum) / d log-probs: what the worker's
    backward over the micro-batches accumulates."""
    leaf = logp.clone().requires_grad_(True)
    fn = PolicyLossRegistry.get(loss_type)
    losses, metrics = [], []
    for rows in (slice(0, MICRO), slice(MICRO, B)):
        loss, m = fn(leaf[rows], old[rows], advantages[rows], config=config, loss_mask=mask[rows],
                     rollout_logprobs=None if roll is None else roll[rows])
        losses.append(loss)
        metrics.append(m)
    torch.stack(losses).sum().backward()
    return torch.stack(losses).detach(), leaf.grad, metrics


def test_every_method_is_registered_beside_skyrls_own():
    available = PolicyLossRegistry.list_available()
    assert set(LOSS_TYPES) <= set(available)
    assert {f"dgpo_ops.{name}" for name in POLICY_LOSSES} == set(LOSS_TYPES)
    assert {"regular", "dual_clip", "gspo", "cispo", "sapo", "clip_cov", "kl_cov", "rollout_is", "dppo"} <= set(
        available)
    assert dgpo_skyrl.register() == list(LOSS_TYPES)  # again: ours stay, nothing raises


def test_a_name_skyrl_gives_another_function_is_refused():
    name = "dgpo_ops.grpo"
    ours = PolicyLossRegistry._functions.pop(name)
    try:
        PolicyLossRegistry.register(name, lambda *args, **kwargs: None)
        with pytest.raises(RuntimeError, match="will not replace it"):
            dgpo_skyrl.register()
    finally:
        PolicyLossRegistry._functions[name] = ours


# Methods whose loss has a term not proportional to the advantage (a penalty summed per token, as SkyRL's own
# kl_cov sums its KL term) or a selection by the advantage's scale (clip_cov's covariance bounds): with SkyRL's
# pre-scaled advantages they are not the method under a token-mean aggregation.
NOT_LINEAR_IN_ADVANTAGE = {"dro", "prime_dppo", "prime_ipo", "kl_cov", "clip_cov"}


@pytest.mark.parametrize("variant", variants() + [(alias, {}) for alias in POLICY_LOSSES if alias not in
                                                  {m for m, _ in variants()}],
                         ids=lambda v: v[0] + "".join(f"-{k}={v}" for k, v in v[1].items()))
def test_every_method_runs_through_skyrls_registry(variant):
    """Every method and alias through SkyRL's registry with the trainer's token_mean normalisation: each
    micro-batch's loss and the gradient are ``reference_loss``'s on SkyRL's pre-scaled advantages summed per token;
    for a method linear in the advantage they are also the method under token_mean over the whole mini-batch."""
    name, params = variant
    logp, old, roll, advantages, mask = rollout(seed=1)
    config = dgpo_skyrl.AlgorithmConfig(policy_loss_type=f"dgpo_ops.{name}",
                                        method_params={**required_params(name), **params})
    scaled = skyrl_advantages(advantages, mask, "token_mean")
    needs_rollout = name == "rollout_is"  # its ratio is against the rollout's log-probs
    losses, grad, _ = through_registry(f"dgpo_ops.{name}", config, logp, old, scaled, mask,
                                       roll if needs_rollout else None)
    behaviour = roll if needs_rollout else old
    method_params = params_from_skyrl(name, config)
    # the oracle: the package's reference (log_softmax of logits whose target column holds the log-prob)
    logits = torch.zeros(B, T, 2, dtype=torch.float64)
    logits[..., 0] = logp
    logits[..., 1] = torch.log1p(-logp.exp())
    logits.requires_grad_(True)
    targets = torch.zeros(B, T, dtype=torch.long)
    expected = [reference_loss(logits[rows], targets[rows], scaled[rows], mask[rows].bool(), behaviour[rows],
                               method=name, aggregation="token_sum", **method_params).loss
                for rows in (slice(0, MICRO), slice(MICRO, B))]
    torch.testing.assert_close(losses, torch.stack(expected).detach(), rtol=1e-9, atol=1e-12)
    (logits_grad,) = torch.autograd.grad(torch.stack(expected).sum(), logits)
    # d/d logp through the two-column log_softmax: the gradient reaches logp through column 0 and its complement
    p = logp.exp()
    torch.testing.assert_close(grad, logits_grad[..., 0] - logits_grad[..., 1] * p / (1 - p), rtol=1e-7,
                               atol=1e-12)
    if name in NOT_LINEAR_IN_ADVANTAGE or name == "kimi15":
        return
    whole = reference_loss(logits.detach(), targets, advantages, mask.bool(), behaviour, method=name,
                           aggregation="token_mean", **method_params).loss
    torch.testing.assert_close(losses.sum(), whole, rtol=1e-9, atol=1e-12)


# test id -> SkyRL's policy_loss_type, ours, our AlgorithmConfig's own fields
SAME_LOSSES = {
    "regular": ("regular", "dgpo_ops.grpo", {}),
    "dual_clip": ("dual_clip", "dgpo_ops.grpo", {"method_params": {"dual_clip": 3.0}}),  # clip_ratio_c's 3.0
    "gspo": ("gspo", "dgpo_ops.grpo", {"importance_sampling_level": "sequence"}),
    "cispo": ("cispo", "dgpo_ops.cispo", {}),  # SkyRL's cispo.cispo_eps_clip_low/high
    "sapo": ("sapo", "dgpo_ops.sapo", {}),
    "rollout_is": ("rollout_is", "dgpo_ops.rollout_is", {}),
    # SkyRL's dppo (binary_tv): -A r on the kept tokens, prime-rl's loss without its KL term
    "dppo": ("dppo", "dgpo_ops.prime_dppo", {"method_params": {"kl_tau": 0.0}}),
    "clip_cov": ("clip_cov", "dgpo_ops.clip_cov", {}),
    "kl_cov": ("kl_cov", "dgpo_ops.kl_cov", {}),
}
# SkyRL's clip_cov and kl_cov apply no off-policy correction (ours do: docs/integrations.md); GSPO at sequence level
# differentiates the sequence ratio, which is SkyRL's GSPO-token gradient unless the correction's weights vary within
# a response (token TIS, the per-token mask): that is refused (test_gspo_with_per_token_weights_is_refused).
UNCORRECTED = {"clip_cov", "kl_cov"}
PER_TOKEN_WEIGHTS = {"token_tis", "masks"}
CASES = [(loss, reduction, correction) for loss in SAME_LOSSES for reduction in REDUCTIONS for correction in CORRECTIONS
         if not (loss in UNCORRECTED and correction != "none")
         and not (loss == "gspo" and correction in PER_TOKEN_WEIGHTS)]


def configs(loss, reduction, correction):
    theirs, ours, own = SAME_LOSSES[loss]
    shared = {"loss_reduction": reduction, "off_policy_correction": OffPolicyCorrectionConfig(**CORRECTIONS[correction]),
              # a covariance bound at 0 with a ratio that cuts every candidate: SkyRL's random draw is then moot
              "clip_cov": ClipCovConfig(clip_ratio=1.0, clip_cov_lb=0.0, clip_cov_ub=5.0), "max_seq_len": T}
    return (theirs, SkyRLAlgorithmConfig(policy_loss_type=theirs, **shared),
            ours, dgpo_skyrl.AlgorithmConfig(policy_loss_type=ours, **shared, **own))


@pytest.mark.parametrize("loss,reduction,correction", CASES)
def test_skyrls_own_losses(loss, reduction, correction):
    """SkyRL's loss and ours through its registry, on the same micro-batches of the same mini-batch after the
    trainer's normalisation: every micro-batch's loss and d loss / d log-probs; SkyRL's clip_ratio for its PPO
    losses."""
    logp, old, roll, advantages, mask = rollout(seed=2)
    scaled = skyrl_advantages(advantages, mask, reduction)
    theirs, their_config, ours, our_config = configs(loss, reduction, correction)
    their_losses, their_grad, their_metrics = through_registry(theirs, their_config, logp, old, scaled, mask, roll)
    our_losses, our_grad, our_metrics = through_registry(ours, our_config, logp, old, scaled, mask, roll)
    assert their_grad.abs().sum() > 0
    torch.testing.assert_close(our_losses, their_losses, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-8)
    if loss in ("regular", "dual_clip", "gspo"):
        for mine, skyrls in zip(our_metrics, their_metrics):
            assert mine["clip_ratio"] == pytest.approx(skyrls["clip_ratio"], abs=1e-6)


@pytest.mark.parametrize("correction", sorted(PER_TOKEN_WEIGHTS))
def test_gspo_with_per_token_weights_is_refused(correction):
    """SkyRL's gspo is GSPO-token: a per-token weight (token TIS, the per-token mask) scales each token's own
    gradient, which GSPO's differentiated sequence ratio would spread over the response; dgpo-ops refuses the
    combination (SkyRLCorrection.check_options), naming the correction and the option."""
    logp, old, roll, advantages, mask = rollout(seed=2)
    _, _, ours, our_config = configs("gspo", "sequence_mean", correction)
    message = value_error_message(lambda: through_registry(ours, our_config, logp, old, advantages, mask, roll))
    assert "trainer.algorithm.off_policy_correction" in message and "importance_sampling_level" in message


@pytest.mark.parametrize("dppo_type,ours", [("binary_tv", "dgpo_ops.dppo_tv"), ("binary_kl", "dgpo_ops.dppo_kl")])
@pytest.mark.parametrize("correction", ["none", "token_tis"])
def test_dppo_gradient_is_skyrls(dppo_type, ours, correction):
    """verl's dppo_tv / dppo_kl (a capped weight times the log-prob) with a cap no ratio reaches: SkyRL's dppo's
    gradient (its value is -A r, ours -A w l), for both divergences, ratio against the rollout's log-probs."""
    from skyrl.train.config.config import DPPOConfig

    logp, old, roll, advantages, mask = rollout(seed=3, drift=0.8)
    scaled = skyrl_advantages(advantages, mask, "token_mean")
    dppo = DPPOConfig(dppo_type=dppo_type, delta_low=0.05, delta_high=0.08)
    shared = {"off_policy_correction": OffPolicyCorrectionConfig(**CORRECTIONS[correction]), "dppo": dppo}
    their_config = SkyRLAlgorithmConfig(policy_loss_type="dppo", **shared)
    our_config = dgpo_skyrl.AlgorithmConfig(policy_loss_type=ours, method_params={"is_cap": 1e6}, **shared)
    _, their_grad, their_metrics = through_registry("dppo", their_config, logp, old, scaled, mask, roll)
    _, our_grad, _ = through_registry(ours, our_config, logp, old, scaled, mask, roll)
    assert 0 < their_metrics[0]["clip_ratio"] < 1  # some tokens dropped, some kept
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("correction", [c for c in CORRECTIONS if c != "none"])
def test_the_corrections_reject_some_tokens_and_keep_others(correction):
    """The presets above exercise SkyRL's correction: its cap truncates some weights and not others, its rejections
    (where a preset has any) drop some scored tokens and keep others."""
    _, old, roll, _, mask = rollout(seed=2)
    config = OffPolicyCorrectionConfig(**CORRECTIONS[correction])
    weights, _, new_mask = compute_off_policy_correction(old, roll, mask, config)
    scored = mask > 0
    if weights is not None:
        cap = config.token_tis_ratio_clip_high if correction == "token_tis" else config.sequence_tis_ratio_clip_high
        capped = (weights.expand(mask.shape) == cap) & scored
        assert capped.any() and (~capped & scored).any()
    if correction != "token_tis":
        rejected = (new_mask == 0) & scored
        assert rejected.any() and (~rejected & scored).any()


def test_config_reads_method_params_from_the_command_line():
    """SkyRL's own parser builds this module's config: method_params and importance_sampling_level from the
    command line, a misspelt parameter refused naming the field, SkyRL's override_entrypoint argument left out."""
    args = ["trainer.algorithm.policy_loss_type=dgpo_ops.dgpo", "trainer.algorithm.method_params.n=2",
            "trainer.algorithm.method_params.m=3", "trainer.algorithm.importance_sampling_level=sequence",
            "trainer.algorithm.eps_clip_high=0.28"]
    cfg = dgpo_skyrl.SkyRLTrainConfig.from_cli_overrides(args)
    algorithm = cfg.trainer.algorithm
    assert isinstance(algorithm, dgpo_skyrl.AlgorithmConfig)
    options = dgpo_skyrl.loss_options("dgpo_ops.dgpo", algorithm)
    assert (options.method.n, options.method.m, options.method.eps_high) == (2, 3, 0.28)
    assert options.importance_sampling_level == "sequence"
    message = value_error_message(lambda: dgpo_skyrl.SkyRLTrainConfig.from_cli_overrides(
        ["trainer.algorithm.policy_loss_type=dgpo_ops.dgpo", "trainer.algorithm.method_params.nn=2"]))
    assert "trainer.algorithm.method_params.nn" in message and "n, m" in message
    message = value_error_message(lambda: dgpo_skyrl.SkyRLTrainConfig.from_cli_overrides(
        ["trainer.algorithm.policy_loss_type=regular", "trainer.algorithm.method_params.n=2"]))
    assert "read by the losses dgpo_ops" in message
    # the config and the registered functions cross a process boundary by reference (Ray pickles both)
    assert pickle.loads(pickle.dumps(algorithm)).method_params == {"n": 2, "m": 3}


def test_bad_input_is_named():
    logp, old, roll, advantages, mask = rollout()
    fn = PolicyLossRegistry.get("dgpo_ops.grpo")

    def message(config, **changes):
        kwargs = {"loss_mask": mask, "rollout_logprobs": None, **changes}
        return value_error_message(lambda: fn(logp, old, advantages, config, **kwargs))

    assert "trainer.algorithm.eps_clip_low" in message(dgpo_skyrl.AlgorithmConfig(eps_clip_low=1.5))
    assert "loss_mask must have shape" in message(dgpo_skyrl.AlgorithmConfig(), loss_mask=mask[:, :-1])
    assert "needs SkyRL's algorithm config" in message(None)
    bad = dgpo_skyrl.AlgorithmConfig(off_policy_correction=OffPolicyCorrectionConfig(token_mask_is_threshold_low=0.5))
    assert "token_mask_is_threshold_high" in message(bad, rollout_logprobs=roll)
    assert "rollout_logprobs" in value_error_message(
        lambda: PolicyLossRegistry.get("dgpo_ops.rollout_is")(logp, old, advantages, dgpo_skyrl.AlgorithmConfig(),
                                                              loss_mask=mask))


def test_a_worker_that_unpickles_a_loss_gets_every_loss():
    """A Ray worker reads the registry from SkyRL's actor, where each function is pickled: unpickling ours in a
    fresh process imports this module, which registers every dgpo_ops.* loss there, and the loss runs."""
    blob = skyrl.cloudpickle.dumps(PolicyLossRegistry.get("dgpo_ops.dgpo"))
    code = (
        "import sys, typing, typing_extensions, torch\n"
        "typing.TypedDict = typing_extensions.TypedDict  # as this module does, for Python 3.11\n"
        "from skyrl.backends.skyrl_train.utils import ppo_utils\n"
        "assert 'dgpo_ops.dgpo' not in ppo_utils.PolicyLossRegistry.list_available()\n"
        "fn = ppo_utils.cloudpickle.loads(sys.stdin.buffer.read())\n"
        "names = [n for n in ppo_utils.PolicyLossRegistry.list_available() if n.startswith('dgpo_ops.')]\n"
        "from skyrl.train.config import AlgorithmConfig\n"
        "logp = -torch.rand(2, 3) - 0.1\n"
        "loss, metrics = fn(logp, logp - 0.1, torch.ones(2, 3), AlgorithmConfig(), loss_mask=torch.ones(2, 3))\n"
        "print(len(names), type(fn).__name__, 'eur' in ' '.join(metrics))\n")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, check=True, timeout=300)
    assert out.stdout.decode().split() == [str(len(LOSS_TYPES)), "SkyRLPolicyLoss", "True"]


def test_the_docs_snippet_runs_as_written():
    """docs/integrations.md's Python block in "Training with SkyRL", run as it is written there."""
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = page[page.index("## Training with SkyRL"):]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/integrations.md", "exec"), {})  # noqa: S102 (the documented block, as written)


def test_main_is_skyrls_with_this_config(monkeypatch):
    """``python -m dgpo_ops.integrations.skyrl`` (or SkyRL's main_base with trainer.override_entrypoint): SkyRL's own
    validate_cfg accepts the config with a dgpo_ops.* loss and method_params, and SkyRL's training entrypoint gets it;
    Ray and the trainer (which need GPUs) are stand-ins here."""
    import types

    import ray
    import skyrl.train.utils as skyrl_utils

    steps = []
    main_base = types.ModuleType("skyrl.train.entrypoints.main_base")  # the real one imports the whole trainer
    main_base.skyrl_entrypoint = types.SimpleNamespace(remote=lambda cfg: ("entrypoint", cfg))
    monkeypatch.setitem(sys.modules, "skyrl.train.entrypoints.main_base", main_base)
    monkeypatch.setattr(skyrl_utils, "initialize_ray", lambda cfg: steps.append("initialize_ray"))
    monkeypatch.setattr(ray, "get", lambda ref: steps.append(ref))
    dgpo_skyrl.main(["trainer.override_entrypoint=dgpo_ops.integrations.skyrl", "trainer.logger=console",
                     "trainer.policy.model.path=Qwen/Qwen2.5-0.5B", "trainer.algorithm.policy_loss_type=dgpo_ops.dgpo",
                     "trainer.algorithm.method_params.n=2"])
    assert steps[0] == "initialize_ray" and steps[1][0] == "entrypoint"
    assert steps[1][1].trainer.algorithm.method_params == {"n": 2}
    with pytest.raises(AssertionError, match="invalid policy_loss_type"):  # SkyRL's check, our names in its list
        dgpo_skyrl.main(["trainer.logger=console", "trainer.policy.model.path=Qwen/Qwen2.5-0.5B",
                         "trainer.algorithm.policy_loss_type=dgpo_ops.nope"])


RESPONSE_MASKS = {"outlier_token_is_threshold_high": 1.6, "sequence_mask_metric": "product", "product_mask_low": 0.5,
                  "product_mask_high": 2.0}  # rejects whole responses only


@pytest.mark.parametrize("name,level,correction", [("geo_mean", "token", CORRECTIONS["masks"]),
                                                   ("vespo", "token", CORRECTIONS["masks"]),
                                                   ("grpo", "sequence", RESPONSE_MASKS)])
def test_a_rejection_drops_the_tokens_term_and_leaves_the_sequence_statistic(name, level, correction):
    """SkyRL's rejections (its outlier, per-token and product masks, no TIS; GSPO's ratio takes per-response ones
    only) take a token's term out of the sum after the loss: a method evaluated at a statistic of its response's
    log-ratios keeps the token in that statistic. The oracle: the objective without a correction, summed over SkyRL's
    own corrected loss_mask."""
    from dgpo_ops.integrations.skyrl_params import loss_options

    logp, old, roll, advantages, mask = rollout(seed=2)
    scaled = skyrl_advantages(advantages, mask, "sequence_mean")
    config = dgpo_skyrl.AlgorithmConfig(policy_loss_type=f"dgpo_ops.{name}", importance_sampling_level=level,
                                        off_policy_correction=OffPolicyCorrectionConfig(**correction))
    losses, grad, _ = through_registry(f"dgpo_ops.{name}", config, logp, old, scaled, mask, roll)
    _, _, corrected_mask = compute_off_policy_correction(old, roll, mask, config.off_policy_correction)
    assert ((corrected_mask == 0) & (mask > 0)).any()
    leaf = logp.clone().requires_grad_(True)
    options = loss_options(f"dgpo_ops.{name}", config)
    expected = [policy_loss(LossInputs(None, scaled[rows], mask[rows] > 0, old[rows]), options,
                            logps=leaf[rows], token_scales=corrected_mask[rows]).loss
                for rows in (slice(0, MICRO), slice(MICRO, B))]
    torch.stack(expected).sum().backward()
    # geo_mean folds log(w + 1e-10) into its mean: the weight 1 of a kept token differs from no weight by 1e-10
    torch.testing.assert_close(losses, torch.stack(expected).detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-9, atol=1e-12)
