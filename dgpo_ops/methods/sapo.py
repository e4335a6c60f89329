"""SAPO: soft gates of the ratio instead of clipping (sigmoid, erf, arctan, softsign)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import Gate, KernelParam, MethodId
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import full_like

GATES = {"sigmoid": Gate.SIGMOID, "erf": Gate.ERF, "arctan": Gate.ARCTAN, "softsign": Gate.SOFTSIGN}


@dataclass(frozen=True)
class SapoConfig(MethodConfig):
    name: ClassVar[str] = "sapo"
    method_id: ClassVar[MethodId] = MethodId.SAPO
    gate: str = param("sigmoid", "soft gate of the ratio", choices=tuple(GATES))
    tau_pos: float = param(1.0, "gate temperature for A >= 0", low=0.0, low_open=True)
    tau_neg: float = param(1.05, "gate temperature for A < 0", low=0.0, low_open=True)

    def _kernel_slots(self):
        return {KernelParam.TAU_POS: self.tau_pos, KernelParam.TAU_NEG: self.tau_neg}

    @property
    def gate_id(self) -> Gate:
        return GATES[self.gate]


def _sapo_gate(gate: Gate, x, tau):
    """Gate value f_tau(x) and slope f'_tau(x); tau is a tensor."""
    u = x - 1.0
    if gate == Gate.SIGMOID:
        s = torch.sigmoid(tau * u)
        return s * 4.0 / tau, 4.0 * s * (1.0 - s)
    if gate == Gate.ERF:
        k = math.sqrt(math.pi / 2.0) / tau
        return k * (1.0 + torch.erf(tau * u / math.sqrt(2.0))) + 1.0 - k, torch.exp(-0.5 * (tau * u) ** 2)
    if gate == Gate.ARCTAN:
        return 1.0 + torch.atan(tau * u) / tau, 1.0 / (1.0 + (tau * u) ** 2)
    if gate == Gate.SOFTSIGN:
        d = 1.0 + (tau * u) ** 2
        return 1.0 + u / torch.sqrt(d), d**-1.5
    raise AssertionError(gate)


def _sapo(cfg: SapoConfig, x: TokenInputs) -> TokenTerms:
    rd = x.ratio_detached
    tau = torch.where(x.advantage >= 0, full_like(cfg.tau_pos, rd), full_like(cfg.tau_neg, rd))
    value, _ = _sapo_gate(cfg.gate_id, x.ratio, tau)
    _, slope = _sapo_gate(cfg.gate_id, rd, tau)
    # SAPO has no trust region: every token is in M.
    return TokenTerms(-x.advantage * value, slope * rd, torch.zeros_like(rd, dtype=torch.int8))


SPECS = (
    MethodSpec(SapoConfig, _sapo, "soft gates instead of clipping",
               "SAPO: arXiv:2511.20347 (sigmoid gate); the other gates: Denisov et al. 2026, "
               "arXiv:2602.19345",
               variants=({"gate": "sigmoid"}, {"gate": "erf", "tau_pos": 10.0, "tau_neg": 12.0},
                         {"gate": "arctan"}, {"gate": "softsign", "tau_pos": 2.0, "tau_neg": 3.0})),
)
