"""Checks and layouts of the loss inputs, shared by every backend.

Three steps, each usable alone:

* ``token_inputs``: the structure (shapes, dtypes, devices) on the host, from tensor metadata only
  (``check_structure``), and the inputs laid on the grid (``row_inputs``); it launches nothing and never
  reads a value.
* ``check_values``: the values (target ids in range, a 0/1 mask, finite per-token floats) with torch
  ops and host reads, raising ``ValueError`` at once. On CUDA tensors this synchronises, so by
  default it runs only on the CPU; on CUDA the prologue kernel checks the values on the device
  instead, and ``objective_input_errors`` those of the floats it does not read (``dgpo_ops.core.validation``).
* ``canonical_batch``: the contiguous fp32 ``(B, T)`` layout the torch objective works on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, NamedTuple, get_type_hints

import torch

from dgpo_ops.core.aggregation import (
    check_normalizer_form,
    check_normalizer_value,
    token_level,
    token_scales,
)
from dgpo_ops.core.validation import MESSAGES
from dgpo_ops.kernels.interface import IGNORE_INDEX, InputError, Normalizer
from dgpo_ops.kernels.row_io import RowInputs, compute_dtype, on_token_grid
from dgpo_ops.kernels.torch_twins import bad_token_values
from dgpo_ops.methods.table import METHODS

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class TokenFloat:
    """The mark of a ``LossInputs`` field that holds a float per token: the shape of the logits' token axes,
    or with ``per_response`` also one value per response (``(B,)``, ``(n_seqs,)`` packed), the same on its
    tokens. The mark is all a new one needs outside its own math: every route then checks its structure and
    its finite values on scored tokens (on the host, or on the device under deferred validation), pads it
    for packed sequences, lays it on the grid (``RowInputs``, ``TokenBatch``) and passes it through the
    compiled ops. The kernels read the fields ``RowInputs`` names; the others reach the torch objective
    only."""

    per_response: bool = False


class LossInputs(NamedTuple):
    """One call's tensors as the caller passed them (its options are ``LossOptions``): the public functions take
    them as arguments, ``dgpo_ops.policy_loss`` and everything below it this one object (a tuple: made on every
    call, it must cost nothing). Each field is described once, in ``dgpo_ops.core.docstrings.ARGUMENTS`` (the
    public functions' docstrings). ``token_inputs`` checks their structure, ``check_values`` (or the prologue
    kernel) their values."""

    target_ids: torch.Tensor
    advantages: Annotated[torch.Tensor, TokenFloat(per_response=True)]
    mask: torch.Tensor | None = None
    old_logps: Annotated[torch.Tensor | None, TokenFloat()] = None
    ref_logps: Annotated[torch.Tensor | None, TokenFloat()] = None
    rollout_weights: Annotated[torch.Tensor | None, TokenFloat()] = None
    loss_normalizer: float | torch.Tensor | None = None
    generator: torch.Generator | None = None  # what a random token selection draws from (clip_cov)
    # the inference engine's per-token log-probs: read by the rollout-correction stage (dgpo_ops.corrections),
    # which runs before every route and hands them on as rollout_weights and a mask, never further
    rollout_logps: torch.Tensor | None = None
    # each response's score (its reward), for the methods that split responses by its sign (topr); no gradient
    scores: Annotated[torch.Tensor | None, TokenFloat(per_response=True)] = None
    # w_t of an entropy term outside the aggregation, loss -= sum over scored t of w_t H_t (TRL's entropy bonus,
    # with its own tokens and normaliser); fused ops on padded or flat tokens, eager (dgpo_ops.ops.pipeline)
    entropy_weights: torch.Tensor | None = None
    # packed (padding-free) sequences: their boundaries, and the longest (None: read from cu_seqlens)
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None

    def tensors(self) -> tuple:
        """The tensors the custom ops of ``dgpo_ops.ops.compiled`` take (``OP_TENSORS``), in their order."""
        return tuple(getattr(self, name) for name in OP_TENSORS)


def _token_floats() -> dict[str, TokenFloat]:
    hints = get_type_hints(LossInputs, include_extras=True)
    return {name: mark for name in LossInputs._fields
            for mark in getattr(hints[name], "__metadata__", ()) if isinstance(mark, TokenFloat)}


# The fields marked TokenFloat, in field order, and those the kernels read (RowInputs' own fields); the others
# travel in RowInputs.objective_inputs and TokenBatch.objective_inputs, by name, to the torch objective.
TOKEN_FLOATS: dict[str, TokenFloat] = _token_floats()
KERNEL_FLOATS = tuple(name for name in TOKEN_FLOATS if name in {f.name for f in fields(RowInputs)})
OBJECTIVE_FLOATS = tuple(name for name in TOKEN_FLOATS if name not in KERNEL_FLOATS)
# The fields that cross the boundary of the torch.compile custom ops (dgpo_ops.ops.compiled), whose schemas
# are made from this list: the target ids, the mask and every per-token float. The others are spent before
# the ops (rollout_logps, by the correction stage) or not taken by them (cu_seqlens and entropy_weights are
# refused under compile; the generator stays on the host).
OP_TENSORS = tuple(name for name in LossInputs._fields
                   if name in ("target_ids", "mask") or name in TOKEN_FLOATS)
# The fields of RowInputs that are fields of LossInputs too (the target ids, the mask, the floats the kernels read).
_ROW_FIELDS = tuple(f.name for f in fields(RowInputs) if f.name in LossInputs._fields)


@dataclass
class TokenBatch:
    """Per-token inputs on a ``(B, T)`` grid (``(1, N)`` for flat ``(N, V)`` logits), contiguous, in
    the per-token compute dtype. Positions not scored hold 0 in every per-token tensor, so nothing
    non-finite from a padded position can reach a loss or a gradient."""

    target_ids: torch.Tensor  # int64, -100 (and masked or out-of-range ids) replaced by 0
    mask: torch.Tensor  # bool: the token is scored
    advantages: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    rollout_weights: torch.Tensor | None
    scale: torch.Tensor  # s_t, 0 on tokens not scored
    flat: bool  # the caller passed (N, V) logits: outputs are (N,)
    # the other per-token floats (OBJECTIVE_FLOATS: each response's score), by name, None where not passed
    objective_inputs: dict[str, torch.Tensor | None]

    def unflatten(self, per_token: torch.Tensor) -> torch.Tensor:
        return per_token.reshape(-1) if self.flat else per_token.reshape(self.mask.shape)


def check_generator(generator, device) -> None:
    """A ``torch.Generator`` on the logits' device, or None. Keys drawn on another device would be copied over,
    and a copy from the host blocks until the device has caught up: a synchronisation on every call."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != torch.device(device).type:
        raise ValueError(f"generator is on {generator.device} but logits are on {device}: pass a generator on the "
                         f"logits' device, torch.Generator(device={str(device)!r})")
    if torch.compiler.is_compiling():  # the compiled ops are custom ops whose schema takes no generator
        raise ValueError("generator is not supported under torch.compile: a random selection draws from torch's "
                         "default generator there (seed it with torch.manual_seed)")


