"""Inputs for the rollout-correction tests: ragged and fully masked responses, inference log-probs that drift
from the trainer's by up to several nats (and, for TRL's NaN handling, tokens the engine gave no log-prob), and
one runner that puts a call through every route of the op (reference, both kernel sets, packed, fused linear,
torch.compile) so a test compares each with its framework's oracle."""

from __future__ import annotations

import torch
from helpers import logits_batch

import dgpo_ops

LENGTHS = [6, 2, 0, 5]  # response lengths: ragged, and one fully masked; the padded grid is (4, 6)
VOCAB = 23


def mismatch_batch(drift: float, seed: int = 0, nan_tokens: bool = False) -> dict:
    """A padded batch whose ``rollout_logps`` are the ``old_logps`` plus ``drift`` times a standard normal (some
    tokens agreeing exactly); ``nan_tokens``: two scored tokens carry NaN inference log-probs."""
    B, T = len(LENGTHS), max(LENGTHS)
    batch = logits_batch(B, T, VOCAB, seed=seed, mask_fraction=0.0)
    g = torch.Generator().manual_seed(seed + 100)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, length in enumerate(LENGTHS):
        mask[b, :length] = True
    batch["mask"] = mask
    batch["target_ids"] = batch["target_ids"].clamp(min=0)
    rollout = (batch["old_logps"] + drift * torch.randn(B, T, generator=g)).clamp(max=0.0)  # log-probs: <= 0
    rollout[0, 1] = batch["old_logps"][0, 1]
    if nan_tokens:
        rollout[0, 2] = float("nan")
        rollout[3, 0] = float("nan")
    batch["rollout_logps"] = rollout
    batch.pop("ref_logps", None)
    return batch


def pack(batch: dict) -> tuple[dict, torch.Tensor]:
    """The batch's responses back to back (``(N, ...)``) and ``cu_seqlens``; per-response advantages stay."""
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    packed = {name: torch.cat([value[b, :n] for b, n in enumerate(LENGTHS)]) if torch.is_tensor(value)
              and value.dim() >= 2 else value for name, value in batch.items()}
    return packed, cu


def unpack(padded: torch.Tensor) -> torch.Tensor:
    return torch.cat([padded[b, :n] for b, n in enumerate(LENGTHS)])


def linear_inputs(batch: dict, hidden_size: int = 8, seed: int = 1):
    """hidden states and a weight whose logits stand in for ``batch["logits"]`` (which it replaces)."""
    g = torch.Generator().manual_seed(seed)
    B, T, V = batch["logits"].shape
    hidden = torch.randn(B, T, hidden_size, generator=g)
    weight = torch.randn(V, hidden_size, generator=g) * 0.5
    return hidden, weight, {**batch, "logits": hidden @ weight.T}


ROUTES = ("reference", "torch", "triton", "packed", "linear", "compiled")
# Where each mode of each framework's correction is checked: every route but the Triton kernels, which take
# the stage's weights and mask as the torch twins do (test_stage.py runs one of each family on both kernel
# sets).
CORRECTION_ROUTES = tuple(route for route in ROUTES if route != "triton")


def run_route(route: str, batch: dict, **kwargs) -> tuple[dgpo_ops.PolicyLossOutput, torch.Tensor]:
    """``(output, d loss / d logits on the padded grid)`` of one route on ``batch`` (for ``linear``: the logits
    the hidden states and weight of ``linear_inputs`` make, with the gradient through them)."""
    batch = dict(batch)
    if route == "linear":
        hidden, weight, _ = linear_inputs(batch)
        batch.pop("logits")
        hidden = hidden.requires_grad_(True)
        out = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, **batch, backend="torch", **kwargs)
        out.loss.backward()
        return out, hidden.grad
    logits = batch.pop("logits").detach().clone().requires_grad_(True)
    if route == "reference":
        out = dgpo_ops.reference_loss(logits, **batch, **kwargs)
    elif route in ("torch", "triton"):
        out = dgpo_ops.fused_dgpo_loss(logits, **batch, backend=route, **kwargs)
    elif route == "packed":
        packed, cu = pack({"logits": logits, **batch})
        packed_logits = packed.pop("logits")
        out = dgpo_ops.fused_dgpo_loss(packed_logits, **packed, cu_seqlens=cu, max_seqlen=max(LENGTHS),
                                       backend="torch", **kwargs)
    elif route == "compiled":
        def call(x, rollout_logps):
            result = dgpo_ops.fused_dgpo_loss(x, **{**batch, "rollout_logps": rollout_logps}, backend="torch",
                                              **kwargs)
            return result.loss, dict(result.metrics)

        torch._dynamo.reset()  # each case's options are a new trace-time constant: a fresh cache, no recompile limit
        loss, metrics = torch.compile(call, fullgraph=True, backend="aot_eager")(logits, batch["rollout_logps"])
        loss.backward()
        return dgpo_ops.PolicyLossOutput(loss, None, None, metrics), logits.grad
    else:
        raise ValueError(route)
    out.loss.backward()
    return out, logits.grad


def assert_same_as_weights(correction, batch: dict, weights: torch.Tensor, mask: torch.Tensor, routes=ROUTES,
                           **kwargs) -> dict:
    """The call with ``rollout_correction=correction`` on each route equals the same route given the oracle's
    ``weights`` as ``rollout_weights`` and its ``mask`` (loss, gradient, per-token outputs, metrics vector);
    returns the reference route's metrics."""
    plain = {k: v for k, v in batch.items() if k != "rollout_logps"}
    plain.update(mask=mask, rollout_weights=weights.float())
    found = None
    for route in routes:
        got, got_grad = run_route(route, batch, rollout_correction=correction, **kwargs)
        want, want_grad = run_route("torch" if route == "compiled" else route, plain, **kwargs)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6, msg=lambda m, r=route: f"{r}: {m}")
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6, msg=lambda m, r=route: f"{r}: {m}")
        for name in dgpo_ops.core.metrics.METRIC_NAMES:
            torch.testing.assert_close(got.metrics[name], want.metrics[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=route, n=name: f"{r} {n}: {m}")
        if route == "reference":
            found = got.metrics
    return found
