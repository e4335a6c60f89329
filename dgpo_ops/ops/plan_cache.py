"""The logits op's plan templates, cached per input signature: what a call decides on the host from metadata alone
(the structure checks, the grid, the kernels, the validation mode: ``pipeline.PlanTemplate``) made once for every
call that looks the same, with its launches bound (``dgpo_ops.ops.bound_launches``).

The signature is everything the template and the bound launches read: each input's shape, strides, dtype, device
and ``requires_grad`` (or None, absent), a number normaliser's value, the generator's device, the options (a frozen
dataclass), whether the call needs a gradient, and the autocast state of the logits' device. Never a tensor's
identity, address or values: a call with other tensors of the same signature gets the same template, and its
values are checked on every call all the same (immediate validation's checks in ``PlanTemplate.plan``; the poll
of earlier deferred checks in ``pipeline.forward_rows``). The cache holds templates only, no tensor of any call, in a bounded LRU.

Not cached, planned on every call as before: a vocabulary split or packed sequences (their layouts are made from
the call's tensors), a tensor subclass, a normaliser on another device than the logits (its value is read on the
host), an input of a kind the checks would refuse.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from dgpo_ops.core.inputs import LossInputs
from dgpo_ops.core.options import LossOptions
from dgpo_ops.ops.bound_launches import bind_launches
from dgpo_ops.ops.pipeline import PlanTemplate

CACHE_SIZE = 64  # templates kept: one per input signature a training loop cycles through, with room to spare

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # subclasses may dispatch anywhere: planned per call
_NORMALIZER = LossInputs._fields.index("loss_normalizer")


def input_signature(logits, batch: LossInputs, options: LossOptions, needs_grad: bool) -> tuple | None:
    """The key of a call's template, or None for a call the cache does not serve (module docstring). Written for
    the common call, whose fields are tensors or None: anything else takes ``_other_signature``."""
    if type(logits) not in _PLAIN_TENSORS:
        return None
    device = logits.device
    try:
        autocast = torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return None
    key = [(logits.shape, logits.stride(), logits.dtype, device, logits.requires_grad), options, needs_grad, autocast]
    for position, value in enumerate(batch):
        if value is None:
            key.append(None)
        elif type(value) in _PLAIN_TENSORS and position != _NORMALIZER:
            key.append((value.shape, value.stride(), value.dtype, value.device, value.requires_grad))
        else:
            signature = _other_signature(position, value, device)
            if signature is None:
                return None
            key.append(signature)
    return tuple(key)


def _other_signature(position: int, value, device: torch.device):
    """A field that is neither None nor a plain tensor of any field but the normaliser, or None where the call is
    not cached."""
    if position == _NORMALIZER:
        if type(value) in _PLAIN_TENSORS:
            if value.device != device:
                return None  # read on the host each call (normalizer_spec): its value would be part of the plan
            return value.shape, value.stride(), value.dtype, value.device, value.requires_grad
        if type(value) in (int, float):
            return type(value), value
        return None
    if type(value) is int:  # max_seqlen, which goes with cu_seqlens (an uncached layout) anyway
        return value
    if isinstance(value, torch.Generator):
        return torch.Generator, value.device
    return None  # the checks refuse it: an uncached call raises their error


class PlanCache:
    """A bounded LRU of plan templates by input signature (``input_signature``). A template is made outside the
    lock, so a call whose inputs the checks refuse raises and leaves nothing behind."""

    def __init__(self, size: int = CACHE_SIZE):
        self.size = size
        self._templates: OrderedDict[tuple, PlanTemplate] = OrderedDict()
        self._lock = threading.Lock()
        self._latest: PlanTemplate | None = None  # the most recently used template, last in the order
        self.hits = self.misses = 0

    def template(self, key: tuple, make: Callable[[], PlanTemplate]) -> PlanTemplate | None:
        """The template of ``key``: the cached one, or ``make()``'s with its launches bound; None for a key that
        cannot be hashed (options holding an unhashable value: such a call is planned uncached)."""
        try:
            with self._lock:
                template = self._templates.get(key)
                if template is not None:
                    if template is not self._latest:  # the most recent already: no second lookup to mark it so
                        self._templates.move_to_end(key)
                        self._latest = template
                    self.hits += 1
                    return template
        except TypeError:  # hashing the key
            return None
        template = make()
        template = dataclasses.replace(template, kernels=bind_launches(template.kernels))
        with self._lock:
            self.misses += 1
            self._templates[key] = self._latest = template
            while len(self._templates) > self.size:
                self._templates.popitem(last=False)
        return template

    def __len__(self) -> int:
        return len(self._templates)

    def clear(self) -> None:
        with self._lock:
            self._templates.clear()
            self._latest = None
            self.hits = self.misses = 0


LOGITS_PLANS = PlanCache()  # fused_dgpo_loss's, eager
