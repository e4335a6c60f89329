"""Response-level advantages: GRPO group-relative advantages and DCPO smooth advantage standardisation.

Both follow the layout of TRL's ``GRPOTrainer``: ``rewards`` is a 1-D tensor of ``num_prompts * group_size``
completions ordered group by group (the ``group_size`` completions of one prompt are consecutive).

* :func:`group_advantages` -- ``(R - mean_G R) / (std_G R + eps)`` per group, bit-for-bit what TRL 1.16's
  ``GRPOTrainer._generate_and_score_completions`` computes with ``scale_rewards="group"`` (``scale=True``) or
  ``scale_rewards="none"`` (``scale=False``, Dr. GRPO). TRL uses the *unbiased* (Bessel-corrected, ``n - 1``)
  group std (``trl.trainer.utils.nanstd``) and ``eps = 1e-4``, so those are the conventions and the default here.
* :class:`SmoothAdvantageStandardizer` -- DCPO's smooth advantage standardisation (SAS, DCPO paper section 3,
  eqs. 5-7, statistics of appendix A.7 eqs. 29-30) across training steps, per prompt, with exact running
  statistics that can be checkpointed (``state_dict`` / ``load_state_dict``).
* :func:`per_token_advantages` -- per-response advantages on the tokens' grid, as the trainer's loss, masks and
  metrics take them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

import torch

__all__ = ["SmoothAdvantageStandardizer", "group_advantages", "per_token_advantages", "prompt_key"]

#: The epsilon TRL 1.16's GRPOTrainer adds to the group std (``advantages / (std_rewards + 1e-4)``).
TRL_STD_EPS = 1e-4


def _check_rewards(rewards) -> None:
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (num_prompts * group_size,), got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must have a floating-point dtype, got {rewards.dtype}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (found NaN or inf)")


def _check_group_size(group_size, numel: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if numel % group_size != 0:
        raise ValueError(f"group_size={group_size} does not divide the number of rewards ({numel})")


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = TRL_STD_EPS
) -> torch.Tensor:
    """GRPO group-relative advantages ``(R - mean_G R) / (std_G R + eps)``; ``scale=False``: ``R - mean_G R``.

    Mirrors TRL 1.16 ``GRPOTrainer._generate_and_score_completions`` (``multi_objective_aggregation=
    "sum_then_normalize"``) operation for operation, so the result is bit-identical to TRL's:

    * the mean is ``torch.nanmean`` over the group;
    * the std is TRL's ``nanstd``: the **unbiased** (Bessel, ``n - 1``) sample std, computed as
      ``sqrt(mean((R - mean)^2) * n / (n - 1))``, where (as in TRL) the factor ``n / (n - 1)`` is an
      integer-tensor division and so lands in the default dtype (float32): float64 rewards carry a
      ~1e-8 relative rounding from it, exactly as they do in TRL;
    * ``eps`` defaults to TRL's ``1e-4`` (added to the std, not to the variance);
    * ``group_size == 1`` gives a zero std (TRL's ``num_generations == 1`` branch), hence zero advantages;
    * a group whose rewards are all equal gets zero advantages.

    ``scale=False`` is Dr. GRPO / TRL's ``scale_rewards="none"``: no std and no ``eps``.

    Args:
        rewards: 1-D floating tensor of shape ``(num_prompts * group_size,)``, groups consecutive.
        group_size: completions per prompt (TRL's ``num_generations``).
        scale: divide by ``std + eps``.
        eps: added to the group std (ignored when ``scale=False``).

    Returns:
        Advantages with the shape, dtype and device of ``rewards``.

    Raises:
        ValueError: naming the offending argument (non-tensor / not 1-D / non-floating / non-finite
            ``rewards``; ``group_size`` not a positive int dividing ``len(rewards)``; negative ``eps``).
    """
    _check_rewards(rewards)
    _check_group_size(group_size, rewards.numel())
    eps = _check_eps(eps)
    if rewards.numel() == 0:
        return rewards.clone()
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    advantages = grouped - mean
    if scale:
        if group_size > 1:
            # trl.trainer.utils.nanstd, without NaNs (rejected above).
            variance = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True)
            count = torch.sum(~torch.isnan(grouped), dim=1, keepdim=True)
            variance = variance * (count / (count - 1))
            std = torch.sqrt(variance)
        else:
            std = torch.zeros_like(mean)
        advantages = advantages / (std + eps)
    return advantages.reshape(-1).to(rewards.dtype)


def per_token_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages on the tokens' ``(B, T)`` grid: per-response ``(B,)`` ones as a ``(B, 1)`` column, which
    broadcasts over each response's tokens (TRL's ``advantages.unsqueeze(1)``); per-token ``(B, T)`` ones as
    they are."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


def prompt_key(prompt) -> str:
    """A stable key for a prompt: SHA-256 of its text (or of its canonical JSON for chat-format prompts).

    Stable across processes and runs (unlike Python's ``hash``, which is salted per process), so all ranks
    and a resumed run agree. Any string works as a key for :class:`SmoothAdvantageStandardizer`; this is a
    convenience.
    """
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class SmoothAdvantageStandardizer:
    """DCPO smooth advantage standardisation (SAS) across training steps, per prompt.

    For a prompt at its ``i``-th participation (``i = 1, 2, ...`` counts the calls in which its key occurred)
    with this step's rewards ``R`` (``n`` of them):

    * step statistics ``mu_new = mean(R)``, ``sigma_new = sqrt(mean((R - mu_new)^2))``;
    * cumulative statistics ``mu_total``, ``sigma_total`` of *all* rewards seen for the prompt, this step
      included, merged exactly with the stored running ``(count, mean, M2)`` (the pooled-mean /
      pooled-variance identity of the paper's eqs. 29-30, generalised to unequal group sizes:
      ``delta = mu_new - mu_old``, ``mean = mu_old + delta * n / N``,
      ``M2 = M2_old + M2_new + delta^2 * count_old * n / N``, ``N = count_old + n``);
    * ``A_new = (R - mu_new) / (sigma_new + eps)``, ``A_total = (R - mu_total) / (sigma_total + eps)``
      (eqs. 11 and 5);
    * ``SA_new = ((i-1)/i) A_new + (1/i) A_total``, ``SA_total = (1/i) A_new + ((i-1)/i) A_total`` (eq. 6);
    * ``A = SA_new if |SA_new| < |SA_total| else SA_total``, elementwise (eq. 7).

    At ``i = 1`` the step and cumulative statistics coincide, so ``A = SA_new = SA_total = A_total = A_new``
    (the GRPO advantage with population std). At ``i = 2`` the two smoothings coincide (weights 1/2, 1/2).

    **Variance convention: population** (divide by the number of rewards, not ``n - 1``), as in the paper's
    eq. 30: ``sigma_new^i = sqrt(1/G sum_j (R_j^i - mu_new^i)^2)`` and
    ``sigma_total^i = sqrt(1/(G*i) sum_k sum_j (R_j^k - mu_total)^2)``. (This differs from TRL's GRPO
    advantage, which uses the unbiased group std; see :func:`group_advantages`.)

    **Epsilon:** ``eps`` (default ``1e-6``) is added to the std as in GRPO, ``(R - mu) / (sigma + eps)``;
    the paper's eqs. 5 and 11 have no epsilon. So a step whose rewards are all equal has ``sigma_new = 0``
    and ``A_new = 0`` exactly, with no division by zero, and the response still learns through ``A_total``
    whenever the prompt's cumulative std is nonzero. A prompt whose rewards have always been equal gets 0.
    ``eps=0`` gives the paper's formulas exactly, with the convention ``sigma == 0 -> standardised value 0``.

    **Keys:** one string per group, supplied by the caller, that identifies the prompt stably across steps,
    processes and restarts (e.g. :func:`prompt_key`; do not use Python's salted ``hash``). If a key occurs
    in several groups of one call, all of those completions form that prompt's sample for the step: one
    participation, step statistics pooled over them.

    **Multi-process contract:** call it on the batch *gathered across processes* (TRL gathers the rewards
    of all processes before normalising them, and the prompt keys can be gathered with
    ``gather_object``), with identical arguments in the same order on every process, then slice out the
    local part of the result, as TRL does with its advantages. Every process then holds an identical state
    (the arithmetic is deterministic float64 on CPU), so any process (e.g. the main one) can save
    ``state_dict()`` in the checkpoint and every process loads the same dict on resume. The class does no
    communication itself.

    Call it once per generation step and only for training batches: every call is a participation and
    updates the statistics. (In TRL, ``_generate_and_score_completions`` runs once per
    ``steps_per_generation`` optimiser steps; the buffered batch is reused without re-scoring.)

    Statistics are kept as Python floats (float64) and computed in float64 on CPU, whatever the dtype and
    device of ``rewards``; the result is returned with the dtype and device of ``rewards``.
    """

    def __init__(self, eps: float = 1e-6):
        self.eps = _check_eps(eps)
        # key -> [count (int), mean (float), M2 = sum of squared deviations (float), participations (int)]
        self._stats: dict[str, list] = {}

    def __len__(self) -> int:
        """Number of prompts with statistics."""
        return len(self._stats)

    def __contains__(self, key) -> bool:
        return key in self._stats

    def _standardise(self, values: torch.Tensor, mean: float, std: float) -> torch.Tensor:
        denominator = std + self.eps
        if denominator == 0.0:  # eps == 0 and a zero std: every value equals the mean
            return torch.zeros_like(values)
        return (values - mean) / denominator

    def _group_keys(self, prompt_keys, num_groups: int, group_size: int) -> list[str]:
        if isinstance(prompt_keys, (str, bytes)) or not isinstance(prompt_keys, Sequence):
            raise ValueError(
                f"prompt_keys must be a list of str (one per group or per completion), got "
                f"{type(prompt_keys).__name__}"
            )
        for key in prompt_keys:
            if not isinstance(key, str):
                raise ValueError(f"prompt_keys must contain only str keys, got {type(key).__name__}: {key!r}")
        numel = num_groups * group_size
        if len(prompt_keys) == num_groups:
            return list(prompt_keys)
        if len(prompt_keys) == numel:
            keys = []
            for g in range(num_groups):
                chunk = prompt_keys[g * group_size:(g + 1) * group_size]
                if any(k != chunk[0] for k in chunk):
                    raise ValueError(
                        f"prompt_keys given per completion must be constant within each group; group {g} "
                        f"(completions {g * group_size}..{(g + 1) * group_size - 1}) has keys {sorted(set(chunk))}"
                    )
                keys.append(chunk[0])
            return keys
        raise ValueError(
            f"prompt_keys has {len(prompt_keys)} entries; expected one per group ({num_groups}) or one per "
            f"completion ({numel}) for {numel} rewards with group_size={group_size}"
        )

    def __call__(self, prompt_keys: list[str], rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Smooth advantages for one training step; updates the per-prompt statistics.

        Args:
            prompt_keys: one stable key per group (``len(rewards) // group_size`` of them), or one per
                completion (then constant within each group).
            rewards: 1-D floating tensor ``(num_prompts * group_size,)``, the completions of a group
                consecutive (TRL's layout), gathered across processes.
            group_size: completions per prompt.

        Returns:
            Advantages with the shape, dtype and device of ``rewards``.

        Raises:
            ValueError: naming the offending argument. The state is left untouched on error.
        """
        _check_rewards(rewards)
        _check_group_size(group_size, rewards.numel())
        num_groups = rewards.numel() // group_size
        keys = self._group_keys(prompt_keys, num_groups, group_size)

        values = rewards.detach().to(device="cpu", dtype=torch.float64).view(num_groups, group_size)
        groups_of_key: dict[str, list[int]] = {}
        for g, key in enumerate(keys):
            groups_of_key.setdefault(key, []).append(g)

        out = torch.empty_like(values)
        updates: dict[str, list] = {}
        for key, groups in groups_of_key.items():
            step = values[groups].reshape(-1)
            n = step.numel()
            if bool((step == step[0]).all()):  # all equal: exact statistics (a rounded mean could leave M2 > 0)
                mu_new, m2_new = step[0].item(), 0.0
            else:
                mu_new = step.mean().item()
                m2_new = ((step - mu_new) ** 2).sum().item()
            sigma_new = math.sqrt(m2_new / n)

            count_old, mu_old, m2_old, participations = self._stats.get(key, (0, 0.0, 0.0, 0))
            count = count_old + n
            if count_old == 0:  # first participation: the cumulative statistics are the step's, exactly
                mu_total, m2_total = mu_new, m2_new
            else:
                delta = mu_new - mu_old
                mu_total = mu_old + delta * n / count
                m2_total = m2_old + m2_new + delta * delta * count_old * n / count
            sigma_total = math.sqrt(m2_total / count)
            i = participations + 1

            a_new = self._standardise(step, mu_new, sigma_new)
            a_total = self._standardise(step, mu_total, sigma_total)
            sa_new = ((i - 1) / i) * a_new + (1 / i) * a_total
            sa_total = (1 / i) * a_new + ((i - 1) / i) * a_total
            advantages = torch.where(sa_new.abs() < sa_total.abs(), sa_new, sa_total)

            out[groups] = advantages.view(len(groups), group_size)
            updates[key] = [count, mu_total, m2_total, i]

        self._stats.update(updates)
        return out.reshape(-1).to(device=rewards.device, dtype=rewards.dtype)

    def state_dict(self) -> dict:
        """JSON-serialisable state: ``{key: [count, mean, M2, participations]}``.

        ``count`` is the number of rewards seen for the prompt, ``mean`` their mean, ``M2`` the sum of their
        squared deviations from the mean (population variance ``M2 / count``), ``participations`` the
        number of steps the prompt took part in. Python floats survive ``json.dumps``/``json.loads``
        exactly, so a run resumed from it continues bit-identically.
        """
        return {key: list(entry) for key, entry in self._stats.items()}

    def load_state_dict(self, d: dict) -> None:
        """Replace the state with ``d`` (as returned by :meth:`state_dict`, possibly through JSON)."""
        if not isinstance(d, dict):
            raise ValueError(f"state_dict must be a dict, got {type(d).__name__}")
        stats = {}
        for key, entry in d.items():
            if not isinstance(key, str):
                raise ValueError(f"state_dict keys must be str, got {type(key).__name__}: {key!r}")
            if not isinstance(entry, (list, tuple)) or len(entry) != 4:
                raise ValueError(
                    f"state_dict[{key!r}] must be [count, mean, M2, participations], got {entry!r}"
                )
            count, mean, m2, participations = entry
            ok = (
                isinstance(count, int) and not isinstance(count, bool) and count >= 1
                and isinstance(participations, int) and not isinstance(participations, bool)
                and participations >= 1
                and isinstance(mean, (int, float)) and not isinstance(mean, bool) and math.isfinite(mean)
                and isinstance(m2, (int, float)) and not isinstance(m2, bool) and math.isfinite(m2) and m2 >= 0
            )
            if not ok:
                raise ValueError(
                    f"state_dict[{key!r}] = {entry!r} is invalid: expected count >= 1 (int), finite mean, "
                    f"finite M2 >= 0, participations >= 1 (int)"
                )
            stats[key] = [count, float(mean), float(m2), participations]
        self._stats = stats