def _check_float_input(name, value, grid_shape, device, allow_per_response, source="logits"):
    if value is None:
        return None
    if not torch.is_tensor(value):
        raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but {source} are on {device}")
    if allow_per_response and value.shape == grid_shape[:1]:
        return value.detach()
    if value.shape != grid_shape:
        wanted = f"{tuple(grid_shape)}" + (f" or {tuple(grid_shape[:1])}" if allow_per_response else "")
        raise ValueError(f"{name} must have shape {wanted}, got {tuple(value.shape)}")
    return value.detach()


def refuse_flat_source(source: str, shape, target_ids, axis: str = "V") -> None:
    """The error of a 2-D ``source`` (logits, or hidden states with ``axis`` "H") beside ``(B, T)`` target
    ids: the source is what is wrong (it lacks its last axis, or a token axis), so it is named, not the target
    ids its shape would ask for."""
    if len(shape) != 2 or not torch.is_tensor(target_ids) or target_ids.dim() != 2:
        return
    per_token = " (per-token values, not logits over the vocabulary)" if \
        axis == "V" and target_ids.shape == torch.Size(shape) else ""
    raise ValueError(f"{source} must have shape (B, T, {axis}) for target_ids of shape (B, T) = "
                     f"{tuple(target_ids.shape)}, got {tuple(shape)}{per_token}: pass (B, T, {axis}) "
                     f"{source}, or flat (N, {axis}) {source} with (N,) target_ids")


