"""DCPO's advantage state in ``DGPOTrainer``: with ``advantage_estimator="dcpo"`` the advantages of each
generation batch come from ``SmoothAdvantageStandardizer``, whose running per-prompt statistics are saved
with every checkpoint and read back on resume."""

from __future__ import annotations

import json
import os

import torch
from accelerate.utils import gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .advantages import SmoothAdvantageStandardizer, prompt_key

DCPO_STATE_FILE = "dcpo_advantage_state.json"


class DCPOAdvantageState:
    """A mixin of ``GRPOTrainer`` (``DGPOTrainer``'s, before ``ResponseScores``, whose rewards it reads): DCPO's
    smooth advantages in place of TRL's group ones."""

    def _init_dcpo_state(self) -> None:
        self.smooth_advantages = SmoothAdvantageStandardizer() if self.args.advantage_estimator == "dcpo" else None

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.smooth_advantages is not None and self.model.training:
            output["advantages"] = self._smooth_advantages().to(output["advantages"].device)
        return output

    def _smooth_advantages(self) -> torch.Tensor:
        rewards, unscorable = self._gathered_scores()  # ResponseScores'
        # Every process sees the same gathered rewards and keys, so every standardiser stays identical.
        keys = gather_object([prompt_key(json.dumps(p, sort_keys=True, default=str)) for p in self._scored_prompts])
        advantages = self.smooth_advantages(keys, rewards.float(), self.num_generations)
        return self._local_rows(advantages.masked_fill(unscorable, 0.0))

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.smooth_advantages is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, DCPO_STATE_FILE), "w") as f:
                json.dump(self.smooth_advantages.state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.smooth_advantages is not None and checkpoint is not None:
            path = os.path.join(checkpoint, DCPO_STATE_FILE)
            if os.path.exists(path):
                with open(path) as f:
                    self.smooth_advantages.load_state_dict(json.load(f))
