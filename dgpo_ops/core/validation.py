"""Input errors found on the device, raised on the host without a synchronisation per call.

A fused op checks its inputs' structure (shapes, dtypes, devices) on the host, always. Their
values (target ids in range, a 0/1 mask, finite per-token floats on scored tokens, a positive
loss normalizer) are checked one of two ways, chosen by ``validation=``:

* ``"immediate"``: with torch ops and host reads before anything runs; the ``ValueError`` comes
  from the call itself. On CUDA tensors this costs a host-device synchronisation per call.
* ``"deferred"``: by the prologue kernel on the device (and torch ops beside it for the per-token
  floats the kernels do not read), which sets ``InputError`` bits in the call's status vector and
  makes the loss and gradient NaN, so nothing downstream is quietly wrong. The status is copied to
  pinned host memory without waiting; the ``ValueError`` naming the argument is raised by the first
  of: any later fused-op call after the GPU has finished the bad one (a non-blocking check),
  ``raise_deferred_errors()`` (which waits), or ``DGPOTrainer`` once per logging step (after the
  read its logging already does).
* ``"auto"`` (the default): immediate on the CPU, deferred on CUDA.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import threading
from collections import deque
from dataclasses import dataclass

import torch

from dgpo_ops.kernels.interface import (  # noqa: F401
    FLOAT32_MAX,
    FLOAT32_TINY,
    IGNORE_INDEX,
    LOGP_ABOVE_ZERO_TOLERANCE,
    NUM_STATUS,
    InputError,
    Status,
)

VALIDATION_MODES = ("auto", "immediate", "deferred")


def float32_magnitude_ok(value: float) -> bool:
    """``|value|`` is at most float32's largest finite number (so it stays finite in the kernels)."""
    return abs(value) <= FLOAT32_MAX


def log_probability_message(name: str) -> str:
    """The error of a log-prob input holding a value that is no log-probability on a scored token."""
    return (f"{name} has non-finite values on unmasked tokens, or values above 0 (beyond rounding: > "
            f"{LOGP_ABOVE_ZERO_TOLERANCE:g}): pass the sampled tokens' log-probabilities, log p <= 0, not "
            "probabilities")


MESSAGES = {
    InputError.TARGET_IDS: "target_ids must be in [0, {vocab}) or {ignore}; found {bad_target}",
    # Log-probs passed positionally after advantages land here: the message says where they belong.
    InputError.MASK: "mask must hold only 0 and 1 (or be boolean). mask is the positional argument after "
                     "advantages (the 4th of fused_dgpo_loss, reference_loss and DGPOLoss, the 5th of "
                     "fused_linear_dgpo_loss) and old_logps the one after mask: pass log-probs by keyword, "
                     "old_logps=...",
    InputError.ADVANTAGES: "advantages has non-finite values on unmasked tokens",
    InputError.OLD_LOGPS: log_probability_message("old_logps"),
    InputError.REF_LOGPS: log_probability_message("ref_logps"),
    InputError.ROLLOUT_WEIGHTS: "rollout_weights (given, or computed by a rollout_correction from rollout_logps) "
                                "has non-finite or negative values on unmasked tokens: importance weights are "
                                ">= 0 (exp(old_logps - rollout_logps), not the log-ratio)",
    InputError.LOSS_NORMALIZER: "loss_normalizer must be a finite number > 0, within float32's normal range "
                                "(1.2e-38 to 3.4e38, so that it and its inverse are finite and not 0), got {normalizer}",
    InputError.CU_SEQLENS: "cu_seqlens must start at 0, be non-decreasing, end at the number of packed tokens and "
                           "hold no sequence longer than max_seqlen",
    InputError.VOCAB_SHARES: "vocab_parallel_group: every process must hold an equal share of the vocabulary (in rank "
                             "order) and the same tokens",
    InputError.OBJECTIVE_INPUT: "{input} has non-finite values on unmasked tokens",
    InputError.ROLLOUT_LOGPS: f"rollout_logps has values above 0 on unmasked tokens (beyond rounding: > "
                              f"{LOGP_ABOVE_ZERO_TOLERANCE:g}): pass the inference engine's "
                              "log-probabilities of the sampled tokens, log p <= 0, not probabilities",
    InputError.LOGPS: f"logps has values above 0 on unmasked tokens (beyond rounding: > "
                      f"{LOGP_ABOVE_ZERO_TOLERANCE:g}): pass the policy's log-probabilities of the sampled tokens, "
                      "log p <= 0, not probabilities",
}

