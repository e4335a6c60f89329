"""ROLL's kimi15 loss re-derived from ROLL's source, against dgpo-ops' ``kimi15`` (dro with ``dro_beta = 0.1``).

ROLL cannot be installed as an oracle (the PyPI package ``roll`` is another project), so its lines are written here as
they compute, from alibaba/ROLL at ``ROLL_COMMIT`` (the files and lines in ``ROLL_SOURCE``): ``_compute_kimi15_loss``
is ``-A logp + tau / 2 (logp - lp_old)^2`` with ``kimi15_tau`` 0.1 by default, and ``agg_loss``'s
``seq-mean-token-mean``, ROLL's default ``loss_agg_mode``, is each response's masked mean (``sum / (mask_sum + 1e-8)``,
0 for an empty one), summed over the responses with a scored token and divided by their count plus 1e-8."""

from __future__ import annotations

import pytest
import torch

import dgpo_ops

ROLL_COMMIT = "8eb27cc2dc34c4d1310b169d9b86d339004d811a"
ROLL_SOURCE = {
    "_compute_kimi15_loss": "roll/pipeline/rlvr/actor_pg_worker.py, lines 408-442",
    "agg_loss, masked_mean": "roll/utils/functionals.py, lines 229-297",
}


def roll_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask_sum = mask.sum(-1)
    return torch.where(mask_sum > 0, (values * mask).sum(-1) / (mask_sum + 1e-8), 0.0)


def roll_kimi15(logp, old_logp, advantages, mask, tau=0.1):
    """ROLL's kimi15 loss with ``loss_agg_mode="seq-mean-token-mean"`` on one process."""
    loss_mat = -advantages[:, None] * logp + tau / 2 * (logp - old_logp) ** 2
    valid = (mask.sum(-1) > 0).to(logp.dtype)
    return (roll_masked_mean(loss_mat, mask) * valid).sum() / (valid.sum() + 1e-8)


def batch(seed: int, drift: float):
    """Ragged responses (one fully masked) and old log-probs up to ``drift`` nats from the current ones."""
    generator = torch.Generator().manual_seed(seed)
    B, T, V = 4, 7, 33
    logits = torch.randn(B, T, V, generator=generator, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (B, T), generator=generator)
    lengths = torch.tensor([7, 4, 0, 2])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    old_logp = logp + drift * (2 * torch.rand(B, T, generator=generator, dtype=torch.float64) - 1)
    advantages = torch.randn(B, generator=generator, dtype=torch.float64)
    return logits, targets, mask, old_logp, advantages


@pytest.mark.parametrize("route", ["reference", "fused-torch", "fused-triton"])
@pytest.mark.parametrize("drift", [0.05, 3.0])
@pytest.mark.parametrize("tau", [None, 0.5])  # None: kimi15's own 0.1
def test_kimi15_is_rolls_loss(route, drift, tau):
    logits, targets, mask, old_logp, advantages = batch(seed=5, drift=drift)
    dtype = torch.float32 if route == "fused-triton" else torch.float64
    leaf = logits.to(dtype).detach().clone().requires_grad_(True)
    expected_leaf = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(expected_leaf, -1).gather(-1, targets[..., None]).squeeze(-1)
    expected = roll_kimi15(logp, old_logp, advantages, mask.double(), 0.1 if tau is None else tau)
    expected.backward()
    valid = float((mask.sum(-1) > 0).sum())  # ROLL counts the responses with a scored token
    keywords = dict(mask=mask, old_logps=old_logp.to(dtype), method="kimi15", aggregation="seq_mean_token_mean",
                    loss_normalizer=valid, **({} if tau is None else {"dro_beta": tau}))
    if route == "reference":
        out = dgpo_ops.reference_loss(leaf, targets, advantages.to(dtype), **keywords)
    else:
        out = dgpo_ops.fused_dgpo_loss(leaf, targets, advantages.to(dtype), backend=route.split("-")[1], **keywords)
    out.loss.backward()
    tolerance = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(out.loss.double(), expected.detach(), **tolerance)
    torch.testing.assert_close(leaf.grad.double(), expected_leaf.grad, **tolerance)


def test_kimi15_is_dro_with_rolls_tau():
    assert dgpo_ops.method_config("kimi15") == dgpo_ops.method_config("dro", dro_beta=0.1)
    assert dgpo_ops.method_config("kimi15", dro_beta=0.3).dro_beta == 0.3
