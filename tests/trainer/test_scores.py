"""Each response's score in ``DGPOTrainer`` (trainer/scores.py): TRL's weighted sum of the rewards, carried beside
the advantages where the loss reads it, and read by the loss as the op reads its ``scores`` (topr's split, the
positive-example NLL)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from trainer_fixtures import (  # noqa: E402
    build_model_dir,
    build_tokenizer,
    first_update_batch,
    length_reward,
    make_trainer,
    prompt_dataset,
)

pytestmark = pytest.mark.xdist_group("trainer_scores")
SCORES = torch.tensor([-1.0, 2.0, 0.5, 1.0])  # first_update_batch's advantages are (1.2, -0.7, 0.4, -1.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


def parity_reward(prompts, completions, **kwargs):
    return [float(len(c) % 2) - 0.5 for c in completions]


@pytest.mark.parametrize("config", [dict(policy_loss="topr"), dict(policy_loss="grpo", positive_nll_coef=0.1),
                                    dict(policy_loss="grpo")])
def test_scores_are_trls_weighted_rewards(config, model_dir, tmp_path):
    from dgpo_ops.trainer import DGPOConfig, DGPOTrainer

    args = DGPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, use_cpu=True, bf16=False, report_to=[], reward_weights=[0.5, 2.0],
                      **config)
    tokenizer = build_tokenizer()
    trainer = DGPOTrainer(model=model_dir, reward_funcs=[length_reward, parity_reward], args=args,
                          train_dataset=prompt_dataset(), processing_class=tokenizer)
    rows = [prompt_dataset()[0]] * 4
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions(rows)
    if config == dict(policy_loss="grpo"):  # nothing reads them: the batch is TRL's
        assert "scores" not in output
        return
    completions = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                   for ids, mask in zip(output["completion_ids"], output["completion_mask"])]
    expected = (0.5 * torch.tensor(length_reward(None, completions))
                + 2.0 * torch.tensor(parity_reward(None, completions)))
    torch.testing.assert_close(output["scores"], expected)
    assert output["scores"].shape == output["advantages"].shape


@pytest.mark.parametrize("fused", ["linear", "logits"])
@pytest.mark.parametrize("config", [dict(policy_loss="topr"), dict(policy_loss="grpo", positive_nll_coef=0.3)])
def test_the_loss_reads_the_scores_as_the_op_does(config, fused, model_dir, tmp_path):
    from dgpo_ops import reference_loss
    from dgpo_ops.trainer import DGPOConfig, DGPOTrainer

    trainer = make_trainer(DGPOTrainer, DGPOConfig, model_dir, tmp_path, fused=fused, **config)
    inputs = first_update_batch(trainer)
    inputs["scores"] = SCORES
    loss = trainer._compute_loss(trainer.model, inputs)
    P = inputs["prompt_ids"].size(1)
    mask = inputs["completion_mask"]
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                               attention_mask=torch.cat([inputs["prompt_mask"], mask], 1)).logits[:, P - 1:-1]
    # TRL's default loss_type (dapo): the generation batch's tokens per accumulation window, here 2 x this batch's
    normalizer = inputs["num_items_in_batch"].float() * trainer.current_gradient_accumulation_steps \
        / trainer.args.steps_per_generation
    params = {k: v for k, v in config.items() if k != "policy_loss"}
    expected = reference_loss(logits.float(), inputs["completion_ids"].masked_fill(mask == 0, -100),
                              inputs["advantages"], mask.bool(), inputs["old_per_token_logps"],
                              method=config["policy_loss"], scores=SCORES, loss_normalizer=normalizer,
                              **params).loss
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-7)
    # the scores matter: without them topr splits by the advantage and the NLL is refused
    del inputs["scores"]
    if config["policy_loss"] == "topr":
        assert not torch.allclose(trainer._compute_loss(trainer.model, inputs).detach(), expected)
    else:
        with pytest.raises(ValueError, match="scores"):
            trainer._compute_loss(trainer.model, inputs)
