"""A framework's loss re-derived or imported as the oracle, against dgpo-ops' on the reference and both kernel sets:
the ragged batch and the comparison the framework tests under tests/integrations share."""

from __future__ import annotations

import torch

import dgpo_ops

ROUTES = ("reference", "fused-torch", "fused-triton")


def ragged_batch(seed: int, drift: float):
    """Ragged responses (one fully masked) and old log-probs up to ``drift`` nats from the current ones (and
    at most 0, as log-probs are):
    ``(logits, targets, mask, old_logp, advantages)``, float64."""
    generator = torch.Generator().manual_seed(seed)
    B, T, V = 4, 7, 33
    logits = torch.randn(B, T, V, generator=generator, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (B, T), generator=generator)
    lengths = torch.tensor([7, 4, 0, 2])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    spread = 2 * torch.rand(B, T, generator=generator, dtype=torch.float64) - 1
    old_logp = (logp + drift * spread).clamp(max=0.0)
    advantages = torch.randn(B, generator=generator, dtype=torch.float64)
    return logits, targets, mask, old_logp, advantages


def assert_route_matches(route: str, batch, oracle, **keywords) -> None:
    """dgpo-ops' loss and logits gradient on ``route`` equal ``oracle(logp, old_logp, advantages, mask)``'s (the
    framework's scalar loss from differentiable float64 log-probs). ``keywords``: the method, its parameters and the
    aggregation; float64 except on the Triton interpreter (float32)."""
    logits, targets, mask, old_logp, advantages = batch
    dtype = torch.float32 if route == "fused-triton" else torch.float64
    leaf = logits.to(dtype).detach().clone().requires_grad_(True)
    expected_leaf = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(expected_leaf, -1).gather(-1, targets[..., None]).squeeze(-1)
    expected = oracle(logp, old_logp, advantages, mask)
    expected.backward()
    keywords = dict(mask=mask, old_logps=old_logp.to(dtype), **keywords)
    if route == "reference":
        out = dgpo_ops.reference_loss(leaf, targets, advantages.to(dtype), **keywords)
    else:
        out = dgpo_ops.fused_dgpo_loss(leaf, targets, advantages.to(dtype), backend=route.split("-")[1], **keywords)
    out.loss.backward()
    tolerance = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(out.loss.double(), expected.detach(), **tolerance)
    torch.testing.assert_close(leaf.grad.double(), expected_leaf.grad, **tolerance)
