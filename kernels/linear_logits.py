"""On-chip fused-linear forward: each token's log-sum-exp, target logit and entropy straight from
``hidden @ weight^T``, the logits tile never written to memory (Cut Cross-Entropy's idea).

``linear_partials_kernel``: grid ``(token blocks, vocabulary splits)``. A program multiplies its
``BLOCK_N`` hidden rows by the weight rows of one ``BLOCK_V`` tile after another of its vocabulary
split (``tl.dot``, fp32 accumulation over ``BLOCK_K`` slices of H; the operands are loaded as
stored and rounded to the compute dtype in registers, so fp32 master weights under bf16 autocast
need no bf16 copy), turns the accumulator into logits in registers (bias, ``logit_scale`` or
softcap, 1 / temperature) and folds them into per-row running ``(max, S, U)`` as the row forward
does, plus the target logit where the split holds it. It writes those four numbers per row and
split: ``4 x splits`` floats per token instead of a ``V``-wide row.

``linear_rows_kernel``: one program per token merges the splits and hands the row to
``logprob_entropy.finish_row``: the same planes, and the same method epilogue, as the row forward.

Splitting the vocabulary gives the GPU enough programs when there are few token blocks; the merge
is exact up to fp32 rounding (the partial sums are rescaled to the common max as the running
update does).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .interface import cdiv, next_power_of_2
from .logprob_entropy import finish_row
from .tokens import read_targets


@triton.jit
def dot_operand(x, OPERAND: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """``x`` rounded to the compute dtype (to nearest even). ``DOT_IN_FP32`` is for the Triton
    interpreter, whose ``tl.dot`` of bf16/fp16 operands returns garbage and whose fp32 -> bf16
    conversion truncates (Triton 3.9): the value is rounded on its fp32 bits and kept in fp32 for an
    ieee product, so the products (each exact in fp32) and their fp32 sums are the compiled kernel's."""
    if DOT_IN_FP32:
        x = x.to(tl.float32)
        if OPERAND == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            x = bits.to(tl.float32, bitcast=True)
        elif OPERAND != tl.float32:
            x = x.to(OPERAND).to(tl.float32)
    else:
        x = x.to(OPERAND)
    return x


