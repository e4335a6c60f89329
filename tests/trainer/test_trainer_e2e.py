"""Short real training runs of DGPOTrainer on a tiny model built in-process (CPU, generation by transformers)."""

from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("trl")

from trainer_fixtures import build_model_dir, build_tokenizer, length_reward, prompt_dataset  # noqa: E402


# The tests share one saved model (model_dir): they run on one xdist worker.
pytestmark = [pytest.mark.xdist_group("trainer_e2e"), pytest.mark.early]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny-e2e"), seed=1)


def train(model_dir, output_dir, max_steps=3, resume=None, save_steps=None, **config):
    from dgpo_ops.trainer import DGPOConfig, DGPOTrainer

    config.setdefault("bf16", False)
    args = DGPOConfig(output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, use_cpu=True, report_to=[], logging_steps=1,
                      max_steps=max_steps, num_iterations=2, learning_rate=1e-3, seed=0,
                      save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                      disable_tqdm=True, **config)
    trainer = DGPOTrainer(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                          processing_class=build_tokenizer())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize(
    "config",
    [dict(policy_loss="dgpo"), dict(policy_loss="dcpo", advantage_estimator="dcpo"),
     dict(policy_loss="dispo", fused="logits"), dict(policy_loss="sapo", sapo_gate="erf"),
     # verl's losses: a penalty (dro), a sequence statistic (geo_mean), the batch-level selections
     dict(policy_loss="dro", dro_beta=0.1), dict(policy_loss="geo_mean", fused="logits"),
     dict(policy_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-1.0, clip_cov_ub=1.0),
     dict(policy_loss="kl_cov", kl_cov_ratio=0.2)],
    ids=["dgpo", "dcpo", "dispo-logits", "sapo-erf", "dro", "geo_mean-logits", "clip_cov", "kl_cov"],
)
def test_three_steps_log_finite_metrics(config, model_dir, tmp_path):
    trainer = train(model_dir, tmp_path, **config)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        for key in ("loss", "entropy", "eur", "ratio_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
                    "clip_ratio/region_mean", "clip_ratio/lp_mean", "clip_ratio/hn_mean", "clip_ratio/dual_mean"):
            assert key in entry and math.isfinite(entry[key]), (key, entry)
    # num_iterations=2: the second pass over a batch sees ratios that moved away from 1.
    assert any(entry["ratio_mean"] != 1.0 for entry in logs)


def test_dcpo_statistics_survive_save_and_resume(model_dir, tmp_path):
    first = train(model_dir, tmp_path / "run", max_steps=2, save_steps=2, policy_loss="dcpo",
                  advantage_estimator="dcpo")
    checkpoint = tmp_path / "run" / "checkpoint-2"
    saved = json.loads((checkpoint / "dcpo_advantage_state.json").read_text())
    assert saved == first.smooth_advantages.state_dict() and len(saved) > 0
    resumed = train(model_dir, tmp_path / "run", max_steps=3, resume=str(checkpoint), policy_loss="dcpo",
                    advantage_estimator="dcpo")
    state = resumed.smooth_advantages.state_dict()
    # Every prompt seen before the checkpoint is still there, with at least as many participations.
    for key, (count, _, _, participations) in saved.items():
        assert key in state and state[key][0] >= count and state[key][3] >= participations
    assert sum(v[3] for v in state.values()) > sum(v[3] for v in saved.values())
    assert os.path.exists(checkpoint)


def test_peft_lora_trains_only_the_adapters(model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    import torch
    from dgpo_ops.trainer import DGPOConfig, DGPOTrainer

    args = DGPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, bf16=False, use_cpu=True, report_to=[], logging_steps=1, max_steps=2,
                      learning_rate=1e-2, save_strategy="no", disable_tqdm=True, policy_loss="dgpo")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = DGPOTrainer(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                          processing_class=build_tokenizer(), peft_config=lora)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


def test_two_processes_share_dcpo_statistics(model_dir, tmp_path):
    # torchrun with the gloo backend on CPU: rewards and prompt keys are gathered, so both ranks
    # hold the same statistics, covering both ranks' prompts.
    import shutil
    import subprocess

    torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch"
    script = os.path.join(os.path.dirname(__file__), "multiprocess_train.py")
    # --standalone: a free port of its own, not torchrun's fixed 29500, which another run may hold at the same time
    result = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", script, model_dir, str(tmp_path)],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world"] == 2
    assert ranks[0]["dcpo"] == ranks[1]["dcpo"] and len(ranks[0]["dcpo"]) == 2
    assert ranks[0]["losses"] == ranks[1]["losses"] and all(math.isfinite(v) for v in ranks[0]["losses"])


