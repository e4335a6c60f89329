"""GPG: the plain policy gradient, the log-prob times the advantage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import MethodId
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms


@dataclass(frozen=True)
class GpgConfig(MethodConfig):
    name: ClassVar[str] = "gpg"
    method_id: ClassVar[MethodId] = MethodId.REINFORCE

    def _kernel_slots(self):
        return {}


def _gpg(cfg: GpgConfig, x: TokenInputs) -> TokenTerms:
    # REINFORCE: the log-prob weighted by the advantage, no ratio. Every token is in M.
    rd = x.ratio_detached
    return TokenTerms(-x.advantage * x.logp, torch.ones_like(rd), torch.zeros_like(rd, dtype=torch.int8))


SPECS = (
    MethodSpec(GpgConfig, _gpg, "plain policy gradient: the log-prob times the advantage",
               "GPG: Group Policy Gradient, Chu et al. 2025, arXiv:2504.02546"),
)
