"""Which kernels a call runs: Triton (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``) or their
torch twins (the CPU default). Both sets take the same arguments and fill the same workspace."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from dgpo_ops.core.options import BACKENDS


@dataclass(frozen=True)
class RowKernels:
    name: str
    prologue: Callable
    forward: Callable
    backward: Callable
    finalize: Callable
    # (CallPlan, RowWorkspace) -> what the row forward takes to evaluate a token-level method where it finishes
    # its rows (the Triton kernels: EpilogueInputs; the twins: the torch objective on the rows of each call)
    epilogue: Callable
    # (accumulator, scale, out): the fused-linear backward's fp32 gradient, scaled and cast into the input's dtype
    scale_cast: Callable


@functools.cache  # TRITON_INTERPRET is read when the kernels are defined: the answer never changes
def triton_is_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from dgpo_ops.kernels.logprob_entropy import logprob_entropy_fwd_kernel

    return isinstance(logprob_entropy_fwd_kernel, InterpretedFunction)


@functools.cache  # one immutable set per backend, made once: no imports on the per-call path
def _kernel_set(name: str) -> RowKernels:
    if name == "torch":
        from dgpo_ops.kernels.torch_twins import (
            finalize_torch,
            logits_grad_torch,
            logprob_entropy_torch,
            scale_cast_torch,
            token_prologue_torch,
        )
        from dgpo_ops.ops.epilogues import TwinEpilogue

        return RowKernels("torch", token_prologue_torch, logprob_entropy_torch, logits_grad_torch, finalize_torch,
                          epilogue=TwinEpilogue, scale_cast=scale_cast_torch)
    if name == "triton":
        from dgpo_ops.kernels.finalize import finalize
        from dgpo_ops.kernels.logits_grad import logits_grad
        from dgpo_ops.kernels.logprob_entropy import logprob_entropy
        from dgpo_ops.kernels.prologue import token_prologue
        from dgpo_ops.kernels.scale_cast import scale_cast
        from dgpo_ops.ops.epilogues import epilogue_inputs

        return RowKernels("triton", token_prologue, logprob_entropy, logits_grad, finalize,
                          epilogue=lambda plan, workspace: epilogue_inputs(plan.options, workspace.per_token.device),
                          scale_cast=scale_cast)
    raise ValueError(f"no kernel set named {name!r}")


def select_kernels(backend: str, tensor: torch.Tensor) -> RowKernels:
    """The kernels for ``backend`` on ``tensor``'s device and dtype (the logits, or a tile like them)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if tensor.is_cuda else "torch"
    if backend == "torch":
        return _kernel_set("torch")
    if tensor.dtype == torch.float64:
        raise ValueError("backend='triton' supports float32, bfloat16 and float16 logits; use backend='torch' for float64")
    if not tensor.is_cuda and not triton_is_interpreted():
        raise ValueError(
            "backend='triton' on CPU tensors runs the Triton interpreter: set TRITON_INTERPRET=1 before "
            "importing dgpo_ops (or use backend='torch', the default on CPU)"
        )
    return _kernel_set("triton")