# A layout's errors first: a wrong vocabulary share or grid also makes in-range targets look out of range.
ERROR_ORDER = (InputError.VOCAB_SHARES, InputError.CU_SEQLENS,
               *(bit for bit in InputError if bit not in (InputError.VOCAB_SHARES, InputError.CU_SEQLENS)))


def resolve_mode(validation: str, device: torch.device) -> str:
    if validation not in VALIDATION_MODES:
        raise ValueError(f"validation must be one of {VALIDATION_MODES}, got {validation!r}")
    if validation == "auto":
        return "immediate" if device.type == "cpu" else "deferred"
    return validation


def error_message(status, vocab: int, normalizer: torch.Tensor | None = None, op: str = "",
                  objective_inputs: tuple[str, ...] = ()) -> str | None:
    """The message of the first error bit set in a host copy of a status vector (None when clean);
    ``objective_inputs``: the names ``Status.BAD_INPUT`` counts in
    (``dgpo_ops.core.inputs.OBJECTIVE_FLOATS``)."""
    errors = InputError(int(status[Status.ERRORS]))
    if not errors:
        return None
    bit = next(b for b in ERROR_ORDER if b in errors)
    bad_input = int(status[Status.BAD_INPUT])
    name = objective_inputs[bad_input] if bad_input < len(objective_inputs) else "an objective input"
    fields = dict(vocab=vocab, ignore=IGNORE_INDEX, bad_target=int(status[Status.BAD_TARGET]),
                  normalizer=None if normalizer is None else float(normalizer), input=name)
    where = f" (found on the device in an earlier {op} call)" if op else ""
    return MESSAGES[bit].format(**fields) + where


@dataclass
class _PendingCheck:
    status: torch.Tensor  # a host tensor (pinned for CUDA): its values are final once `done` has passed
    done: torch.cuda.Event | None  # None: a CPU status, final already
    vocab: int
    normalizer: torch.Tensor | None
    op: str
    objective_inputs: tuple[str, ...]
    ring: "_PinnedRing | None" = None  # the ring whose slot holds `status`, freed once read
    slot: int = -1

    def finished(self) -> bool:
        return self.done is None or self.done.query()


class _PinnedRing:
    """Pinned host slots and their events for one device, made once and reused: queuing a call's
    status then costs one asynchronous copy and one event record, and no allocation."""

    SLOTS = 64

    def __init__(self, shape, dtype):
        self.host = torch.empty((self.SLOTS, *shape), dtype=dtype, pin_memory=True)
        self.slots = self.host.unbind(0)  # each slot's tensor, made once: no indexing op per call
        self.events = [torch.cuda.Event() for _ in range(self.SLOTS)]
        self.busy = [False] * self.SLOTS
        self.next = 0

    def take(self) -> int:
        """A free slot, or -1 when every slot is queued (the device is far behind)."""
        for _ in range(self.SLOTS):
            slot, self.next = self.next, (self.next + 1) % self.SLOTS
            if not self.busy[slot]:
                self.busy[slot] = True
                return slot
        return -1


_pending: deque[_PendingCheck] = deque()
_rings: dict = {}
_lock = threading.Lock()


# A forward-only function that runs a loss op for its per-token log-probs and entropies (fused_linear_logprobs
# runs fused_linear_dgpo_loss's): set around that call (``per_token_function``), read where the call's check is
# queued. Its deferred errors name it, and its results, the per-token values, become NaN on bad input.
_PER_TOKEN_FUNCTION: contextvars.ContextVar[str | None] = contextvars.ContextVar("dgpo_ops_per_token_function",
                                                                                  default=None)


@contextlib.contextmanager
def per_token_function(function: str):
    """The calls made inside run for ``function``, whose results are the per-token log-probs and entropies."""
    token = _PER_TOKEN_FUNCTION.set(function)
    try:
        yield
    finally:
        _PER_TOKEN_FUNCTION.reset(token)


def running_per_token_function() -> str | None:
    """The function set by ``per_token_function`` around this call, or None (a loss op called for its loss)."""
    return _PER_TOKEN_FUNCTION.get()


