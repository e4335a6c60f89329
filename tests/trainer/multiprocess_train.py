"""Two DCPO steps of DGPOTrainer in each process of a torchrun job; writes what each rank saw."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from dgpo_ops.trainer import DGPOConfig, DGPOTrainer  # noqa: E402
from dgpo_ops.trainer.app.cli import exit_process  # noqa: E402
from trainer_fixtures import build_tokenizer, length_reward, prompt_dataset  # noqa: E402

model_dir, out = sys.argv[1], pathlib.Path(sys.argv[2])
args = DGPOConfig(output_dir=str(out / "run"), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=6, bf16=False, use_cpu=True, report_to=[], logging_steps=1, max_steps=2,
                  save_strategy="no", disable_tqdm=True, policy_loss="dcpo", advantage_estimator="dcpo",
                  num_iterations=2)
trainer = DGPOTrainer(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(),
                      processing_class=build_tokenizer())
trainer.train()
rank = trainer.accelerator.process_index
(out / f"rank-{rank}.json").write_text(json.dumps({
    "world": trainer.accelerator.num_processes,
    "dcpo": trainer.smooth_advantages.state_dict(),
    "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
}))
# Without the interpreter's teardown, where gloo's threads can abort a finished rank (pytorch/pytorch#179291), as
# dgpo-ops train exits.
exit_process(0)
