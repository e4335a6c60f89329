"""DGPOTrainer with generation by vLLM colocated on CPU (the vllm-cpu build), through trainer/vllm_cpu.py.

Needs vllm-cpu, which pins an older transformers than the main environment has: `.ci/vllm_cpu.sh` builds a venv
with it and runs this file there. Elsewhere the vLLM tests skip; the server-mode refusal runs everywhere.

Two trainers (module scope, one per engine dtype; a vLLM engine starts in ~5-25 s) serve both vLLM tests:
- the weight sync is exact: after a sync, vLLM's prompt log-probs of a fixed sequence equal the HF model's, also
  after the HF weights change (noise, then an optimizer step) and are synced again, with tied embeddings;
- a 3-step DGPO run generates with vLLM, syncs before every generation and logs finite metrics, and vLLM's sampling
  log-probs equal the trainer's own at every step (TRL's `sampling/sampling_logp_difference/max`).
Measured on vllm-cpu 0.32: max |log-prob difference| after a sync <= 3e-6 with the float32 engine, <= 0.04 with
the default bfloat16 one; without the sync (or with a stale tied lm_head) 0.35 to 5.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("trl")

from trainer_fixtures import build_model_dir, build_tokenizer, length_reward, prompt_dataset

SEQUENCE = "what is 1 plus 9 ? the answer is 1 0 so boxed { 1 0 }"


def _vllm_cpu_or_skip():
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except ImportError as e:
        pytest.skip(f"vllm is not importable ({e}); .ci/vllm_cpu.sh runs these tests in a venv with vllm-cpu")
    if not current_platform.is_cpu():
        pytest.skip("vllm is not the CPU build (vllm-cpu): these tests cover the CPU weight sync")


def _config(output_dir, **overrides):
    from dgpo_ops.trainer import DGPOConfig

    values = {"output_dir": str(output_dir), "per_device_train_batch_size": 4, "num_generations": 4,
              "max_completion_length": 8, "bf16": False, "use_cpu": True, "report_to": [], "logging_steps": 1,
              "max_steps": 3, "learning_rate": 1e-2, "seed": 0, "save_strategy": "no", "disable_tqdm": True,
              "use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False}
    return DGPOConfig(**{**values, **overrides})


def test_server_mode_is_refused_on_cpu(tmp_path):
    from dgpo_ops.trainer import DGPOTrainer

    with pytest.raises(ValueError, match="vllm_mode='server' is not supported on a CPU device"):
        DGPOTrainer(model="unused", reward_funcs=length_reward, args=_config(tmp_path, vllm_mode="server"))


# vLLM runs a float32 checkpoint in bfloat16 unless told otherwise (dtype="auto" downcasts it, on CPU as on GPU,
# and TRL passes no dtype). "float32" pins the engine to the HF model's dtype, so agreement is checked at fp32
# rounding; "auto" is the engine a user gets, checked at bf16 rounding. Stale weights are off by >= 0.3 either way.
ENGINE_DTYPES = {"float32": 1e-4, "auto": 0.1}


@pytest.fixture(scope="module", params=list(ENGINE_DTYPES), ids=[f"engine-{d}" for d in ENGINE_DTYPES])
def trainer(request, tmp_path_factory):
    _vllm_cpu_or_skip()
    import functools

    from dgpo_ops.trainer import DGPOTrainer
    from trl.generation import vllm_generation

    # head_dim 32 (hidden 128, 4 heads): vLLM's CPU attention needs >= 32. Tied embeddings: the lm_head whose packed
    # CPU GEMM a plain reload leaves stale.
    model_dir = build_model_dir(tmp_path_factory.mktemp("tiny-vllm"), seed=1, hidden_size=128,
                                tie_word_embeddings=True)
    # A fixed 1 GiB KV cache instead of vllm_gpu_memory_utilization x RAM (30% of the machine with TRL's default).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    patch = pytest.MonkeyPatch()
    if request.param != "auto":
        patch.setattr(vllm_generation, "LLM", functools.partial(vllm_generation.LLM, dtype=request.param))
    try:
        trainer = DGPOTrainer(model=model_dir, reward_funcs=length_reward,
                              args=_config(tmp_path_factory.mktemp("out")), train_dataset=prompt_dataset(),
                              processing_class=build_tokenizer())
    finally:
        patch.undo()
    trainer.logprob_atol = ENGINE_DTYPES[request.param]
    yield trainer
    del trainer.vllm_generation.llm


def _vllm_model(trainer):
    return trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.get_model()


def _vllm_logprobs(trainer, ids):
    """vLLM's log-prob of each token of `ids` given the ones before it (prompt_logprobs)."""
    import torch
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    output = trainer.vllm_generation.llm.generate([{"prompt_token_ids": ids}], sampling_params=params,
                                                  use_tqdm=False)[0]
    return torch.tensor([output.prompt_logprobs[i][token].logprob for i, token in enumerate(ids) if i > 0])


def _hf_logprobs(model, ids, grad=False):
    import torch

    with torch.set_grad_enabled(grad):
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _max_diff(trainer, ids):
    return (_vllm_logprobs(trainer, ids) - _hf_logprobs(trainer.model, ids)).abs().max().item()


