"""DGPOTrainer's loss and gradients against GRPOTrainer's on the same batch, for every loss TRL also has."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

from trainer_fixtures import build_model_dir, build_tokenizer, length_reward, prompt_dataset  # noqa: E402

# TRL loss_type -> (DGPOConfig additions, GRPOConfig additions)
CASES = {
    "grpo": (dict(policy_loss="grpo"), dict(loss_type="grpo")),
    "dapo": (dict(policy_loss="dapo"), dict(loss_type="dapo", epsilon_high=0.28)),
    "bnpo": (dict(policy_loss="grpo"), dict(loss_type="bnpo")),
    "dr_grpo": (dict(policy_loss="grpo"), dict(loss_type="dr_grpo")),
    "cispo": (dict(policy_loss="cispo"), dict(loss_type="cispo", epsilon_high=5.0)),
    "sapo": (dict(policy_loss="sapo"), dict(loss_type="sapo")),
    "grpo_kl_gspo": (dict(policy_loss="grpo"), dict(loss_type="grpo", beta=0.05, importance_sampling_level="sequence")),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


def make_trainer(cls, config_cls, model_dir, tmp_path, **overrides):
    args = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, bf16=False, use_cpu=True, report_to=[], logging_steps=1,
                      gradient_accumulation_steps=2, **overrides)
    trainer = cls(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                  processing_class=build_tokenizer())
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.train()
    return trainer


def batch(trainer, beta):
    g = torch.Generator().manual_seed(1)
    B, P, C = 4, 5, 8
    vocab = trainer.model.config.vocab_size
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 5:] = 0
    completion_mask[3, 2:] = 0
    inputs = {
        "prompt_ids": torch.randint(3, vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (B, C), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.2, -0.7, 0.4, -1.5]),
        "num_items_in_batch": completion_mask.sum() * 2,
    }
    with torch.no_grad():
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], completion_mask], 1)
        logits = trainer.model(input_ids=input_ids, attention_mask=mask).logits[:, P - 1:-1]
        logps = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
    # Ratios spread over every region: exp(+-1) and beyond.
    inputs["old_per_token_logps"] = logps - torch.randn(B, C, generator=g) * 0.8
    if beta:
        inputs["ref_per_token_logps"] = logps + torch.randn(B, C, generator=g) * 0.3
    return inputs


def loss_and_grads(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("fused", ["linear", "logits"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_step_matches_grpo_trainer(case, fused, model_dir, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    from dgpo_ops.trainer import DGPOConfig, DGPOTrainer

    ours_extra, trl_extra = CASES[case]
    ours = make_trainer(DGPOTrainer, DGPOConfig, model_dir, tmp_path / "ours", fused=fused, **trl_extra,
                        **ours_extra)
    theirs = make_trainer(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **trl_extra)
    inputs = batch(theirs, trl_extra.get("beta", 0.0))
    loss_trl, grads_trl = loss_and_grads(theirs, inputs)
    loss_ours, grads_ours = loss_and_grads(ours, inputs)
    # fp32 on both sides; the two sum the same terms in different orders (tiles, chunking): 1e-5.
    torch.testing.assert_close(loss_ours, loss_trl, rtol=1e-5, atol=1e-7)
    assert grads_ours.keys() == grads_trl.keys()
    for name in grads_trl:
        torch.testing.assert_close(grads_ours[name], grads_trl[name], rtol=1e-4, atol=1e-7, msg=name)
    metrics = ours._metrics["train"]
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "eur",
                "ratio_mean", "clip_ratio/lp_mean", "clip_ratio/hn_mean", "clip_ratio/dual_mean"):
        assert key in metrics and all(v == v for v in metrics[key]), key
    if case.startswith("grpo") and case != "grpo_kl_gspo":
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert metrics[key][-1] == pytest.approx(theirs._metrics["train"][key][-1], abs=1e-6), key
