"""A token's terms as the method table's two implementations compute them: the Triton mirror
(kernels/method_table.py, run by a one-block kernel here) and the torch table (``dgpo_ops.token_terms``);
shared by tests/kernels/test_method_mirror.py and tests/ops/test_extreme_values.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import dgpo_ops
from dgpo_ops.kernels.method_table import kernel_token_terms as mirror_token_terms


@triton.jit
def evaluate_mirror_kernel(log_ratio_ptr, adv_ptr, old_logp_ptr, params_ptr, loss_ptr, psi_ptr, region_ptr, ratio_ptr,
                           dloss_ptr, n, METHOD: tl.constexpr, GATE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    log_ratio = tl.load(log_ratio_ptr + offsets, mask=inside, other=0.0)
    adv = tl.load(adv_ptr + offsets, mask=inside, other=0.0)
    old_logp = tl.load(old_logp_ptr + offsets, mask=inside, other=0.0)
    loss, dloss, psi, region, ratio = mirror_token_terms(log_ratio, adv, old_logp, log_ratio + old_logp, params_ptr,
                                                         METHOD, GATE)
    tl.store(loss_ptr + offsets, loss, mask=inside)
    tl.store(dloss_ptr + offsets, dloss, mask=inside)
    tl.store(ratio_ptr + offsets, ratio, mask=inside)
    tl.store(psi_ptr + offsets, psi, mask=inside)
    tl.store(region_ptr + offsets, region.to(tl.int8), mask=inside)


def mirror(cfg, log_ratio, adv, old_logp, with_gradient=False):
    """The mirror's (L, psi, region, r) of every token, and dL/dl with ``with_gradient``."""
    n = log_ratio.numel()
    loss, psi, ratio, dloss = torch.empty(n), torch.empty(n), torch.empty(n), torch.empty(n)
    region = torch.empty(n, dtype=torch.int8)
    params = torch.tensor(cfg.kernel_params(), dtype=torch.float32)
    evaluate_mirror_kernel[(triton.cdiv(n, 64),)](log_ratio, adv, old_logp, params, loss, psi, region, ratio, dloss,
                                                  n, METHOD=int(cfg.method_id), GATE=int(cfg.gate_id), BLOCK=64)
    return (loss, psi, region, ratio) + ((dloss,) if with_gradient else ())


def table_terms(cfg, log_ratio, adv, old_logp):
    """The table's per-token terms; a batch-level selection (clip_cov, kl_cov) is not the mirror's: no token is
    scored for it, so it selects none."""
    return dgpo_ops.token_terms(cfg, log_ratio, adv, old_logp, scored=torch.zeros_like(adv, dtype=torch.bool))