@triton.jit
def projected_logits(hidden_ptr, weight_ptr, bias_ptr, rows, cols, n_tokens, vocab, hidden_dim, stride_hn, stride_hk,
                     stride_wv, stride_wk, stride_bias, tanh_scale, out_scale, OPERAND: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     DOT_IN_FP32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """``(x, t)``: the ``BLOCK_N x BLOCK_V`` logits tile ``x`` (what the row kernels read times
    1 / temperature) and, with softcap, ``t = tanh(logit_scale y / softcap)`` (the chain rule needs it).

    ``y = hidden @ weight^T + bias`` accumulated in fp32 from operands rounded to ``OPERAND``;
    ``x = out_scale t`` with softcap, else ``out_scale y``."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for k_start in range(0, hidden_dim, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        h = tl.load(hidden_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hk,
                    mask=(rows[:, None] < n_tokens) & (ks[None, :] < hidden_dim), other=0.0)
        w = tl.load(weight_ptr + cols[:, None] * stride_wv + ks[None, :] * stride_wk,
                    mask=(cols[:, None] < vocab) & (ks[None, :] < hidden_dim), other=0.0)
        acc = tl.dot(dot_operand(h, OPERAND, DOT_IN_FP32), tl.trans(dot_operand(w, OPERAND, DOT_IN_FP32)), acc,
                     input_precision=DOT_PRECISION)
    if HAS_BIAS:
        # the bias in the compute dtype, as the tile path's GEMM adds it
        bias = tl.load(bias_ptr + cols * stride_bias, mask=cols < vocab, other=0.0)
        acc += dot_operand(bias, OPERAND, DOT_IN_FP32).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        # tanh(u) = 1 - 2 / (exp(2u) + 1): exact at both ends (exp overflow gives 1), no libdevice
        # call (the interpreter has none).
        t = 1.0 - 2.0 / (tl.exp(2.0 * tanh_scale * acc) + 1.0)
        x = out_scale * t
    else:
        # The product rounded once to the compute dtype, as the model's lm_head hands its logits over and as
        # the tile path's GEMM writes them: both paths score the same logits (old log-probs from either one
        # give on-policy ratios of 1). One conversion per element, in registers.
        acc = dot_operand(acc, OPERAND, DOT_IN_FP32).to(tl.float32)
        t = acc
        x = out_scale * acc
    return x, t


@triton.jit
def linear_partials_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    target_ids_ptr,
    mask_ptr,
    partials_ptr,
    tanh_scale,
    out_scale,
    n_tokens,
    grid_seq_len,
    vocab,
    hidden_dim,
    split_width,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    stride_bias,
    target_stride_b,
    target_stride_t,
    mask_stride_b,
    mask_stride_t,
    OPERAND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    n_splits = tl.num_programs(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    inside = rows < n_tokens
    target, listed, kept, _, in_range = read_targets(target_ids_ptr, mask_ptr, rows // grid_seq_len,
                                                     rows % grid_seq_len, inside, vocab, target_stride_b,
                                                     target_stride_t, mask_stride_b, mask_stride_t, HAS_MASK)
    target = tl.where(listed & kept & in_range, target, -1)
    row_max = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    sum_exp = tl.zeros((BLOCK_N,), tl.float32)
    sum_exp_dx = tl.zeros((BLOCK_N,), tl.float32)
    target_logit = tl.zeros((BLOCK_N,), tl.float32)
    split_start = split * split_width
    split_end = tl.minimum(split_start + split_width, vocab)
    for v_start in range(split_start, split_end, BLOCK_V):
        cols = v_start + tl.arange(0, BLOCK_V).to(tl.int64)
        x, _tanh = projected_logits(hidden_ptr, weight_ptr, bias_ptr, rows, cols, n_tokens, vocab, hidden_dim,
                                    stride_hn, stride_hk, stride_wv, stride_wk, stride_bias, tanh_scale, out_scale, OPERAND,
                                    HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, DOT_IN_FP32, BLOCK_N, BLOCK_V, BLOCK_K)
        x = tl.where(cols[None, :] < split_end, x, -float("inf"))
        target_logit += tl.sum(tl.where(cols[None, :] == target[:, None], x, 0.0), axis=1)
        # The row forward's running update, on BLOCK_N rows at once.
        new_max = tl.maximum(row_max, tl.max(x, axis=1))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        e = tl.exp(x - shift[:, None])
        rescale = tl.exp(row_max - shift)
        recentre = tl.where(sum_exp > 0.0, (row_max - shift) * sum_exp, 0.0)
        sum_exp_dx = rescale * (sum_exp_dx + recentre) + tl.sum(tl.where(e > 0.0, e * (x - shift[:, None]), 0.0),
                                                                axis=1)
        sum_exp = sum_exp * rescale + tl.sum(e, axis=1)
        row_max = new_max
    # partials: (4, splits, n_tokens) = max, S, U, target logit (0 where this split lacks the target)
    plane = n_splits * n_tokens
    at = partials_ptr + split * n_tokens + rows
    tl.store(at, row_max, mask=inside)
    tl.store(at + plane, sum_exp, mask=inside)
    tl.store(at + 2 * plane, sum_exp_dx, mask=inside)
    tl.store(at + 3 * plane, target_logit, mask=inside)


@triton.jit
def linear_rows_kernel(
    partials_ptr,
    target_ids_ptr,
    mask_ptr,
    target_index_ptr,
    per_token_ptr,
    advantages_ptr,
    old_logps_ptr,
    ref_logps_ptr,
    rollout_weights_ptr,
    method_params_ptr,
    beta,
    entropy_coef,
    n_tokens,
    grid_seq_len,
    vocab,
    n_splits,
    target_stride_b,
    target_stride_t,
    mask_stride_b,
    mask_stride_t,
    adv_stride_b,
    adv_stride_t,
    old_stride_b,
    old_stride_t,
    ref_stride_b,
    ref_stride_t,
    rw_stride_b,
    rw_stride_t,
    METHOD: tl.constexpr,
    GATE: tl.constexpr,
    HAS_EPILOGUE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_OLD_LOGPS: tl.constexpr,
    HAS_KL: tl.constexpr,
    KL_TIMES_RATIO: tl.constexpr,
    HAS_ROLLOUT_WEIGHTS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    b = token // grid_seq_len
    t = token % grid_seq_len
    target, listed, kept, _, in_range = read_targets(target_ids_ptr, mask_ptr, b, t, True, vocab, target_stride_b,
                                                     target_stride_t, mask_stride_b, mask_stride_t, HAS_MASK)
    valid = listed & kept & in_range
    tl.store(target_index_ptr + token, tl.where(valid, target, -1))
    splits = tl.arange(0, BLOCK_S)
    present = splits < n_splits
    plane = n_splits * n_tokens
    at = partials_ptr + splits * n_tokens + token
    maxes = tl.load(at, mask=present, other=-float("inf"))
    sums = tl.load(at + plane, mask=present, other=0.0)
    sums_dx = tl.load(at + 2 * plane, mask=present, other=0.0)
    row_max = tl.max(maxes, axis=0)
    shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    rescale = tl.where(sums > 0.0, tl.exp(maxes - shift), 0.0)
    # U of a split is centred on its own max: (x - m) = (x - m_s) + (m_s - m).
    sum_exp = tl.sum(rescale * sums, axis=0)
    sum_exp_dx = tl.sum(tl.where(sums > 0.0, rescale * (sums_dx + (maxes - shift) * sums), 0.0), axis=0)
    target_logit = tl.sum(tl.load(at + 3 * plane, mask=present, other=0.0), axis=0)
    finish_row(per_token_ptr, token, n_tokens, b, t, valid, row_max, sum_exp, sum_exp_dx, target_logit, advantages_ptr,
               old_logps_ptr, ref_logps_ptr, rollout_weights_ptr, method_params_ptr, beta, entropy_coef, adv_stride_b,
               adv_stride_t, old_stride_b, old_stride_t, ref_stride_b, ref_stride_t, rw_stride_b, rw_stride_t,
               METHOD, GATE, HAS_EPILOGUE, HAS_OLD_LOGPS, HAS_KL, KL_TIMES_RATIO, HAS_ROLLOUT_WEIGHTS)


@dataclass(frozen=True)
class GemmShape:
    """Tile of an on-chip fused-linear kernel: tokens x vocabulary x hidden slice, warps, stages."""

    block_n: int
    block_v: int
    block_k: int
    num_warps: int
    num_stages: int

    def fitted(self, n_tokens: int, vocab: int, hidden_dim: int) -> "GemmShape":
        """Smaller tiles for small problems (at least 16, what ``tl.dot`` needs)."""
        def fit(block, size):
            return max(16, min(block, next_power_of_2(size)))

        return GemmShape(fit(self.block_n, n_tokens), fit(self.block_v, vocab), fit(self.block_k, hidden_dim),
                         self.num_warps, self.num_stages)


# The partials' tile is a common tensor-core GEMM tile, not tuned on a GPU.
PARTIALS_SHAPE = GemmShape(block_n=128, block_v=128, block_k=32, num_warps=8, num_stages=3)
# The gradient kernel's, by the bytes per element of its operands as stored. 2 (bf16, fp16): chosen on an H100
# (csrc_notes.md, GPU run 19): its time goes to the K-loop's two products per recomputed tile, so a wider BLOCK_K
# pays (16 % of the call against the 4-byte tile) and a narrower BLOCK_V costs (every program re-reads its hidden
# rows over all of H). 4 (fp32 weights under autocast, loaded as stored and rounded in registers): that tile's fp32
# loads spill on sm_90 and need 192 KiB of shared memory, over sm_80's 163 KiB, so they keep the smaller one. Each
# compiles for sm_80 and sm_90 without spills (docs/aot_report.md).
LINEAR_GRAD_SHAPES = {2: GemmShape(block_n=128, block_v=128, block_k=64, num_warps=8, num_stages=3),
                      4: GemmShape(block_n=64, block_v=128, block_k=32, num_warps=8, num_stages=2)}


def linear_grad_shape(hidden, weight) -> GemmShape:
    """The gradient kernel's tile for these operands (the wider of the two decides)."""
    return LINEAR_GRAD_SHAPES[2 if max(hidden.element_size(), weight.element_size()) <= 2 else 4]


PROGRAMS_WANTED = 528  # enough programs for 4 per SM on a 132-SM H100; the vocabulary is split to reach it

DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class OnChipProjection:
    """How the kernels turn ``y = hidden @ weight^T + bias`` into the logits they reduce:
    ``x = out_scale tanh(tanh_scale y)`` with softcap, else ``x = out_scale y`` (temperature included)."""

    operand: torch.dtype  # what the products multiply (operands rounded to it in registers)
    out_scale: float
    tanh_scale: float
    softcap: bool

    def constexprs(self, bias) -> dict:
        interpreted = isinstance(linear_partials_kernel, InterpretedFunction)
        return dict(OPERAND=DTYPES[self.operand], HAS_BIAS=bias is not None, HAS_SOFTCAP=self.softcap,
                    # fp32 operands multiply in fp32 (torch's default, no TF32), as the tile path's GEMMs
                    DOT_PRECISION="ieee" if self.operand == torch.float32 or interpreted else "tf32",
                    DOT_IN_FP32=interpreted)


def bias_stride(bias) -> int:
    return 0 if bias is None else bias.stride(0)


def check_hidden_strides(hidden, weight) -> None:
    """The hidden-axis offsets are int32 in the products' inner loop (a unit stride, the usual case,
    is specialised away); a layout whose hidden stride times H reaches 2^31 would overflow them."""
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if tensor.stride(1) * tensor.shape[1] >= 2**31:
            raise ValueError(f"logits_on_chip=True: a {name} whose hidden-axis stride times H reaches 2^31 is not "
                             "supported: pass it .contiguous()")


def vocabulary_splits(n_tokens: int, vocab: int, shape: GemmShape) -> tuple[int, int]:
    """``(splits, split_width)``: the vocabulary cut into whole tiles so that token blocks x splits
    reaches ``PROGRAMS_WANTED``; every split holds at least one column."""
    token_blocks = cdiv(n_tokens, shape.block_n)
    vocab_tiles = cdiv(vocab, shape.block_v)
    wanted = max(1, min(vocab_tiles, cdiv(PROGRAMS_WANTED, token_blocks)))
    split_width = cdiv(vocab_tiles, wanted) * shape.block_v
    return cdiv(vocab, split_width), split_width


def on_chip_forward_planes(hidden, weight, bias, batch, workspace, projection: OnChipProjection, epilogue=None) -> None:
    """The forward planes of every token of ``batch`` (a ``RowInputs``; ``hidden`` is ``(N, H)`` in
    its token order) into ``workspace``, as ``logprob_entropy`` writes them from logits."""
    n_tokens, hidden_dim = hidden.shape
    vocab = weight.shape[0]
    check_hidden_strides(hidden, weight)
    if n_tokens == 0:
        return
    shape = PARTIALS_SHAPE.fitted(n_tokens, vocab, hidden_dim)
    splits, split_width = vocabulary_splits(n_tokens, vocab, shape)
    partials = torch.empty((4, splits, n_tokens), dtype=torch.float32, device=hidden.device)
    anchor = workspace.per_token  # a valid pointer for absent inputs (their HAS_* flag is off)

    def pointer(tensor):
        return anchor if tensor is None else tensor

    def strides(tensor):
        return (0, 0) if tensor is None else batch.strides(tensor)

    grid_seq_len = batch.grid[1]
    linear_partials_kernel[(cdiv(n_tokens, shape.block_n), splits)](
        hidden, weight, pointer(bias), batch.target_ids, pointer(batch.mask), partials,
        projection.tanh_scale, projection.out_scale, n_tokens, grid_seq_len, vocab, hidden_dim, split_width,
        *hidden.stride(), *weight.stride(), bias_stride(bias), *strides(batch.target_ids), *strides(batch.mask),
        HAS_MASK=batch.mask is not None, BLOCK_N=shape.block_n, BLOCK_V=shape.block_v, BLOCK_K=shape.block_k,
        num_warps=shape.num_warps, num_stages=shape.num_stages, **projection.constexprs(bias),
    )
    has_kl = epilogue is not None and epilogue.beta != 0.0 and batch.ref_logps is not None
    linear_rows_kernel[(n_tokens,)](
        partials, batch.target_ids, pointer(batch.mask), workspace.target_index, workspace.per_token,
        batch.advantages, pointer(batch.old_logps), pointer(batch.ref_logps), pointer(batch.rollout_weights),
        pointer(epilogue and epilogue.method_params),
        epilogue.beta if epilogue else 0.0, epilogue.entropy_coef if epilogue else 0.0,
        n_tokens, grid_seq_len, vocab, splits,
        *strides(batch.target_ids), *strides(batch.mask), *strides(batch.advantages), *strides(batch.old_logps),
        *strides(batch.ref_logps), *strides(batch.rollout_weights),
        METHOD=epilogue.method_id if epilogue else 0,
        GATE=epilogue.gate_id if epilogue else 0,
        HAS_EPILOGUE=epilogue is not None,
        HAS_MASK=batch.mask is not None,
        HAS_OLD_LOGPS=epilogue is not None and batch.old_logps is not None,
        HAS_KL=has_kl,
        KL_TIMES_RATIO=has_kl and epilogue.kl_ratio_correction,
        HAS_ROLLOUT_WEIGHTS=epilogue is not None and batch.rollout_weights is not None,
        BLOCK_S=max(2, next_power_of_2(splits)),
        num_warps=1,
    )