@pytest.mark.parametrize("fused", ["linear", "logits"])
def test_bf16_autocast_keeps_fresh_batches_on_policy(model_dir, tmp_path, fused):
    # bf16 autocast over fp32 weights (the trainer's bf16 runs): the old-policy log-probs come from the
    # same op under the same autocast as the loss, so the first step on each fresh generation batch
    # has ratios of exactly 1; the second step on it (num_iterations=2) has moved.
    trainer = train(model_dir, tmp_path, max_steps=2, policy_loss="dgpo", fused=fused, bf16=True)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[0]["ratio_mean"] == 1.0 and logs[0]["clip_ratio/region_mean"] == 0.0, logs[0]
    assert logs[1]["ratio_mean"] != 1.0


class NaNGradientOnce:
    """A hook that makes one parameter's gradient NaN for the first ``times`` backward passes."""

    def __init__(self, times):
        self.times = times

    def __call__(self, grad):
        if self.times > 0:
            self.times -= 1
            return grad * float("nan")
        return grad


def _first_hooked(trainer):
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if "layers.0.mlp" in n)
    return name, param


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"], ids=["on-device", "host-read"])
def test_a_nonfinite_gradient_skips_the_step_and_training_goes_on(model_dir, tmp_path, monkeypatch, optim):
    import torch
    from dgpo_ops.trainer import gradient_guard
    from dgpo_ops.trainer import trainer as trainer_module

    warnings = []
    monkeypatch.setattr(gradient_guard.logger, "warning", lambda msg, *a, **k: warnings.append(msg))
    original_train = trainer_module.DGPOTrainer.train
    state = {}

    def train_with_hook(self, *args, **kwargs):
        name, param = _first_hooked(self)
        state["name"], state["before"] = name, {n: p.detach().clone() for n, p in self.model.named_parameters()}
        param.register_hook(NaNGradientOnce(times=1))  # the first backward: optimizer step 1
        return original_train(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.DGPOTrainer, "train", train_with_hook)
    trainer = train(model_dir, tmp_path, max_steps=3, optim=optim)
    assert (gradient_guard.fused_adam(trainer.optimizer) is not None) == (optim == "adamw_torch_fused")
    assert trainer.skipped_steps == [1]
    # The NaN spreads backward from the hooked layer: the warning names the first parameter it reached.
    names = [n for n, _ in trainer.model.named_parameters()]
    assert len(warnings) == 1 and "step 1 skipped: non-finite gradient, first in " in warnings[0], warnings
    assert warnings[0].split("first in ")[1].split(" ")[0] in names[:names.index(state["name"]) + 1]
    for name, param in trainer.model.named_parameters():
        assert torch.isfinite(param).all(), name
    assert any(not torch.equal(p.detach(), state["before"][n]) for n, p in trainer.model.named_parameters())


def test_consecutive_nonfinite_steps_stop_the_run(model_dir, tmp_path, monkeypatch):
    from dgpo_ops.trainer import trainer as trainer_module

    original_train = trainer_module.DGPOTrainer.train

    def train_with_hook(self, *args, **kwargs):
        _first_hooked(self)[1].register_hook(NaNGradientOnce(times=10**6))
        return original_train(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.DGPOTrainer, "train", train_with_hook)
    with pytest.raises(RuntimeError, match="2 consecutive optimizer steps had non-finite gradients"):
        train(model_dir, tmp_path, max_steps=4, max_nonfinite_steps=2)


def test_skipped_step_leaves_parameters_and_moments_unchanged(model_dir, tmp_path, monkeypatch):
    import torch
    from dgpo_ops.trainer import trainer as trainer_module

    original_clip = trainer_module.DGPOTrainer._clip_grad_norm
    seen = {}

    def clip_grad_norm(self, model):  # runs first in each optimizer step, before the guard's check
        if self.state.global_step == 1:  # optimizer step 2: poison it, and remember the state before it
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            seen["params"] = [p.detach().clone() for p in model.parameters()]
            seen["moments"] = [s["exp_avg"].clone() for s in self.optimizer.optimizer.state.values()]
        elif self.state.global_step == 2:
            seen["params_after"] = [p.detach().clone() for p in model.parameters()]
            seen["moments_after"] = [s["exp_avg"].clone() for s in self.optimizer.optimizer.state.values()]
        return original_clip(self, model)

    monkeypatch.setattr(trainer_module.DGPOTrainer, "_clip_grad_norm", clip_grad_norm)
    trainer = train(model_dir, tmp_path, max_steps=3)
    assert trainer.skipped_steps == [2]
    for before, after in zip(seen["params"] + seen["moments"], seen["params_after"] + seen["moments_after"]):
        assert torch.equal(before, after)


def test_logits_on_chip_on_the_cpu_fails_when_the_trainer_is_made(model_dir, tmp_path):
    # The CPU path runs the torch twins, not the on-chip Triton kernels: say so before training starts.
    with pytest.raises(ValueError, match="fused_logits_on_chip=True runs Triton kernels"):
        train(model_dir, tmp_path, max_steps=1, fused_logits_on_chip=True)
