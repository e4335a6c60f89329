"""``fused_linear_dgpo_loss``: the policy loss from hidden states and the lm_head weight, with the
logits never whole, and without a host-device synchronisation on CUDA.

The logits are made one token chunk at a time, as ``chunk x V`` tiles. For a token-level method
every token's loss, and so its gradient coefficient, is known as soon as its row is reduced, so
the gradient tile is formed from the same logits tile the forward GEMM just wrote: three GEMM
passes (logits, dH, dW) instead of TRL's four (its backward recomputes every tile). The gradients
are computed in the forward, each accumulator written by its first product (no zero-fill); backward
only scales them by the incoming gradient (read on the device) and casts them to each input's dtype
in one pass at copy bandwidth (``kernels/scale_cast.py``). GSPO's sequence ratio needs every token's
log-prob first, so it recomputes the tiles in a second sweep: four GEMM passes.

Precision follows the model's own ``lm_head``: the tile holds exactly the logits ``hidden @
weight.T + bias`` the model would hand to ``fused_dgpo_loss``, in the same dtype. Under
``torch.autocast`` the operands are cast to the autocast dtype; bf16 (fp16) operands give a bf16
(fp16) tile, the product accumulated in fp32 and rounded once, as cuBLAS does for the model; the
log-sum-exp and every per-token quantity are fp32. The gradient tile is written over the logits
tile in the operands' dtype, so each logit element costs 8 bytes of HBM traffic besides the GEMMs'
operand reads (2 written by the GEMM, 2 + 2 read by the row kernels, 2 written back) for bf16,
16 for fp32 (csrc_notes.md, "Memory traffic per token"). With ``softcap`` the tile is fp32 (tanh of the unrounded product).

With ``PIPELINE_TILES`` (off until a GPU run has timed it), more than one chunk and the weight multiplied whole,
the tile budget is split into two buffers and each tile's row kernels run on a side stream beside the previous
tile's gradient GEMMs (``TileSchedule``): the row kernels move bytes while the GEMMs compute. With
``OVERLAP_WEIGHT_CASTS`` (off likewise) a weight cast per vocabulary block casts the next block on that side stream
while the current one is multiplied.

Every token goes through the GEMMs (picking the unmasked ones would need their count on the
host); rows not scored read nothing in the row kernels and get a zero gradient. Peak extra memory:
the tile buffers (``memory_budget`` bytes), the fp32 gradient accumulators, one vocabulary block of
the weight cast to the compute dtype when it differs from the weight's (autocast over fp32 weights:
an eighth of ``memory_budget``, ``vocab_block_rows``, two with ``OVERLAP_WEIGHT_CASTS``; no copy of the whole
weight), and O(N) per-token vectors. ``bench/outside_gemms.py`` counts every pass outside the GEMMs and row kernels.

``logits_on_chip=True`` replaces the tiles with the Triton kernels of ``kernels/linear_logits.py``
and ``kernels/linear_grad.py``: the logits only ever in registers, operands rounded to the compute
dtype as they are loaded (no weight copy), one more pass of products, gradients summed with atomics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.core.metrics import LossMetrics
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.core.validation import refuse_double_backward
from dgpo_ops.kernels.interface import Plane
from dgpo_ops.kernels.row_io import RowWorkspace, compute_dtype
from dgpo_ops.layouts.rows import CallLayout
from dgpo_ops.ops.epilogues import epilogue_inputs
from dgpo_ops.ops.pipeline import (
    CallPlan,
    backward_rows,
    entropy_gradient,
    forward_rows,
    plan_call,
)

# cuBLAS writes an fp32 product of bf16/fp16 operands directly (torch >= 2.8, CUDA).
_HAS_FP32_OUT_MM = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Precision:
    """The dtypes of one call: GEMM operands, the logits tile, the gradient tile, accumulators."""

    operand: torch.dtype  # what the GEMMs multiply: the autocast dtype under autocast, else the weight's
    tile: torch.dtype  # the logits tile the row kernels read: the product's dtype, as the model's lm_head gives it
    grad: torch.dtype  # the gradient tile the backward row kernel writes: the operand dtype the GEMMs read
    accumulate: torch.dtype  # gradient accumulators

    @classmethod
    def resolve(cls, weight: torch.Tensor, softcap: float | None, autocast_dtype: torch.dtype | None) -> "Precision":
        if weight.dtype == torch.float64:
            return cls(torch.float64, torch.float64, torch.float64, torch.float64)
        operand = autocast_dtype if autocast_dtype in LOW_PRECISION else weight.dtype
        # softcap's tanh is taken on an fp32 tile (the product accumulated in fp32, not rounded first).
        tile = operand if softcap is None else torch.float32
        return cls(operand, tile, operand, torch.float32)


class TileProjection:
    """The GEMMs: logits tiles, and the fp32-accumulated gradients of hidden, weight and bias.

    The weight is read where it is stored: a weight already in the GEMMs' dtype is multiplied whole, and one that
    is not (autocast over fp32 weights; the CPU's fp32 products of low-precision operands) is cast one vocabulary
    block at a time (``vocab_block_rows``), where the block is multiplied, so no copy of the whole weight exists
    (the price: the fp32 weight is read once per token chunk in each GEMM that takes it: the logits, d hidden,
    and for GSPO the second sweep's logits)."""

    def __init__(self, weight, bias, precision: Precision, memory_budget: int):
        self.precision = precision
        # On CUDA the GEMMs take the operands as they are (tensor cores, fp32 accumulation). A CPU
        # matmul of bf16 rounds differently, so there the operands are rounded to the compute
        # dtype and multiplied in fp32: what a GPU GEMM accumulates.
        self.tensor_cores = weight.is_cuda and precision.operand in LOW_PRECISION and _HAS_FP32_OUT_MM
        self.gemm_dtype = precision.operand if weight.is_cuda else precision.accumulate
        self.weight = weight.detach()
        self.vocab = weight.shape[0]
        cast = weight.dtype != precision.operand or precision.operand != self.gemm_dtype
        self.block_rows = vocab_block_rows(memory_budget, weight) if cast else max(self.vocab, 1)
        self.bias = None if bias is None else bias.detach().to(precision.operand)

    def weight_blocks(self, cast: bool = True):
        """``(start, stop, block)``: the weight's vocabulary blocks in the GEMMs' dtype (rounded to the
        operand dtype first), each cast as it is reached; the whole weight, uncast, when it needs no cast.
        ``cast=False``: the ranges alone (block None), for a sweep whose products do not read the weight.
        With ``OVERLAP_WEIGHT_CASTS`` and several blocks, ``overlapped_casts``."""
        ranges = [(start, min(start + self.block_rows, self.vocab)) for start in range(0, self.vocab, self.block_rows)]
        if cast and OVERLAP_WEIGHT_CASTS and len(ranges) > 1:
            yield from self.overlapped_casts(ranges)
            return
        for start, stop in ranges:
            yield start, stop, (self.weight[start:stop].to(self.precision.operand).to(self.gemm_dtype)
                                if cast else None)

    def overlapped_casts(self, ranges):
        """The blocks of ``weight_blocks``, cast into two buffers in turn, each one block ahead: on CUDA the next
        block's cast runs on the side stream (``TileSchedule``) while the caller's stream multiplies this one, the
        memory-bound cast beside the compute-bound GEMM. A buffer is written again only after the GEMM that read
        it: the side stream waits for everything the caller's stream has queued before each cast. Elsewhere the
        casts run in order on the caller's stream, the same numbers."""
        schedule = TileSchedule(self.weight.device, slots=2)
        buffers = [torch.empty((self.block_rows, self.weight.shape[1]), dtype=self.gemm_dtype,
                               device=self.weight.device) for _ in range(2)]

        def cast_ahead(index):
            start, stop = ranges[index]
            block = buffers[index % 2][: stop - start]
            # the CPU multiplies in fp32 what the GPU multiplies in the operand dtype: rounded to it first
            source = self.weight[start:stop]
            rounded = source if self.precision.operand == self.gemm_dtype else source.to(self.precision.operand)
            return block, schedule.on_side(lambda: block.copy_(rounded))

        pending = cast_ahead(0)
        try:
            for index, (start, stop) in enumerate(ranges):
                block, done = pending
                if index + 1 < len(ranges):  # launched before this block's GEMM is queued: it runs beside it
                    pending = cast_ahead(index + 1)
                schedule.wait(done)
                yield start, stop, block
        finally:  # a sweep left early (an error): the buffers are freed only after the side stream's last cast
            schedule.join()

    def _matmul(self, a, b, out, accumulate: bool, whole_operand: bool = False):
        """``out = a @ b`` (``accumulate``: ``out += a @ b``), accumulated in ``out``'s dtype. ``whole_operand``:
        ``b`` may be the whole weight, which a GPU without fp32-output GEMMs (torch < 2.8) multiplies in its own
        dtype rather than copy to fp32 (the product, ``a``'s rows only, is what is widened)."""
        if self.tensor_cores:  # tensor-core GEMMs on operands in the compute dtype, accumulated in fp32 (as TRL)
            if accumulate:
                torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            else:
                torch.mm(a, b, out_dtype=torch.float32, out=out)
        elif whole_operand and b.dtype != out.dtype:
            product = a @ b
            out.add_(product) if accumulate else out.copy_(product)
        elif accumulate:
            out.addmm_(a.to(out.dtype), b.to(out.dtype))
        else:
            torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)

    def logits(self, hidden, out):
        """out = hidden @ weight^T + bias, accumulated in fp32, rounded once to the tile dtype."""
        hidden = hidden.to(self.precision.operand).to(self.gemm_dtype)
        for start, stop, block in self.weight_blocks():
            bias = None if self.bias is None else self.bias[start:stop]
            part = out[:, start:stop]
            if self.tensor_cores and part.dtype == torch.float32:
                if bias is not None:
                    part.copy_(bias.expand_as(part))
                self._matmul(hidden, block.t(), part, accumulate=bias is not None)
            elif part.dtype == self.gemm_dtype:  # a GEMM that writes the tile dtype itself, bias in its epilogue
                if bias is not None:
                    torch.addmm(bias.to(part.dtype), hidden, block.t(), out=part)
                else:
                    torch.mm(hidden, block.t(), out=part)
            else:  # CPU, low-precision tile: the fp32 product (and bias), rounded once
                product = hidden @ block.t()
                if bias is not None:
                    product += bias.to(product.dtype)
                part.copy_(product)

    def accumulate_grads(self, grad_tile, hidden, grad_hidden, grad_weight, grad_bias, scored=None,
                         first: bool = False):
        """grad_hidden = G @ W, grad_weight += G^T @ H, grad_bias += sum G (fp32 accumulators); ``first``: the
        first tile of the sweep writes grad_weight and grad_bias instead of adding to them, so they need no
        zero-fill. ``scored`` (the chunk's rows): the hidden states of tokens not scored are read as 0 in G^T @ H,
        where their zero gradient rows would otherwise meet whatever a padded position holds (0 x NaN is NaN)."""
        if grad_weight is not None and scored is not None:
            hidden = torch.where(scored[:, None], hidden, 0.0)
        grad_tile = grad_tile.to(self.gemm_dtype)
        hidden = hidden.to(self.precision.operand).to(self.gemm_dtype)
        for start, stop, block in self.weight_blocks(cast=grad_hidden is not None):
            part = grad_tile[:, start:stop]
            if grad_hidden is not None:  # summed over the vocabulary blocks: the first one writes
                self._matmul(part, block, grad_hidden, accumulate=start > 0, whole_operand=True)
            if grad_weight is not None:
                self._matmul(part.t(), hidden, grad_weight[start:stop], accumulate=not first)
        if grad_bias is not None:
            if first:
                torch.sum(grad_tile, dim=0, dtype=grad_bias.dtype, out=grad_bias)
            else:
                grad_bias += grad_tile.sum(dim=0, dtype=grad_bias.dtype)


def pipelined(projection: TileProjection) -> bool:
    """Whether a sweep over ``projection`` runs two tile buffers (``PIPELINE_TILES``): not where the weight is
    cast per vocabulary block, which twice the chunks would cast twice as often."""
    return PIPELINE_TILES and projection.block_rows >= projection.vocab


def vocab_block_rows(memory_budget: int, weight: torch.Tensor) -> int:
    """Rows of one weight block ``TileProjection`` casts: an eighth of the tiles' budget in fp32, at least 128."""
    rows = max(128, memory_budget // 8 // (4 * max(weight.shape[1], 1)))
    return rows - rows % 128


# True: a tile's row kernels run on a side stream beside the GEMMs of the tile before it (``TileSchedule``), over
# two tile buffers of half the budget each, where the weight is multiplied whole (a weight cast per vocabulary
# block would be cast twice as often). False: one buffer, every launch on the caller's stream, one after the
# other. Off until a GPU run has timed it against the serial sweep (the benchmark's ``ours_pipelined``; csrc_notes.md,
# "Before run 23"): its streams and events have run on no GPU yet.
PIPELINE_TILES = False

# True: where the weight is cast per vocabulary block (autocast over fp32 weights), the next block's cast runs on a
# side stream beside the current block's GEMM, into two block buffers (``TileProjection.overlapped_casts``). False:
# each block is cast on the caller's stream just before its GEMM. Off until a GPU run has timed it against the serial
# casts (the benchmark's ``ours_overlapped_casts``; csrc_notes.md, "Before run 23").
OVERLAP_WEIGHT_CASTS = False


@dataclass
class TileSlot:
    """One tile buffer: the logits tile and the gradient tile (the same memory unless the dtypes differ or
    softcap keeps the tile)."""

    logits: torch.Tensor
    grad: torch.Tensor


class Tiles:
    """The tile buffers (``slots``: two where the sweep is pipelined), and the scale the row kernels apply to what
    they read."""

    def __init__(self, n_tokens, vocab, precision: Precision, device, options: LossOptions, pipelined: bool = False):
        self.softcap = options.softcap
        self.logit_scale = options.logit_scale
        separate_grad = self.softcap is not None or precision.grad != precision.tile
        tile_bytes = torch.finfo(precision.tile).bits // 8
        grad_bytes = torch.finfo(precision.grad).bits // 8 if separate_grad else 0
        rows = max(1, min(n_tokens, options.memory_budget // (vocab * (tile_bytes + grad_bytes))))
        slots = 2 if pipelined and rows < n_tokens else 1  # one chunk has nothing to overlap
        rows = max(1, rows // slots)
        self.rows = rows if rows < 16 else rows - rows % 16

        def slot():
            logits = torch.empty((self.rows, vocab), dtype=precision.tile, device=device)
            return TileSlot(logits, torch.empty((self.rows, vocab), dtype=precision.grad, device=device)
                            if separate_grad else logits)

        self.slots = [slot() for _ in range(slots)]
        # With softcap the buffer holds t = tanh(logit_scale y / softcap) and the logits are softcap t.
        self.kernel_scale = (self.softcap if self.softcap is not None else self.logit_scale) / options.temperature

    def transform(self, tile):
        if self.softcap is not None:
            tile.mul_(self.logit_scale / self.softcap).tanh_()

    def chain_rule(self, tile, grad):
        """grad holds d loss / d (what the kernels read); make it d loss / d y."""
        if self.softcap is not None:
            grad.mul_(((1.0 - tile * tile) * (self.logit_scale / self.softcap)).to(grad.dtype))


@dataclass
class TileGradients:
    """The backward of one logits tile, shared by every tile sweep: ``rows``, the row backward kernel writes d
    loss / d logits into the gradient tile (from the workspace's planes, or from per-token coefficients) and the
    chain rule makes it d loss / d y; ``products``, the GEMMs add it into the fp32 accumulators of hidden, weight
    and bias (on CUDA the two can run on different streams: ``TileSchedule``)."""

    plan: CallPlan
    tiles: Tiles
    projection: TileProjection
    workspace: RowWorkspace
    hidden: torch.Tensor
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None
    backward_view: tuple | None = None  # RowLayout.backward_workspace, made at the first tile (after the prologue)
    entropy_grad: torch.Tensor | None = None  # pipeline.entropy_gradient of the plan's entropy weights, ditto
    written: bool = False  # a tile's products are in the accumulators (the first one writes them)

    def rows(self, start, stop, slot: TileSlot, entropy_coef: float, dloss_dlogp=None, dloss_dentropy=None):
        """The row kernels of one tile: d loss / d y into the slot's gradient tile."""
        tile, grad = slot.logits[: stop - start], slot.grad[: stop - start]
        plan = self.plan
        if self.backward_view is None:
            self.backward_view = plan.rows.backward_workspace(self.workspace, plan.grid_seq_len)
            self.entropy_grad = entropy_gradient(plan, self.backward_view)
        if dloss_dentropy is None:
            dloss_dentropy = self.entropy_grad
        backward_rows(plan.kernels, plan.options, tile, grad, self.backward_view, self.tiles.kernel_scale,
                      dloss_dlogp=dloss_dlogp, token_offset=start, dloss_dentropy=dloss_dentropy,
                      entropy_coef=entropy_coef)
        self.tiles.chain_rule(tile, grad)

    def products(self, start, stop, slot: TileSlot):
        """The GEMMs of one tile's gradient into the accumulators (the first tile's write them)."""
        self.projection.accumulate_grads(slot.grad[: stop - start], self.hidden[start:stop],
                                         None if self.grad_hidden is None else self.grad_hidden[start:stop],
                                         self.grad_weight, self.grad_bias,
                                         scored=self.workspace.target_index[start:stop] >= 0, first=not self.written)
        self.written = True

    def finish(self):
        """The accumulators of a sweep that met no tile (no token) hold zeros."""
        if not self.written:
            for grad in (self.grad_hidden, self.grad_weight, self.grad_bias):
                if grad is not None:
                    grad.zero_()


# (log-probs, entropies) -> LossInputs: a call's inputs that need the current log-probs and entropies (a trainer's
# masks, the tokens its entropy bonus acts on), from the call's own first sweep (detached, shaped like the target
# ids); the batch keeps the first one's target ids, mask and normaliser (the prologue's counts and scales).
CompleteBatch = Callable[[torch.Tensor, torch.Tensor], LossInputs]


def completing(complete_batch: CompleteBatch, batch: LossInputs, replan: Callable[[LossInputs], CallPlan]):
    """``CallPlan.complete`` from ``complete_batch``: the plan of the batch it makes from the first sweep."""
    def complete(call: CallPlan, workspace: RowWorkspace) -> CallPlan:
        planes = workspace.per_token.detach()
        shape = batch.target_ids.shape
        completed = complete_batch(planes[Plane.LOGP].reshape(shape), planes[Plane.ENTROPY].reshape(shape))
        kept = ("target_ids", "mask", "loss_normalizer")
        if any(getattr(completed, name) is not getattr(batch, name) for name in kept):
            raise ValueError("complete_batch must keep the batch's target_ids, mask and loss_normalizer (the same "
                             "objects): the first sweep counted and scaled its tokens with them")
        return replan(completed)

    return complete


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class TileSchedule:
    """Where a sweep's launches run. On CUDA with two tile buffers, each tile's row kernels run on a side stream
    (one per device, kept) once the GEMM that wrote its logits is done, while the caller's stream multiplies the
    previous tile's gradient: the memory-bound row kernels beside the compute-bound GEMMs instead of between
    them. Elsewhere (the CPU, one buffer) everything runs in order on the caller's stream."""

    def __init__(self, device: torch.device, slots: int):
        self.side = None
        if device.type == "cuda" and slots > 1:
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
            if device not in _SIDE_STREAMS:
                _SIDE_STREAMS[device] = torch.cuda.Stream(device)
            self.side = _SIDE_STREAMS[device]

    def on_side(self, launch: Callable[[], None]):
        """``launch()`` after everything queued so far on the caller's stream; a handle for ``after``."""
        if self.side is None:
            launch()
            return None
        main = torch.cuda.current_stream(self.side.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            launch()
            done = torch.cuda.Event()
            done.record(self.side)
        return done

    def wait(self, done) -> None:
        """The caller's stream waits for the side-stream work of ``done`` (an ``on_side`` handle)."""
        if done is not None:
            torch.cuda.current_stream(self.side.device).wait_event(done)

    def after(self, done, launch: Callable[[], None]) -> None:
        """``launch()`` on the caller's stream once the side-stream work of ``done`` is finished."""
        self.wait(done)
        launch()

    def join(self) -> None:
        """The caller's stream waits for all the side stream ran (before anything reads or frees its results)."""
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)


def sweep_tiles(hidden, projection, tiles: Tiles, rows, products=None):
    """Each token chunk's logits tile, made by the GEMM and handed to ``rows(start, stop, slot)`` (the row kernels);
    then ``products(start, stop, slot)`` (the GEMMs that read its gradient), if given. With two slots a tile's
    products come after the next tile's logits, so that its row kernels run beside them (``TileSchedule``)."""
    slots = tiles.slots
    schedule = TileSchedule(hidden.device, len(slots))
    pending = None  # (start, stop, slot, done) of the tile whose products are still to run
    for index, start in enumerate(range(0, hidden.shape[0], tiles.rows)):
        stop = min(start + tiles.rows, hidden.shape[0])
        slot = slots[index % len(slots)]
        tile = slot.logits[: stop - start]
        projection.logits(hidden[start:stop], out=tile)
        tiles.transform(tile)
        done = schedule.on_side(lambda start=start, stop=stop, slot=slot: rows(start, stop, slot))
        if products is not None:
            if len(slots) == 1:
                products(start, stop, slot)
            else:
                if pending is not None:
                    schedule.after(pending[3], lambda p=pending: products(*p[:3]))
                pending = (start, stop, slot, done)
    if pending is not None:
        schedule.after(pending[3], lambda: products(*pending[:3]))
    schedule.join()


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in force for ``device`` now (None without autocast)."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def on_chip_forward_pass(hidden, weight, bias, call: CallPlan, wants, compute_autocast: torch.dtype | None,
                         zero_planes: bool = False):
    """``linear_forward_pass`` with ``logits_on_chip``: the logits only ever in the kernels' registers.
    A token-level method: partials + rows kernels (the epilogue in the latter), the prologue's scales,
    then one gradient kernel that recomputes each tile and multiplies its gradient into the fp32
    accumulators. GSPO: the torch objective between the two, as on the tile path."""
    from dgpo_ops.kernels.linear_grad import linear_grads
    from dgpo_ops.kernels.linear_logits import OnChipProjection, on_chip_forward_planes

    options = call.options
    softcap, logit_scale = options.softcap, options.logit_scale
    operand = compute_autocast if compute_autocast in LOW_PRECISION else weight.dtype
    projection = OnChipProjection(operand, (softcap if softcap is not None else logit_scale) / options.temperature,
                                  logit_scale / softcap if softcap is not None else 1.0, softcap is not None)
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are ours to choose, as on the tile path
        token_shape = (hidden.shape[0],) if call.inputs.flat else call.inputs.grid
        workspace = RowWorkspace.allocate(token_shape, call.inputs.grid[0], hidden.device, torch.float32, zero_planes)
        epilogue = epilogue_inputs(options, hidden.device) if call.uses_epilogue else None

        def sweep(_row_forward):  # the on-chip kernels make the logits and reduce the rows themselves
            on_chip_forward_planes(hidden, weight, bias, call.inputs, workspace, projection, epilogue)

        result = forward_rows(call, workspace, sweep, "fused_linear_dgpo_loss", prologue_first=True)
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) if wanted else None
                 for t, wanted in zip((hidden, weight, bias), wants)]
        if call.needs_grad:
            linear_grads(hidden, weight, bias, workspace, call.grid_seq_len, projection, options.entropy_coef,
                         *grads, dloss_dlogp=result.dloss_dlogp,
                         dloss_dentropy=entropy_gradient(result.plan, (workspace, call.grid_seq_len)))
    return result.loss, workspace.per_token, result.stats, *grads


def linear_forward_pass(hidden, weight, bias, call: CallPlan, wants, compute_autocast: torch.dtype | None,
                        zero_planes: bool = False):
    """The sweep of one call: ``(loss, per_token, stats, grad_hidden, grad_weight, grad_bias)``, the
    gradients fp32 (fp64) accumulators of the inputs ``wants`` names (None for the others).
    ``compute_autocast`` is the autocast dtype the call was made under (None: none)."""
    options = call.options
    if options.logits_on_chip:
        return on_chip_forward_pass(hidden, weight, bias, call, wants, compute_autocast, zero_planes)
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    precision = Precision.resolve(weight, options.softcap, compute_autocast)
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are ours to choose
        projection = TileProjection(weight, bias, precision, options.memory_budget)
        tiles = Tiles(max(n_tokens, 1), vocab, precision, hidden.device, options, pipelined(projection))
        workspace = RowWorkspace.allocate(call.rows.token_shape, call.inputs.grid[0], hidden.device,
                                          compute_dtype(precision.tile), zero_planes)
        accumulate = precision.accumulate

        def accumulator(t, wanted):  # written by the first tile's products (TileGradients.finish: no tile)
            return torch.empty(t.shape, dtype=accumulate, device=t.device) if wanted else None

        grad_hidden, grad_weight, grad_bias = (accumulator(t, w) for t, w in zip((hidden, weight, bias), wants))
        gradients = TileGradients(call, tiles, projection, workspace, hidden, grad_hidden, grad_weight, grad_bias)

        # The coefficients of a token-level method are known after the row forward: the gradient of each tile
        # is made in the same sweep.
        gradient_in_first_sweep = call.needs_grad and call.uses_epilogue

        def sweep(row_forward):
            def first_rows(start, stop, slot):
                row_forward(slot.logits[: stop - start], tiles.kernel_scale, start)
                if gradient_in_first_sweep:
                    gradients.rows(start, stop, slot, options.entropy_coef)

            sweep_tiles(hidden, projection, tiles, first_rows, gradients.products if gradient_in_first_sweep else None)

        result = forward_rows(call, workspace, sweep, "fused_linear_dgpo_loss", prologue_first=True)
        if call.needs_grad and not call.uses_epilogue:
            # The objective's coefficients are known only now: a second sweep recomputes the tiles (with the
            # inputs CallPlan.complete made from the first, where the call has it).
            gradients = dataclasses.replace(gradients, plan=result.plan, backward_view=None)
            sweep_tiles(hidden, projection, tiles, lambda start, stop, slot: gradients.rows(
                start, stop, slot, options.entropy_coef, dloss_dlogp=result.dloss_dlogp), gradients.products)
        if call.needs_grad:
            gradients.finish()
        call.rows.reduce_hidden_grad(grad_hidden)
    return result.loss, workspace.per_token, result.stats, grad_hidden, grad_weight, grad_bias


class FusedLinearPolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, plan: CallPlan):
        """``hidden`` is ``(n_tokens, H)``, in the token order of the call's grid."""
        ctx.set_materialize_grads(False)
        wants = [plan.needs_grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
        loss, per_token, stats, *grads = linear_forward_pass(hidden, weight, bias, plan, wants,
                                                             autocast_dtype(hidden.device))
        ctx.save_for_backward(*grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.scale_cast = plan.kernels.scale_cast
        ctx.mark_non_differentiable(per_token, stats)
        return loss, per_token, stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_per_token, _grad_stats):
        refuse_double_backward("fused_linear_dgpo_loss")
        # On CUDA an accumulator in the input's dtype is scaled in place and handed over: no copy of
        # the weight-sized gradient, and no host read of the incoming gradient to skip a unit scale.
        # It can be handed over once; elsewhere (CPU, gradcheck) every backward scales a copy.
        in_place = grad_loss is not None and grad_loss.is_cuda
        if in_place and getattr(ctx, "handed_over", False):
            raise RuntimeError(
                "fused_linear_dgpo_loss on CUDA computes its gradients in the forward and hands them over, "
                "scaled in place, in its first backward; a second backward through the same graph "
                "(retain_graph=True) is not supported: call the op again")
        ctx.handed_over = True
        grads = []
        for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            if grad is None or grad_loss is None:
                grads.append(None)
            elif dtype == grad.dtype:
                grads.append(grad.mul_(grad_loss) if in_place else grad * grad_loss)
            else:
                # Scaled and cast in one pass at copy bandwidth (kernels/scale_cast.py); the incoming gradient
                # stays on the device.
                out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
                ctx.scale_cast(grad, grad_loss.reshape(1), out)
                grads.append(out)
        return (*grads, None)


def flatten_tokens(hidden, weight, bias):
    if not torch.is_tensor(hidden) or hidden.dim() not in (2, 3):
        raise ValueError("hidden must be a tensor of shape (B, T, H) or (N, H)")
    if not torch.is_tensor(weight) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        shape = tuple(weight.shape) if torch.is_tensor(weight) else type(weight).__name__
        features = hidden.shape[-1]
        if torch.is_tensor(weight) and weight.dim() == 2 and weight.shape[0] == features:
            # hidden's last axis is the weight's first: a vocabulary (the larger axis, mostly) or a transpose
            if features > weight.shape[1]:
                raise ValueError(f"hidden must have shape (B, T, H) or (N, H) with H = {weight.shape[1]}, "
                                 f"the weight's (V, H) = {shape}; got {tuple(hidden.shape)}, whose last axis "
                                 "is the vocabulary: for logits use fused_dgpo_loss (policy_loss(..., "
                                 "logits=...))")
            raise ValueError(f"weight must have shape (V, H) = (V, {features}), the lm_head's weight (V "
                             f"rows, one per token); got {shape}, its transpose: pass lm_head.weight, not "
                             "lm_head.weight.T")
        raise ValueError(f"weight must have shape (V, {features}) for hidden of shape {tuple(hidden.shape)} "
                         f"(H = {features}), got {shape}")
    if weight.dtype != hidden.dtype and not torch.is_autocast_enabled(hidden.device.type):
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype "
                         "(or run under torch.autocast, which casts both)")
    if weight.device != hidden.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if bias is not None and (not torch.is_tensor(bias) or bias.shape != weight.shape[:1] or bias.device != weight.device):
        raise ValueError(f"bias must be a tensor of shape ({weight.shape[0]},) on {weight.device}")
    if bias is not None and bias.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        # as torch.nn.functional.linear refuses it: the op would round the bias to the weight's dtype unasked
        raise ValueError(f"bias ({bias.dtype}) and weight ({weight.dtype}) must have the same dtype "
                         "(or run under torch.autocast, which casts both)")
    logits_shape = torch.Size((*hidden.shape[:-1], weight.shape[0]))
    return hidden.reshape(-1, hidden.shape[-1]), logits_shape


def linear_plan(logits_shape, weight, batch: LossInputs, options: LossOptions, needs_grad: bool, checked: bool = True,
                layout: CallLayout = CallLayout(), complete_batch: CompleteBatch | None = None) -> CallPlan:
    """The call's plan from metadata; ``checked`` also checks the values (False: the fake
    implementation of the compiled op, which has no values). ``complete_batch``: see ``CompleteBatch``."""
    if complete_batch is not None:
        if not layout.is_default:
            raise ValueError("complete_batch is not supported with vocab_parallel_group or cu_seqlens yet")
        first = linear_plan(logits_shape, weight, batch, options, needs_grad, checked, layout)
        complete = completing(complete_batch, batch, lambda completed: linear_plan(
            logits_shape, weight, completed, options, needs_grad, checked, layout))
        return dataclasses.replace(first, complete=complete)
    if options.logits_on_chip and not layout.is_default:
        raise ValueError("logits_on_chip=True does not take vocab_parallel_group or cu_seqlens yet: pass "
                         "logits_on_chip=False (the tile path runs every layout)")
    tile_probe = torch.empty(0, dtype=compute_dtype(weight.dtype),
                             device=weight.device)
    if options.logits_on_chip and weight.dtype == torch.float64:
        raise ValueError("logits_on_chip=True multiplies float32, bfloat16 or float16 weights; float64 weights "
                         "take the tile path (logits_on_chip=False)")
    call = plan_call(logits_shape[:-1], logits_shape[-1], weight.dtype, weight.device, batch, options, tile_probe,
                     needs_grad, layout, checked)
    if options.logits_on_chip and call.kernels.name != "triton":
        raise ValueError("logits_on_chip=True runs Triton kernels: pass CUDA tensors, or backend='triton' with "
                         "TRITON_INTERPRET=1 on the CPU")
    return call


def linear_loss(hidden, weight, bias, batch: LossInputs, options: LossOptions, layout: CallLayout = CallLayout(),
                complete_batch: CompleteBatch | None = None) -> PolicyLossOutput:
    """The fused-linear op, eager, on every layout: ``weight`` and ``bias`` plain tensors, this process's rows
    with a split vocabulary (``dgpo_ops.api`` routes the head module and compiled calls). ``complete_batch``
    (padded or flat tokens): inputs made from the call's own first sweep of log-probs and entropies, so that
    they cost no sweep of their own (``CompleteBatch``)."""
    flat_hidden, logits_shape = flatten_tokens(hidden, weight, bias)
    if options.inplace:
        raise ValueError("inplace applies to fused_dgpo_loss; the linear op never holds whole logits")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    plan = linear_plan(logits_shape, weight, batch, options, needs_grad, layout=layout, complete_batch=complete_batch)
    loss, per_token, stats = FusedLinearPolicyLossFunction.apply(flat_hidden, weight, bias, plan)
    loss = loss.to(compute_dtype(weight.dtype))
    return PolicyLossOutput(loss, per_token[Plane.LOGP], per_token[Plane.ENTROPY], LossMetrics(stats))