def defer(status: torch.Tensor, vocab: int, normalizer: torch.Tensor | None, op: str,
          objective_inputs: tuple[str, ...] = ()) -> None:
    """Queue a call's device status for a later check; starts its copy to the host, never waits. ``op``: the
    function its error names; ``objective_inputs``: as ``error_message`` reads them (none where the call's
    objective inputs are not checked)."""
    if not status.is_cuda:
        with _lock:
            _pending.append(_PendingCheck(status, None, vocab, normalizer, op, objective_inputs))
        return
    with _lock:
        key = (status.device, tuple(status.shape), status.dtype)
        ring = _rings.get(key)
        if ring is None:
            ring = _rings[key] = _PinnedRing(status.shape, status.dtype)
        slot = ring.take()
    if slot >= 0:
        host, done = ring.slots[slot], ring.events[slot]
    else:  # more calls in flight than slots: a fresh pinned buffer and event (still no wait)
        ring, host, done = None, torch.empty(status.shape, dtype=status.dtype, pin_memory=True), torch.cuda.Event()
    host.copy_(status, non_blocking=True)  # on the status device's current stream
    done.record(torch.cuda.current_stream(status.device))  # that stream, whichever device is current
    with _lock:
        _pending.append(_PendingCheck(host, done, vocab, normalizer, op, objective_inputs, ring, slot))


def defer_errors(errors: torch.Tensor, op: str) -> None:
    """Queue ``InputError`` bits found by torch ops beside the kernels (an int64 scalar on the device, no host
    read) as a call's status, named by ``op`` when raised."""
    status = torch.zeros((NUM_STATUS,), dtype=torch.int64, device=errors.device)
    status[Status.ERRORS] = errors
    defer(status, vocab=1, normalizer=None, op=op)


def _take_errors(checks: list[_PendingCheck]) -> str | None:
    """The message of the first error among the finished ``checks`` (None if clean), their slots freed: call it
    holding the lock. A status is read where it lies (no aten op, no sync); only one with an error is copied and
    made a message, so a clean call costs one word's read."""
    message = None
    for check in checks:
        if message is None and _errors_word(check.status) != 0:
            message = error_message(check.status.numpy().copy(), check.vocab, check.normalizer, check.op,
                                    check.objective_inputs)
        if check.ring is not None:
            check.ring.busy[check.slot] = False
    return message


def _errors_word(status: torch.Tensor) -> int:
    """The ``Status.ERRORS`` word of a host (or pinned) int64 status, read from its memory: no aten op and no numpy
    array per call (a clean call's status is read this way and nothing else)."""
    address = status.data_ptr() + int(Status.ERRORS) * status.stride(0) * ctypes.sizeof(ctypes.c_int64)
    return ctypes.c_int64.from_address(address).value


def poll_deferred_errors() -> None:
    """Raise the error of any finished call whose inputs were bad; never waits for the device."""
    if not _pending:  # read without the lock: a check queued meanwhile is found by the next poll
        return
    with _lock:
        finished = [check for check in _pending if check.finished()]
        if len(finished) == len(_pending):
            _pending.clear()
        else:
            for check in finished:
                _pending.remove(check)
        message = _take_errors(finished)
    if message is not None:
        raise ValueError(message)


def raise_deferred_errors() -> None:
    """Wait for every call with a deferred check, then raise the first input error among them.

    ``DGPOTrainer`` calls this once per logging step; call it yourself after a loop of fused-op
    calls whose results you read only on the device.
    """
    with _lock:
        checks = list(_pending)
        _pending.clear()
    for check in checks:
        if check.done is not None:
            check.done.synchronize()
    with _lock:
        message = _take_errors(checks)
    if message is not None:
        raise ValueError(message)


def pending_deferred_checks() -> int:
    with _lock:
        return len(_pending)


def refuse_double_backward(op: str) -> None:
    """Called at the top of a fused op's backward. Its gradient is computed by kernels (and, for the
    linear op, already in the forward) with no graph of its own: under ``create_graph=True`` it
    would come back silently detached, so a gradient penalty built on it would be quietly wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op} does not support double backward (create_graph=True): its gradient has no graph. "
            "Use dgpo_ops.reference_loss for higher-order gradients")
