"""Scale-and-cast kernel: ``out = (accumulator * grad_loss[0]).to(out.dtype)``, the fused-linear op's backward.

The op computes the gradients of hidden, weight and bias in its forward, in fp32 accumulators; its backward
multiplies each by the incoming gradient (a one-element device tensor, never read on the host) and casts it to the
input's dtype. An element-wise ``torch.mul`` into an output of another dtype takes CUDA's dynamic-casting path,
which does not vectorise its loads and stores (about 1.4 TB/s on an H100, under half of copy bandwidth); this
kernel reads 4 bytes and writes 2 per element in 16-byte vectors, a copy's traffic. The product is taken in fp32
and rounded once to the output dtype (round to nearest even), as the ``torch.mul`` it replaces.
"""

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .interface import cdiv
from .linear_logits import dot_operand

BLOCK = 4096  # elements per program: 16 KB read, 8 KB written (bf16) by 4 warps in 16-byte vectors
NUM_WARPS = 4


@triton.jit
def scale_cast_kernel(accumulator_ptr, scale_ptr, out_ptr, n_elements, ROUND_IN_FP32: tl.constexpr,
                      BLOCK: tl.constexpr):
    # int64 offsets: a weight-sized accumulator can exceed 2^31 elements
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n_elements
    scale = tl.load(scale_ptr).to(tl.float32)
    value = tl.load(accumulator_ptr + offsets, mask=in_bounds, other=0.0) * scale
    # rounded to nearest even (cvt.rn compiled; on the fp32 bits under the interpreter, which truncates)
    rounded = dot_operand(value, out_ptr.dtype.element_ty, ROUND_IN_FP32)
    tl.store(out_ptr + offsets, rounded.to(out_ptr.dtype.element_ty), mask=in_bounds)


def scale_cast(accumulator, scale, out) -> None:
    """``out[...] = accumulator * scale`` rounded to ``out``'s dtype; both contiguous, of one shape; ``scale`` a
    one-element tensor on their device."""
    if not (accumulator.is_contiguous() and out.is_contiguous() and accumulator.shape == out.shape
            and scale.numel() == 1):
        raise ValueError(f"scale_cast takes a contiguous accumulator and output of one shape and a one-element "
                         f"scale, got {tuple(accumulator.shape)} (contiguous {accumulator.is_contiguous()}), "
                         f"{tuple(out.shape)} (contiguous {out.is_contiguous()}), {scale.numel()} elements")
    n_elements = accumulator.numel()
    if n_elements:
        scale_cast_kernel[(cdiv(n_elements, BLOCK),)](
            accumulator, scale, out, n_elements, ROUND_IN_FP32=isinstance(scale_cast_kernel, InterpretedFunction),
            BLOCK=BLOCK, num_warps=NUM_WARPS)
