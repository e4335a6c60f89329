"""Each response's score in ``DGPOTrainer``: the weighted sum of its rewards, as TRL sums them (the ``reward``
it logs), kept beside the advantages for what reads it: DCPO's smooth advantages, and a loss that reads the
``scores`` input (topr's sample split, the positive-example NLL)."""

from __future__ import annotations

import torch


class ResponseScores:
    """A mixin of ``GRPOTrainer`` (``DGPOTrainer``'s): the rewards of the last generation batch, and its
    responses' scores in the batch the loss reads (``inputs["scores"]``) where the loss needs them."""

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
        if self.loss_options.needs_scores:
            scores, _ = self._gathered_scores()
            # a per-response tensor of the batch: TRL's shuffling and splitting carry it with the advantages
            output["scores"] = self._local_rows(scores).float().to(output["advantages"].device)
        return output
