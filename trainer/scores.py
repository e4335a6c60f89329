"""Each response's score in ``DGPOTrainer``, and what reads it: the weighted sum of its rewards, as TRL sums them
(the ``reward`` it logs), kept beside the advantages for a loss that reads the ``scores`` input (topr's sample
split, the positive-example NLL), and read by DCPO's smooth advantages (``advantage_estimator="dcpo"``), whose
running per-prompt statistics are saved with every checkpoint and read back on resume."""

from __future__ import annotations

import json
import os

import torch
from accelerate.utils import gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .advantages import SmoothAdvantageStandardizer, prompt_key

DCPO_STATE_FILE = "dcpo_advantage_state.json"


class ResponseScores:
    """A mixin of ``GRPOTrainer`` (``DGPOTrainer``'s): the rewards of the last generation batch; its responses'
    scores in the batch the loss reads (``inputs["scores"]``) where the loss needs them; DCPO's smooth advantages
    from the same scores in place of TRL's group ones, and their checkpointed state."""

    def _init_scores(self, loss_reads_scores: bool, smooth_advantages: bool) -> None:
        """``loss_reads_scores``: put the scores in the loss's batch (the loss options' ``needs_scores``);
        ``smooth_advantages``: DCPO's advantages (``advantage_estimator="dcpo"``)."""
        self.loss_reads_scores = loss_reads_scores
        self.smooth_advantages = SmoothAdvantageStandardizer() if smooth_advantages else None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._scored_prompts = prompts
        self._rewards_per_func = rewards_per_func  # gathered across processes, as TRL's
        return rewards_per_func

    def _gathered_scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores, unscorable)`` of every process's responses: TRL's weighted ``nansum`` of the rewards (0 for a
        response every reward function left unscored, which TRL gives advantage 0) and where that happened."""
        rewards_per_func = self._rewards_per_func
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        scores = torch.nan_to_num((rewards_per_func * weights).nansum(dim=1), nan=0.0)
        return scores, unscorable

    def _local_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor over every process's responses (TRL's order)."""
        local = len(self._scored_prompts)
        start = self.accelerator.process_index * local
        return gathered[start:start + local]

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        smooth = self.smooth_advantages is not None and self.model.training
        if not (smooth or self.loss_reads_scores):
            return output
        scores, unscorable = self._gathered_scores()
        device = output["advantages"].device
        if smooth:
            output["advantages"] = self._smooth_advantages(scores, unscorable).to(device)
        if self.loss_reads_scores:
            # a per-response tensor of the batch: TRL's shuffling and splitting carry it with the advantages
            output["scores"] = self._local_rows(scores).float().to(device)
        return output

    def _smooth_advantages(self, scores: torch.Tensor, unscorable: torch.Tensor) -> torch.Tensor:
        """DCPO's advantages of this process's responses from every process's scores."""
        # Every process sees the same gathered scores and keys, so every standardiser stays identical.
        keys = gather_object([prompt_key(json.dumps(p, sort_keys=True, default=str)) for p in self._scored_prompts])
        advantages = self.smooth_advantages(keys, scores.float(), self.num_generations)
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
