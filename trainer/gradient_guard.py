"""The non-finite-gradient guard of ``DGPOTrainer``: an optimizer step whose gradients are not finite is skipped.

Parameters and optimizer moments then stay as they were, and the next generation never samples from NaN.
A warning names the step and the first parameter with a non-finite gradient; ``max_nonfinite_steps``
consecutive skips stop the run.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


def fused_adam(optimizer):
    """The torch Adam/AdamW behind accelerate's wrapper when every group is fused (it honours
    ``found_inf`` on the device), else None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) and all(g.get("fused") for g in inner.param_groups):
        return inner
    return None


class NonfiniteGradientGuard:
    """A mixin of ``GRPOTrainer`` (``DGPOTrainer``'s): the check on every optimizer step and its report."""

    def _init_gradient_guard(self) -> None:
        self.nonfinite_skips = 0  # consecutive optimizer steps skipped for non-finite gradients
        self.skipped_steps: list[int] = []
        self.pending_step_checks: list = []  # (step, device index of the first bad gradient or -1, names)

    def _nonfinite_gradients(self, model):
        """(names, device bool per gradient: not finite), taken before clipping: clipping by a NaN
        norm turns every gradient NaN and would hide which parameter it came from. One
        ``_foreach_norm`` pass over the gradients per optimizer step."""
        named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        if not named or len({grad.device for _, grad in named}) != 1:
            return None
        per_tensor = torch.stack(torch._foreach_norm([grad for _, grad in named]))
        return [name for name, _ in named], ~torch.isfinite(per_tensor)

    def _clip_grad_norm(self, model):
        if self.accelerator.scaler is None:
            self._gradient_check = self._nonfinite_gradients(model)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        """Every optimizer step: a step whose gradients are not finite is skipped.

        With a fused torch Adam/AdamW (``optim="adamw_torch_fused"``, the default with torch >= 2.8)
        the skip happens on the device, through the optimizer's ``found_inf`` flag (as GradScaler
        does), and the index of the first parameter with a non-finite gradient is kept on the
        device: both are read at the next step's metrics read, which TRL's logging does anyway, so
        the guard adds no host synchronisation. Other optimizers get a host read of the pre-clip
        norm (the value TRL logs as grad_norm) per optimizer step, and the gradients are dropped.
        Under a GradScaler (fp16) the scaler skips such steps itself."""
        grad_norm = super()._get_grad_norm(model, grad_norm)
        check, self._gradient_check = getattr(self, "_gradient_check", None), None
        if self.accelerator.scaler is not None:
            return grad_norm
        if check is None:  # max_grad_norm = 0: nothing was clipped, the gradients are as they came
            check = self._nonfinite_gradients(model)
        step = self.state.global_step + 1
        optimizer = fused_adam(self.optimizer)
        if optimizer is not None and check is not None:
            names, bad = check
            optimizer.found_inf = bad.any().float()
            self.pending_step_checks.append((step, torch.where(bad.any(), bad.int().argmax(), -1), names))
            return grad_norm
        norm = grad_norm if torch.is_tensor(grad_norm) else torch.tensor(float(grad_norm))
        if bool(torch.isfinite(norm)):  # a host read per step: optimizers that cannot skip on the device
            self._count_step(step, None)
            return grad_norm
        first = "(unknown: gradients on several devices)"
        if check is not None:
            names, bad = check
            first = names[int(bad.int().argmax())] if bool(bad.any()) else "(none: the total norm overflowed)"
        model.zero_grad(set_to_none=True)  # optimizers skip parameters without a gradient
        self._count_step(step, first)
        return grad_norm

    def report_skipped_steps(self) -> None:
        """Warn about the steps skipped on the device since the last call (a host read of values the
        device has computed by now) and stop the run after too many in a row."""
        if not self.pending_step_checks:
            return
        firsts = torch.stack([first for _, first, _ in self.pending_step_checks]).tolist()
        checks, self.pending_step_checks = self.pending_step_checks, []
        for (step, _, names), first in zip(checks, firsts):
            self._count_step(step, None if first < 0 else names[first])

    def _count_step(self, step: int, first_nonfinite: str | None) -> None:
        if first_nonfinite is None:
            self.nonfinite_skips = 0
            return
        self.nonfinite_skips += 1
        self.skipped_steps.append(step)
        limit = self.args.max_nonfinite_steps
        logger.warning(f"DGPOTrainer: step {step} skipped: non-finite gradient, first in {first_nonfinite} "
                       f"({self.nonfinite_skips} in a row; the run stops after {limit})")
        if self.nonfinite_skips >= limit:
            raise RuntimeError(
                f"DGPOTrainer: {self.nonfinite_skips} consecutive optimizer steps had non-finite gradients "
                f"(last at step {step}, first in {first_nonfinite}); stopping. Lower the learning rate, train in "
                "fp32 (bf16=False), or raise DGPOConfig.max_nonfinite_steps")

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        self.report_skipped_steps()  # the last steps' checks
        return result
