"""Torch twins of the kernels for CPU tensors (and the tests' second opinion): the same arguments,
the same workspace outputs, computed with torch ops. The row twins work one chunk of rows at a
time, so no (N, V) fp32 temporary exists beyond one chunk. None of them reads a value on the host.
"""

from __future__ import annotations

import torch

from .interface import (FIXED_DENOMINATORS, IGNORE_INDEX, LOG_PROBABILITY_INPUTS, LOGP_ABOVE_ZERO_TOLERANCE,
                        WEIGHT_INPUTS, Denominator, InputError, Normalizer, Plane, Region, SequenceStat, Status,
                        fixed_denominator)
from .row_io import compute_dtype, on_token_grid

CHUNK_ELEMENTS = 1 << 22  # fp32 elements of one chunk (16 MiB)

# The denominators the call's scored tokens decide, from each response's count of them; each at least 1, so an
# all-masked batch gives a zero loss, not 0/0. The prologue kernel's DENOMINATOR branches are the same list.
COUNTED_DENOMINATORS = {
    Denominator.TOKENS: lambda counts: counts.sum().clamp(min=1),
    Denominator.SCORED_RESPONSES: lambda counts: (counts > 0).sum().clamp(min=1),
}


def check_denominators() -> None:
    """Every ``Denominator`` is counted here or fixed by the grid (``FIXED_DENOMINATORS``), not both (run at
    import): a new one without its size stops the import instead of reaching a call."""
    counted, fixed = set(COUNTED_DENOMINATORS), set(FIXED_DENOMINATORS)
    if counted & fixed or counted | fixed != set(Denominator):
        raise AssertionError(f"every Denominator needs one size: counted {sorted(counted)}, fixed {sorted(fixed)}, "
                             f"members {list(Denominator)}")


check_denominators()


def denominator_of(denominator: Denominator, counts: torch.Tensor, width: int, dtype: torch.dtype):
    """What an aggregation divides by without a ``loss_normalizer``, from each response's scored-token count
    ``counts`` ``(B,)`` on a grid of ``width``: a tensor of ``dtype`` where the tokens decide it, else a float."""
    if denominator in COUNTED_DENOMINATORS:
        return COUNTED_DENOMINATORS[denominator](counts).to(dtype)
    return float(max(fixed_denominator(denominator, counts.shape[0], width), 1))


def _grid_view(batch, tensor):
    """A per-token or per-response input as a (B, T) tensor (a view where the layout allows)."""
    return on_token_grid(tensor, batch.flat, batch.grid)


def _scored(batch, vocab: int, tokens: slice = slice(None)):
    """(target as int64, listed, scored, valid, in_range) of the tokens ``tokens`` of the flattened
    grid (all of them by default), each flat: the twin of ``tokens.read_targets``."""
    target = _grid_view(batch, batch.target_ids).reshape(-1)[tokens].to(torch.int64)
    listed = target != IGNORE_INDEX
    if batch.mask is not None:
        scored = listed & (_grid_view(batch, batch.mask).reshape(-1)[tokens] != 0)
    else:
        scored = listed
    in_range = (target >= 0) & (target < vocab)
    return target, listed, scored, scored & in_range, in_range


def above_zero(values: torch.Tensor) -> torch.Tensor:
    """Where log-probs ``values`` are above 0 beyond rounding (``LOGP_ABOVE_ZERO_TOLERANCE``): no framework
    produces them (probabilities, or shifted log-probs)."""
    return values > LOGP_ABOVE_ZERO_TOLERANCE


def not_log_probabilities(values: torch.Tensor) -> torch.Tensor:
    """Where ``values`` (log-probs, in the dtype they are computed in) hold no log-probability: NaN, infinite,
    or ``above_zero``; the prologue's ``_check_log_probability``."""
    return ~torch.isfinite(values) | above_zero(values)


def bad_token_values(name: str, values: torch.Tensor) -> torch.Tensor:
    """Where the per-token input ``name`` holds a value the loss cannot take: no log-probability for the log-prob
    inputs, no importance weight (NaN, infinite or below 0) for the weights (``WEIGHT_INPUTS``), a non-finite value
    for the rest; the prologue's checks."""
    if name in LOG_PROBABILITY_INPUTS:
        return not_log_probabilities(values)
    if name in WEIGHT_INPUTS:
        return ~torch.isfinite(values) | (values < 0)
    return ~torch.isfinite(values)


