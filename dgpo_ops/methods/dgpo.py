"""DGPO: decoupled polynomial / radical decay of the probability gradient outside the trust region."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from dgpo_ops.kernels.interface import KernelParam, MethodId, Region
from dgpo_ops.methods.base import MethodConfig, MethodSpec, TokenInputs, TokenTerms, param
from dgpo_ops.methods.clip import eps_high_param, eps_low_param, regions, symmetric_bounds


@dataclass(frozen=True)
class DgpoConfig(MethodConfig):
    name: ClassVar[str] = "dgpo"
    method_id: ClassVar[MethodId] = MethodId.DGPO
    eps_low: float = eps_low_param()
    eps_high: float = eps_high_param()
    n: float = param(1.0, "polynomial decay order of the probability gradient on the left boundary", low=0.0)
    m: float = param(2.0, "radical decay order on the right boundary", low=1.0)

    def _kernel_slots(self):
        return {**symmetric_bounds(self), KernelParam.N: self.n, KernelParam.M: self.m}


def _dgpo(cfg: DgpoConfig, x: TokenInputs) -> TokenTerms:
    log_r, rd, adv = x.log_ratio, x.ratio_detached, x.advantage
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    region = regions(rd, adv, low, high)
    in_ln, in_hp = region == Region.LN.value, region == Region.HP.value
    log_rd = log_r.detach()
    # LN: exp(l + n sg(l) - (n+1) l_old) / low^n. Exponents are zeroed outside their region so
    # an overflow there cannot turn into 0 * inf = nan in the backward of torch.where.
    log_low = math.log(low) if low > 0 else 0.0  # low = 0 leaves LN empty
    ln_exponent = torch.where(in_ln, log_r + cfg.n * (log_rd - log_low), log_r.detach() * 0)
    # HP: exp(l + log(high)/m - l_old (m-1)/m - sg(l)/m).
    hp_exponent = torch.where(in_hp, log_r + (math.log(high) - log_rd) / cfg.m, log_r.detach() * 0)
    weight = torch.where(in_ln, torch.exp(ln_exponent), torch.where(in_hp, torch.exp(hp_exponent), x.ratio))
    return TokenTerms(-adv * weight, weight, region)


SPECS = (
    MethodSpec(DgpoConfig, _dgpo, "decoupled polynomial / radical decay of the probability gradient",
               "DGPO: Fu et al., 'From log pi to pi: Taming Divergence in Soft Clipping via Bilateral "
               "Decoupled Decay of Probability Gradient Weight'",
               variants=({}, {"n": 2.0, "m": 3.0}, {"n": 0.0, "m": 1.0})),
)
