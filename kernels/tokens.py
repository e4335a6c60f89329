"""Which tokens are scored, read straight from the caller's target ids and mask: one definition for
the prologue (which counts and checks them) and the row forward (which writes the canonical target
index the later kernels read), so neither waits for the other."""

import triton
import triton.language as tl

from . import codes


@triton.jit
def read_targets(target_ids_ptr, mask_ptr, b, t, inside, vocab, target_stride_b, target_stride_t, mask_stride_b,
                 mask_stride_t, HAS_MASK: tl.constexpr):
    """``(target, listed, kept, in_range)`` of the tokens ``(b, t)`` where ``inside``: the id as int64,
    whether it is not IGNORE_INDEX, whether the mask keeps it (and the raw mask value), and whether
    the id is inside the vocabulary. A scored token is listed, kept and in range."""
    target = tl.load(target_ids_ptr + b * target_stride_b + t * target_stride_t, mask=inside,
                     other=codes.IGNORE_INDEX).to(tl.int64)
    listed = inside & (target != codes.IGNORE_INDEX)
    keep = tl.full(t.shape, 1, tl.int32)
    if HAS_MASK:
        keep = tl.load(mask_ptr + b * mask_stride_b + t * mask_stride_t, mask=inside, other=0)
    in_range = (target >= 0) & (target < vocab)
    return target, listed, keep != 0, keep, in_range