def token_prologue_torch(batch, sequence_stats, seq_scale, status, vocab: int, aggregation_codes,
                         normalizer, finalize=None) -> None:
    """Twin of ``token_prologue``: counts, scales and error bits, all on the device; ``finalize``: ``(workspace,
    has_kl)`` to reduce the loss and metrics into that ``RowWorkspace`` after them (``finalize_torch``)."""
    B, T = batch.grid
    per_response, denominator = aggregation_codes
    normalizer_kind, normalizer_value, normalizer_tensor = normalizer
    target, listed, scored, valid, in_range = (t.view(B, T) for t in _scored(batch, vocab))
    bad_target = listed & ~in_range
    errors = torch.where(bad_target.any(), int(InputError.TARGET_IDS), 0)
    if batch.mask is not None and batch.mask.dtype != torch.bool:
        mask = _grid_view(batch, batch.mask)
        errors = errors | torch.where(((mask != 0) & (mask != 1)).any(), int(InputError.MASK), 0)
    for name, bit in (("advantages", InputError.ADVANTAGES), ("old_logps", InputError.OLD_LOGPS),
                      ("ref_logps", InputError.REF_LOGPS), ("rollout_weights", InputError.ROLLOUT_WEIGHTS)):
        value = getattr(batch, name)
        if value is not None:  # finite where the loss is computed (fp32, or fp64 for fp64 logits)
            value = _grid_view(batch, value).to(seq_scale.dtype)
            bad = bad_token_values(name, value)
            errors = errors | torch.where((scored & bad).any(), int(bit), 0)
    counts = valid.sum(dim=1)
    total = counts.sum()
    # argmax of a boolean tensor is its first True (row-major); 0 when there is none (the bit is off then).
    if bad_target.numel():  # take: no host read
        first_bad = target.reshape(-1).take(bad_target.reshape(-1).to(torch.uint8).argmax())
        bad_value = torch.where(bad_target.any(), first_bad, 0)
    else:  # an empty batch (argmax has nothing to reduce)
        bad_value = torch.zeros((), dtype=torch.int64, device=target.device)
    dtype = seq_scale.dtype
    if normalizer_kind == Normalizer.TENSOR:
        denom = normalizer_tensor.reshape(()).to(dtype)
        errors = errors | torch.where((denom > 0) & torch.isfinite(denom), 0, int(InputError.LOSS_NORMALIZER))
    elif normalizer_kind == Normalizer.VALUE:
        denom = float(normalizer_value)
    else:
        denom = denominator_of(denominator, counts, T, dtype)
    within = 1.0 / counts.clamp(min=1).to(dtype) if per_response else torch.ones(B, dtype=dtype, device=counts.device)
    scale = within / denom
    seq_scale.copy_(torch.where(errors != 0, float("nan"), scale))
    sequence_stats[SequenceStat.TOKENS].copy_(counts)
    sequence_stats[SequenceStat.ERRORS].copy_(errors.expand(B))
    sequence_stats[SequenceStat.FIRST_BAD_TARGET].copy_(bad_value.expand(B))
    status[Status.ERRORS] = errors
    status[Status.BAD_TARGET] = bad_value
    status[Status.TOKENS] = total
    status[Status.ARRIVED] = B
    if finalize is not None:
        finalize_torch(finalize[0], max(T, 1), finalize[1])


