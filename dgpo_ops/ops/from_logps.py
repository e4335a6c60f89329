"""The loss from per-token log-probs: ``policy_loss(inputs, options, logps=...)``.

A framework that computes the sampled tokens' log-probs itself (verl and SkyRL hand a registered policy loss
``(batch, response_length)`` log-probs) gets the same objective as the fused ops: the inputs checked and laid out
as theirs (``prepare_batch`` on the log-probs' grid, read as ``(B, T, 1)`` logits whose one entry is the target),
the method table, the sequence statistics, KL and rollout weights (``masked_objective``), the same metrics. The
gradient flows into ``logps`` by autograd; nothing here is fused, and nothing is V-sized.

``token_scales``: a framework's own per-token normalisation (``sum_t s_t L_t`` over the scored tokens), where its
trainer divides by something no aggregation row can name from one call (verl's ``global_batch_info``, SkyRL's
corrected ``loss_mask``); without it the call's ``aggregation`` and ``loss_normalizer`` give the scales.
"""

from __future__ import annotations

import torch

from dgpo_ops.core.inputs import LossInputs, TokenBatch, _check_float_input, prepare_batch
from dgpo_ops.core.objective import masked_objective
from dgpo_ops.core.options import LossOptions
from dgpo_ops.core.output import PolicyLossOutput
from dgpo_ops.core.validation import MESSAGES, defer_errors, poll_deferred_errors
from dgpo_ops.kernels.interface import LOG_PROBABILITY_INPUTS, WEIGHT_INPUTS, InputError
from dgpo_ops.kernels.row_io import compute_dtype
from dgpo_ops.kernels.torch_twins import above_zero, bad_token_values

WHY_NO_ENTROPY = "log-probs carry no entropy (a framework that passes log-probs adds its entropy term itself)"


def check_logps(logps, inputs: LossInputs, options: LossOptions) -> torch.Tensor:
    """The token grid's target ids (every token a target: the log-probs are the sampled tokens' already), after
    refusing what this route cannot honour."""
    if not torch.is_tensor(logps) or logps.dim() != 2 or not logps.is_floating_point():
        got = f"shape {tuple(logps.shape)}, dtype {logps.dtype}" if torch.is_tensor(logps) else type(logps).__name__
        raise ValueError(f"logps must be a floating-point (batch, response_length) tensor of the sampled tokens' "
                         f"log-probs, got {got}")
    if inputs.target_ids is not None:
        raise ValueError("the loss from log-probs takes no target_ids (logps are the sampled tokens' log-probs): "
                         "pass target_ids=None, and mark the tokens not scored in mask")
    if options.entropy_coef != 0.0 or inputs.entropy_weights is not None:
        raise ValueError(f"entropy_coef and entropy_weights need entropies: {WHY_NO_ENTROPY}")
    if inputs.cu_seqlens is not None or inputs.max_seqlen is not None or options.vocab_parallel_group is not None:
        raise ValueError("cu_seqlens, max_seqlen and vocab_parallel_group describe logits; log-probs are one "
                         "(batch, response_length) grid")
    if options.temperature != 1.0 or options.inplace:
        raise ValueError("temperature and inplace apply to logits: logps are the sampled tokens' log-probs as your "
                         "model gave them (from logits already divided by the sampling temperature, where it uses "
                         "one): leave temperature=1.0 and inplace=False")
    return torch.zeros(logps.shape, dtype=torch.int64, device=logps.device)


def logps_loss(logps: torch.Tensor, inputs: LossInputs, options: LossOptions, token_scales=None,
               immediate: bool = True) -> PolicyLossOutput:
    """The policy loss of ``inputs`` (its ``target_ids``: ``check_logps``'s) from ``logps``; ``immediate``: the
    values are checked on the host now (else, and under ``torch.compile``, as the frameworks' own losses, a
    non-finite input gives a non-finite loss, and so does a log-prob input above 0; eager, the error naming a
    bad log-prob input is raised later, as the fused ops' deferred errors are). The output's ``entropy`` is
    None and its ``entropy_mean`` 0 (``WHY_NO_ENTROPY``)."""
    if token_scales is not None and inputs.loss_normalizer is not None:
        raise ValueError("token_scales replace the aggregation and its loss_normalizer: pass one of them")
    check = immediate and not torch.compiler.is_compiling()  # compiled, nothing is read on the host
    if not torch.compiler.is_compiling():
        poll_deferred_errors()  # earlier deferred calls' errors, as the fused ops read them: whatever this call's mode
    batch = prepare_batch((*logps.shape, 1), logps.dtype, logps.device, inputs, options.aggregation,
                          options.sequence_reason, check=check, source="logps")
    dtype = compute_dtype(logps.dtype)
    if token_scales is not None:
        scales = _check_float_input("token_scales", token_scales, logps.shape, logps.device, False, "logps")
        if check and not torch.isfinite(scales[batch.mask]).all():
            raise ValueError("token_scales has non-finite values on unmasked tokens")
        batch.scale = torch.where(batch.mask, scales.to(dtype), 0.0)
    if check and (batch.mask & above_zero(logps.detach())).any():  # a NaN is the model's, as a NaN logit is
        raise ValueError(MESSAGES[InputError.LOGPS])
    entropy = torch.zeros(logps.shape, dtype=dtype, device=logps.device)
    loss, logp, _, metrics = masked_objective(logps.to(dtype), entropy, batch, options, inputs.generator)
    if not check:  # a score is compared, not multiplied in: a non-finite one makes the loss NaN here
        for value in batch.objective_inputs.values():
            if value is not None:
                loss = loss * torch.where(torch.isfinite(value).all(), 1.0, float("nan"))
        loss = loss * torch.where(defer_value_errors(batch, logps.detach()) != 0, float("nan"), 1.0)
    return PolicyLossOutput(loss, logp.detach().float(), None, metrics)


def defer_value_errors(batch: TokenBatch, logps: torch.Tensor) -> torch.Tensor:
    """The ``InputError`` bits (an int64 scalar on the device) of log-prob inputs holding no log-probability and
    weights holding no importance weight on a scored token (``bad_token_values``), and of ``logps`` above 0: a
    log-prob above 0 or a negative weight would give a finite, quietly wrong loss. Eager, the bits are queued as
    the fused ops' status is, so the next call or ``raise_deferred_errors`` names the input; no host read."""
    errors = torch.where((batch.mask & above_zero(logps)).any(), int(InputError.LOGPS), 0)
    for name in (*LOG_PROBABILITY_INPUTS, *WEIGHT_INPUTS):
        value = getattr(batch, name)
        if value is not None:
            bad = (batch.mask & bad_token_values(name, value)).any()
            errors = errors | torch.where(bad, int(InputError[name.upper()]), 0)
    if not torch.compiler.is_compiling():
        defer_errors(errors, "policy_loss")
    return errors