def test_weight_sync_matches_hf_logprobs(trainer):
    import torch
    from dgpo_ops.trainer.vllm_cpu import cpu_sync_weights

    generation, atol = trainer.vllm_generation, trainer.logprob_atol
    assert generation.sync_weights.__func__ is cpu_sync_weights
    vllm_model = _vllm_model(trainer)
    assert vllm_model.lm_head.weight is vllm_model.model.embed_tokens.weight  # tied in vLLM too
    ids = build_tokenizer()(SEQUENCE)["input_ids"]
    assert len(ids) > 10

    initial_state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    generation.sync_weights()
    synced = [_max_diff(trainer, ids)]

    # Noise on every weight: vLLM lags until the next sync, then agrees again.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    stale = [_max_diff(trainer, ids)]
    generation.sync_weights()
    synced.append(_max_diff(trainer, ids))

    # One optimizer step (the tied embedding moves through both of its uses), synced again.
    embedding_before = trainer.model.get_input_embeddings().weight.detach().clone()
    optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
    (-_hf_logprobs(trainer.model, ids, grad=True).sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert not torch.equal(embedding_before, trainer.model.get_input_embeddings().weight)
    stale.append(_max_diff(trainer, ids))
    generation.sync_weights()
    synced.append(_max_diff(trainer, ids))

    print(f"engine {generation.llm.llm_engine.model_config.dtype}: max |logp diff| synced {synced}, stale {stale}")
    trainer.model.load_state_dict(initial_state)  # the training test starts from the initial model
    assert max(synced) < atol and min(stale) > 3 * atol, (synced, stale)


def test_three_training_steps_generate_with_vllm(trainer):
    import torch

    calls = {"sync": 0, "generate": 0}
    generation = trainer.vllm_generation
    sync, generate = generation.sync_weights, generation.generate

    def counted_sync():
        calls["sync"] += 1
        return sync()

    def counted_generate(*args, **kwargs):
        calls["generate"] += 1
        return generate(*args, **kwargs)

    generation.sync_weights, generation.generate = counted_sync, counted_generate
    weights_before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        trainer.train()
    finally:
        generation.sync_weights, generation.generate = sync, generate

    # One generation per step (steps_per_generation=1, num_iterations=1), each after a sync of that step's weights.
    assert calls == {"sync": 3, "generate": 3}
    assert any(not torch.equal(a, b) for a, b in zip(weights_before, trainer.model.parameters()))
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    print([{k: v for k, v in entry.items() if k.startswith(("loss", "sampling/", "completions/mean"))} for entry in logs])
    for entry in logs:
        for key in ("loss", "entropy", "eur", "ratio_mean", "clip_ratio/region_mean", "reward",
                    "completions/mean_length", "sampling/sampling_logp_difference/max",
                    "sampling/importance_sampling_ratio/mean"):
            assert key in entry and math.isfinite(entry[key]), (key, entry)
        assert entry["completions/mean_length"] > 0
        # vLLM sampled from the weights the trainer scores with: steps 2 and 3 follow optimizer steps.
        assert entry["sampling/sampling_logp_difference/max"] < trainer.logprob_atol, entry
    # After the last optimizer step vLLM lags; one more sync catches it up.
    ids = build_tokenizer()(SEQUENCE)["input_ids"]
    stale = _max_diff(trainer, ids)
    trainer.vllm_generation.sync_weights()
    synced = _max_diff(trainer, ids)
    print(f"after training: stale {stale}, synced {synced}")
    assert synced < trainer.logprob_atol < stale


def test_train_command_generates_with_vllm_on_cpu(tmp_path):
    """`dgpo-ops train --use-vllm` on a CPU: the warm-started tiny model generates through colocated vLLM."""
    import json
    import subprocess
    import sys

    _vllm_cpu_or_skip()
    # The colocated engines of the tests above left RANK, MASTER_PORT, ... in this process's environment (TRL sets
    # them for vLLM's process group) and still hold that port: start the command as from a clean shell, where TRL
    # picks a free port itself.
    dist_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    # Character tokenizer and built-in generator: the vLLM venv has no `train` extra. head_dim 32 for vLLM's CPU.
    args = ["--use-vllm", "--tokenizer", "chars", "--generator", "builtin", "--output-dir", str(tmp_path / "run"),
            "--no-progress", "--sft-steps", "6", "--sft-batch-size", "8", "--max-steps", "2", "--eval-every", "0",
            "--eval-size", "4", "--train-size", "16", "--hidden-size", "64", "--layers", "1", "--heads", "2",
            "--kv-heads", "1", "--num-generations", "4", "--max-completion-length", "8",
            "--per_device_train_batch_size", "8"]
    result = subprocess.run([sys.executable, "-m", "dgpo_ops.trainer.app.command", "train", *args], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads((tmp_path / "run" / "run.json").read_text())["runs"][0]
    assert run["config"]["use_vllm"] is True and run["steps"] == 2
    generated = [entry for entry in run["log_history"] if "sampling/sampling_logp_difference/max" in entry]
    assert generated, run["log_history"]
    for entry in run["log_history"]:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["entropy"])