def finalize_torch(workspace, grid_seq_len: int, has_kl: bool) -> None:
    """Twin of ``finalize``: the loss (``sum s_b TOKEN_LOSS`` over scored tokens, NaN where the prologue found an
    error) and the metrics (masked means over the scored tokens) from the epilogue's planes."""
    planes = workspace.planes()
    valid = workspace.target_index >= 0
    rows = torch.arange(workspace.n_tokens, device=valid.device)
    scale = workspace.seq_scale[rows // grid_seq_len]

    def total(values):
        return torch.where(valid, values, 0.0).sum()

    loss = total(planes[Plane.TOKEN_LOSS] * scale)
    workspace.loss.copy_(torch.where(workspace.status[Status.ERRORS] != 0, float("nan"), loss))
    count = workspace.status[Status.TOKENS].clamp(min=1).to(planes.dtype)
    region = planes[Plane.REGION]
    ratio = planes[Plane.RATIO]
    sums = [total((region == code).to(planes.dtype)) for code in (Region.LN, Region.HP, Region.LP, Region.HN,
                                                                     Region.DUAL)]
    sums += [total(ratio), total(planes[Plane.PSI] / ratio), total(planes[Plane.ENTROPY]),
             total(planes[Plane.KL]) if has_kl else torch.zeros((), dtype=planes.dtype, device=valid.device)]
    workspace.stats.copy_(torch.stack(sums) / count)


def _row_chunks(tensors: list[torch.Tensor], chunk_rows: int | None):
    """Yield (flat token slice, [(rows, V) view of each tensor]) over same-shaped ``(B, T, V)`` or
    ``(N, V)`` tensors, without copying them."""
    if tensors[0].dim() == 2:
        tensors = [t.unsqueeze(0) for t in tensors]
    B, T, V = tensors[0].shape
    chunk_rows = chunk_rows or max(1, CHUNK_ELEMENTS // max(V, 1))
    try:
        flats = [t.view(B * T, V) for t in tensors]
    except RuntimeError:  # rows not evenly strided (e.g. a [:, :-1] slice): walk each response
        for b in range(B):
            for start in range(0, T, chunk_rows):
                stop = min(start + chunk_rows, T)
                yield slice(b * T + start, b * T + stop), [t[b, start:stop] for t in tensors]
        return
    for start in range(0, B * T, chunk_rows):
        stop = min(start + chunk_rows, B * T)
        yield slice(start, stop), [f[start:stop] for f in flats]


def logprob_entropy_torch(logits, batch, workspace, inv_temperature, epilogue=None, token_offset: int = 0,
                          chunk_rows=None, vocab_split=None) -> None:
    """Twin of ``logprob_entropy``: the target index and the row planes of ``workspace`` (with ``vocab_split``,
    the row partials). ``epilogue``: called with the token slice of the rows once their planes are written, to
    evaluate the method there (``dgpo_ops.ops.epilogues``, the torch objective on those tokens)."""
    n = logits.shape[0] * (logits.shape[1] if logits.dim() == 3 else 1)
    columns = logits.shape[-1]
    vocab_start, vocab_total = vocab_split if vocab_split is not None else (0, columns)
    target, _, _, valid, _ = _scored(batch, vocab_total, slice(token_offset, token_offset + n))
    local = target - vocab_start
    owned = valid & (local >= 0) & (local < columns)
    workspace.target_index[token_offset:token_offset + n] = torch.where(valid, torch.where(owned, local, columns), -1)
    planes = workspace.planes()
    dtype = compute_dtype(logits.dtype)
    targets = workspace.target_index[token_offset:token_offset + n]
    for rows, (chunk,) in _row_chunks([logits], chunk_rows):
        x = chunk.to(dtype) * inv_temperature
        chunk_targets = targets[rows]
        values = (_row_partials(x, chunk_targets, owned[rows]) if vocab_split is not None
                  else _row_planes(x, chunk_targets))
        at = slice(token_offset + rows.start, token_offset + rows.stop)
        for plane, (value, fill) in values.items():  # a token not scored: the kernel's fill
            planes[plane, at] = torch.where(chunk_targets >= 0, value, fill).to(planes.dtype)
    if epilogue is not None:  # once for the rows of this call (a tile of the fused linear), not per chunk
        epilogue(slice(token_offset, token_offset + n))


def _row_partials(x, targets, owned) -> dict:
    """The row partials of ``logprob_entropy(..., vocab_split=...)``: max m, S = sum exp(x - m),
    U = sum exp(x - m) (x - m), and the target logit where this process holds the target."""
    top = x.amax(dim=-1)
    shift = torch.where(top == float("-inf"), 0.0, top)
    centred = x - shift[:, None]
    e = centred.exp()
    sum_exp_dx = torch.where(e > 0, e * centred, 0.0).sum(dim=-1)  # 0 * -inf is 0 here, not NaN
    index = targets.clamp(0, x.shape[-1] - 1)[:, None]
    target_logit = torch.where(owned, x.gather(1, index)[:, 0], 0.0)
    return {Plane.ROW_MAX: (top, float("-inf")), Plane.LOG_NORM: (e.sum(dim=-1), 0.0),
            Plane.ENTROPY: (sum_exp_dx, 0.0), Plane.LOGP: (target_logit, 0.0)}


def _row_planes(x, targets) -> dict:
    """The finished rows: (max, log S), the target's log-prob and the entropy."""
    index = targets.clamp(min=0)[:, None]
    log_probs = torch.log_softmax(x, dim=-1)  # one fused, vectorised pass family: the fastest CPU path
    top = x.amax(dim=-1)
    top = torch.where(top == float("-inf"), 0.0, top)
    logp = log_probs.gather(1, index)[:, 0]
    # log S, of the pair (max, log S) the backward needs, is minus the log-prob at the max (exactly:
    # x_max - max = 0). Not (x_t - max) - log p_t: that is -inf - -inf for a target logit of -inf.
    log_norm = -log_probs.amax(dim=-1)
    # p log p is 0 where p is 0 (a -inf logit), not 0 * -inf.
    entropy = -log_probs.exp().mul_(torch.where(log_probs > float("-inf"), log_probs, 0.0)).sum(dim=-1)
    return {Plane.ROW_MAX: (top, 0.0), Plane.LOG_NORM: (log_norm, 0.0), Plane.LOGP: (logp, 0.0),
            Plane.ENTROPY: (entropy, 0.0)}


def logits_grad_torch(logits, grad_logits, workspace, grid_seq_len: int, inv_temperature: float, entropy_coef: float,
                      grad_loss=None, dloss_dlogp=None, token_offset: int = 0, chunk_rows=None, dloss_dentropy=None):
    """Twin of ``logits_grad``."""
    dtype = compute_dtype(logits.dtype)
    n = logits.shape[0] * (logits.shape[1] if logits.dim() == 3 else 1)
    at = slice(token_offset, token_offset + n)
    planes = workspace.planes()[:, at].to(dtype)
    targets = workspace.target_index[at]
    valid = targets >= 0
    tokens = torch.arange(token_offset, token_offset + n, device=targets.device)
    seq_scale = workspace.seq_scale.to(dtype)[tokens // grid_seq_len]
    incoming = 1.0 if grad_loss is None else grad_loss.to(dtype)
    if dloss_dlogp is None:
        g = planes[Plane.DLOSS_DLOGP] * seq_scale * incoming
    else:
        g = dloss_dlogp.reshape(-1)[at].to(dtype) * incoming
    g = torch.where(valid, g * inv_temperature, 0.0)
    if dloss_dentropy is None:
        h = -entropy_coef * seq_scale * incoming
    else:
        h = dloss_dentropy.reshape(-1)[at].to(dtype) * incoming
    h = torch.where(valid, h * inv_temperature, 0.0)
    has_entropy_grad = entropy_coef != 0.0 or dloss_dentropy is not None
    active = (g != 0) | (h != 0)  # tokens not scored: zeros, whatever their logits
    columns = logits.shape[-1]
    owned = valid & (targets < columns)  # a split vocabulary's target index is `columns` on the other processes
    for rows, (chunk, grad_chunk) in _row_chunks([logits, grad_logits], chunk_rows):
        x = chunk.to(dtype) * inv_temperature
        log_p = x.sub_(planes[Plane.ROW_MAX, rows, None]).sub_(planes[Plane.LOG_NORM, rows, None])
        p = log_p.exp()
        index = torch.where(owned[rows], targets[rows], 0)[:, None]
        coef = g[rows, None]
        grad = -coef * p
        if has_entropy_grad:
            grad -= h[rows, None] * p * torch.where(p > 0, log_p + planes[Plane.ENTROPY, rows, None], 0.0)
        # 1 - p_target as -expm1(log p_target): no cancellation for confident tokens.
        target_grad = -coef * torch.expm1(planes[Plane.LOGP, rows, None])
        if has_entropy_grad:
            target_log_p = log_p.gather(1, index)
            target_p = target_log_p.exp()
            target_grad = target_grad - h[rows, None] * target_p * torch.where(
                target_p > 0, target_log_p + planes[Plane.ENTROPY, rows, None], 0.0)
        # the target's column where this process holds it; elsewhere column 0 keeps its own value
        grad.scatter_(1, index, torch.where(owned[rows, None], target_grad, grad.gather(1, index)))
        grad_chunk.copy_(torch.where(active[rows, None], grad, 0.0))
    return grad_logits


def scale_cast_torch(accumulator, scale, out) -> None:
    """Twin of ``scale_cast``: the product in the accumulator's dtype, rounded once to ``out``'s."""
    torch.mul(accumulator, scale, out=out)