def token_inputs(logits_shape, logits_dtype, device, batch: LossInputs, aggregation="token_mean",
                 sequence_reason: str | None = None, source: str = "logits") -> RowInputs:
    """Check every input's structure against the logits' shape ``(B, T, V)`` or ``(N, V)`` (``check_structure``)
    and lay the inputs on the grid (``row_inputs``)."""
    grid, flat = check_structure(logits_shape, logits_dtype, device, batch, aggregation, sequence_reason, source)
    return row_inputs(batch, grid, flat)


def row_inputs(batch: LossInputs, grid: tuple[int, int], flat: bool) -> RowInputs:
    """The call's tensors as the kernels read them, on the ``(B, T)`` ``grid`` (``(1, N)`` when ``flat``), from
    inputs whose structure ``check_structure`` passed: nothing checked, copied or converted, and detached where
    they carry a graph (a tensor that needs no gradient has none, and its ``detach`` would only cost a tensor)."""
    kernel_fields = {name: _without_graph(getattr(batch, name)) for name in _ROW_FIELDS}
    return RowInputs(grid, flat, **kernel_fields,
                     objective_inputs={name: _without_graph(getattr(batch, name)) for name in OBJECTIVE_FLOATS})


def _without_graph(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.detach() if tensor is not None and tensor.requires_grad else tensor


def check_structure(logits_shape, logits_dtype, device, batch: LossInputs, aggregation="token_mean",
                    sequence_reason: str | None = None, source: str = "logits") -> tuple[tuple[int, int], bool]:
    """Check every input's structure against the logits' shape ``(B, T, V)`` or ``(N, V)``, from metadata alone:
    ``(grid, flat)``. ``sequence_reason``: why the call needs each response's tokens together
    (``LossOptions.sequence_reason``), None where it does not; ``source``: what the errors call the tensor the
    shape is read from (the log-prob route's ``logps`` pass as ``(B, T, 1)`` logits)."""
    target_ids, advantages, mask = batch.target_ids, batch.advantages, batch.mask
    if len(logits_shape) not in (2, 3):
        raise ValueError(f"logits must have shape (B, T, V) or (N, V), got {tuple(logits_shape)}")
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"{source} dtype must be one of float32, bfloat16, float16 (float64 on CPU), "
                         f"got {logits_dtype}")
    if logits_shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary axis")
    flat = len(logits_shape) == 2
    check_generator(batch.generator, device)
    if flat and (sequence_reason is not None or not token_level(aggregation)):
        reason = sequence_reason if sequence_reason is not None else f"aggregation {aggregation!r}"
        own = [name for name, spec in METHODS.items() if spec.aggregation == aggregation]
        if sequence_reason is None and own:  # the aggregation may be the method's own, not one the caller passed
            reason += f" (the own aggregation of {', '.join(own)}, taken where none is passed: pass aggregation='token_mean')"
        raise ValueError(f"flat (N, V) logits carry no response structure: use (B, T, V) logits for {reason}")
    token_shape = torch.Size(logits_shape[:-1])
    grid = (1, logits_shape[0]) if flat else (logits_shape[0], logits_shape[1])

    if not torch.is_tensor(target_ids) or target_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("target_ids must be an int64 or int32 tensor")
    if target_ids.shape != token_shape:
        refuse_flat_source(source, logits_shape, target_ids)
        raise ValueError(f"target_ids must have shape {tuple(token_shape)}, got {tuple(target_ids.shape)}")
    if target_ids.device != device:
        raise ValueError(f"target_ids is on {target_ids.device} but {source} are on {device}")
    if mask is not None:
        if not torch.is_tensor(mask) or mask.shape != token_shape:
            shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
            raise ValueError(f"mask must have shape {tuple(token_shape)}, got {shape}")
        if mask.device != device:
            raise ValueError(f"mask is on {mask.device} but {source} are on {device}")
        if mask.is_complex():
            raise ValueError(f"mask must be boolean, integer or floating point, got {mask.dtype}")
    if advantages is None:
        raise ValueError("advantages are required")
    for name, mark in TOKEN_FLOATS.items():
        _check_float_input(name, getattr(batch, name), token_shape, device,
                           allow_per_response=mark.per_response and not flat, source=source)
    return grid, flat


