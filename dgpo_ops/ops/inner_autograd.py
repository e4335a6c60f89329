"""Autograd inside an op, on its O(N) per-token vectors: the torch objective's derivative with respect to the
log-probs (the objective route and the torch twins' epilogue), never on a vocabulary-sized tensor."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def autograd_on_vectors():
    """Autograd on O(N) per-token vectors inside an op. Inside the custom op of a compiled call
    (dgpo_ops.ops.compiled) the dispatcher has autograd excluded below the op's own autograd node: re-admit it."""
    with torch.enable_grad(), torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False):
        yield
