"""GRPO: PPO's clipped ratio, with the dual clip and TRL's delta; DAPO is grpo with clip-higher."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from dgpo_ops.kernels.interface import KernelParam, MethodId
from dgpo_ops.methods.base import MethodAlias, MethodConfig, MethodSpec, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import dual_clip_param, eps_high_param, eps_low_param, ppo_clip, symmetric_bounds


@dataclass(frozen=True)
class GrpoConfig(MethodConfig):
    name: ClassVar[str] = "grpo"
    method_id: ClassVar[MethodId] = MethodId.PPO_CLIP
    eps_low: float = eps_low_param()
    eps_high: float = eps_high_param()
    dual_clip: float | None = dual_clip_param(None)
    # TRL's two-sided clipping (INTELLECT-2): the unclipped ratio is capped at delta, -min(min(r, delta) A, clip(r) A)
    delta: float | None = param(None, "cap on the ratio before PPO's min (TRL's delta)", low=0.0, low_open=True,
                                optional=True)

    def _kernel_slots(self):
        return {**symmetric_bounds(self), KernelParam.DUAL_CLIP: self.dual_clip, KernelParam.DELTA: self.delta}


def _grpo(cfg: GrpoConfig, x: TokenInputs) -> TokenTerms:
    dual = math.inf if cfg.dual_clip is None else cfg.dual_clip
    delta = math.inf if cfg.delta is None else cfg.delta
    return ppo_clip(x, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, dual, delta)


ALIASES = (MethodAlias("dapo", "grpo", {"eps_high": 0.28}, "DAPO's clip-higher"),)

SPECS = (
    MethodSpec(GrpoConfig, _grpo, "PPO clip; optional dual clip",
               "PPO (Schulman et al. 2017) as GRPO uses it (DeepSeekMath, Shao et al. 2024); dual clip: "
               "Ye et al. 2019, arXiv:1912.09729",
               variants=({}, {"eps_high": 0.28, "dual_clip": 3.0}, {"delta": 1.5}, {"delta": 1.1, "dual_clip": 2.0})),
)