def token_float(inputs: RowInputs, name: str) -> torch.Tensor | None:
    """The per-token float ``name`` of ``inputs``, a field the kernels read or one of its objective inputs."""
    return inputs.objective_inputs[name] if name in OBJECTIVE_FLOATS else getattr(inputs, name)


def normalizer_spec(loss_normalizer, device) -> tuple[Normalizer, float, torch.Tensor | None]:
    """How ``loss_normalizer`` reaches the kernels: absent, a checked number, or a one-element device
    tensor read (and checked) on the device. Host numbers and CPU tensors are checked here."""
    if loss_normalizer is None:
        return Normalizer.ABSENT, 0.0, None
    check_normalizer_form(loss_normalizer)
    if torch.is_tensor(loss_normalizer):
        if loss_normalizer.device == device:  # read on the device, by the kernels
            tensor = _without_graph(loss_normalizer)
            return Normalizer.TENSOR, 0.0, tensor if tensor.dim() == 0 else tensor.reshape(())
        if loss_normalizer.device.type != "cpu":
            raise ValueError(f"loss_normalizer is on {loss_normalizer.device} but logits are on {device}")
        loss_normalizer = loss_normalizer.detach().reshape(()).item()  # a CPU tensor beside GPU logits: no device sync
    check_normalizer_value(loss_normalizer)
    return Normalizer.VALUE, float(loss_normalizer), None


def check_values(inputs: RowInputs, vocab: int, loss_normalizer=None, dtype=torch.float32) -> None:
    """Check the values now (host reads: a sync on CUDA tensors), with the errors the prologue
    kernel would report later. Per-token floats must be finite in the per-token compute ``dtype``
    (fp32, or fp64 for fp64 logits): an fp64 1e39 would be inf where the loss is computed; log-prob inputs
    (``LOG_PROBABILITY_INPUTS``) also at most 0, beyond rounding, and weights (``WEIGHT_INPUTS``) at least 0
    (``bad_token_values``)."""
    target_ids = inputs.target_ids
    out_of_range = (target_ids != IGNORE_INDEX) & ((target_ids < 0) | (target_ids >= vocab))
    if out_of_range.any():
        bad = target_ids[out_of_range][0].item()
        raise ValueError(MESSAGES[InputError.TARGET_IDS].format(vocab=vocab, ignore=IGNORE_INDEX, bad_target=bad))
    mask = inputs.mask
    if mask is not None and mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():
        raise ValueError(MESSAGES[InputError.MASK])
    scored = scored_tokens(inputs)
    for name in TOKEN_FLOATS:
        value = token_float(inputs, name)
        if value is None:
            continue
        value = on_token_grid(value, inputs.flat, inputs.grid)[scored].to(dtype)
        bad = bad_token_values(name, value)
        if bad.any():
            raise ValueError(non_finite_message(name))
    kind, _, tensor = normalizer_spec(loss_normalizer, target_ids.device)
    if kind == Normalizer.TENSOR:
        check_normalizer_value(float(tensor))


def non_finite_message(name: str) -> str:
    """The error of the per-token float ``name`` with a non-finite value on a scored token (or, for a log-prob
    input, one above 0): the message of the prologue kernel's bit for a field the kernels read, of
    ``InputError.OBJECTIVE_INPUT`` for the others."""
    if name in OBJECTIVE_FLOATS:
        return MESSAGES[InputError.OBJECTIVE_INPUT].format(input=name)
    return MESSAGES[InputError[name.upper()]]


def scored_tokens(inputs: RowInputs) -> torch.Tensor:
    """bool ``(B, T)``: the tokens the loss scores (a target id other than IGNORE_INDEX, the mask not 0)."""
    scored = inputs.target_ids.reshape(inputs.grid) != IGNORE_INDEX
    return scored if inputs.mask is None else scored & (inputs.mask.reshape(inputs.grid) != 0)


def objective_input_errors(inputs: RowInputs, dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Deferred validation of the objective inputs (the prologue kernel checks the floats the kernels read),
    on the device with no host read: ``InputError.OBJECTIVE_INPUT`` (or 0), and the position in
    ``OBJECTIVE_FLOATS`` of the first with a non-finite value on a scored token (``Status.BAD_INPUT``), as
    int64 scalars; None when the call passes none of them."""
    present = [(position, inputs.objective_inputs[name]) for position, name in enumerate(OBJECTIVE_FLOATS)
               if inputs.objective_inputs[name] is not None]
    if not present:
        return None
    scored = scored_tokens(inputs)
    errors = torch.zeros((), dtype=torch.int64, device=scored.device)
    position = torch.zeros_like(errors)
    for at, value in reversed(present):  # the first bad one is written last
        bad = (scored & ~torch.isfinite(on_token_grid(value, inputs.flat, inputs.grid).to(dtype))).any()
        errors = torch.where(bad, int(InputError.OBJECTIVE_INPUT), errors)
        position = torch.where(bad, at, position)
    return errors, position


def canonical_batch(inputs: RowInputs, scored: torch.Tensor, scale: torch.Tensor, dtype) -> TokenBatch:
    """The objective's layout from the inputs, the scored-token mask ``(B, T)`` and the scales ``(B, T)``."""
    B, T = inputs.grid

    def on_grid(value):
        if value is None:
            return None
        value = on_token_grid(value, inputs.flat, (B, T))
        return torch.where(scored, value.to(dtype), 0.0).contiguous()  # the kernels index ptr + token

    target_ids = inputs.target_ids.reshape(B, T).to(torch.int64)
    return TokenBatch(
        target_ids=torch.where(scored, target_ids, 0).contiguous(),
        mask=scored.contiguous(),
        scale=scale,
        flat=inputs.flat,
        objective_inputs={name: on_grid(value) for name, value in inputs.objective_inputs.items()},
        **{name: on_grid(getattr(inputs, name)) for name in KERNEL_FLOATS},
    )


def prepare_batch(logits_shape, logits_dtype, device, batch: LossInputs, aggregation, sequence_reason,
                  check: bool = True, source: str = "logits") -> TokenBatch:
    """Structure, values (checked now unless ``check`` is False: the compiled reference checks them
    in a custom op) and the canonical layout, with torch's aggregation scales: the reference's path,
    and the ground truth for the prologue kernel."""
    inputs = token_inputs(logits_shape, logits_dtype, device, batch, aggregation, sequence_reason, source)
    dtype = compute_dtype(logits_dtype)
    loss_normalizer = batch.loss_normalizer
    if check:
        check_values(inputs, logits_shape[-1], loss_normalizer, dtype)
    scored = scored_tokens(inputs)
    return canonical_batch(inputs, scored, token_scales(scored, aggregation, loss_normalizer, dtype), dtype)
