"""The benchmark's competitors, one class each: why it cannot run somewhere (``unavailable``) and its
forward as a closure over the inputs (``prepare``; the backward is ``loss.backward()``).

Every competitor computes the same thing from the same inputs (``bench.common.Inputs``): the token-mean
policy loss from bf16 logits. The eager one is the reference of the parity check of every other one, and
is itself checked against ``dgpo_ops.reference_loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from dgpo_ops.kernels.interface import LOG_RATIO_CLAMP

from dgpo_ops import MethodConfig, method_config, token_terms


class Skip(Exception):
    """A competitor that cannot run here; the message is the recorded reason."""


@dataclass
class Prepared:
    leaf: torch.Tensor  # the tensor whose .grad the backward fills
    forward: Callable[[], torch.Tensor]  # returns the scalar loss
    grad_view: Callable[[torch.Tensor], torch.Tensor] = lambda g: g  # the (B, T, V) part of leaf.grad
    notes: dict = field(default_factory=dict)


def step(prepared: Prepared) -> torch.Tensor:
    """One forward + backward; the gradient stays in ``leaf.grad``."""
    prepared.leaf.grad = None
    loss = prepared.forward()
    loss.backward()
    if prepared.leaf.is_cuda:
        torch.cuda.synchronize()
    return loss.detach()


def default_config(method: str) -> MethodConfig:
    """The method with its default parameters (built outside any compiled function)."""
    return method_config(method)


# --------------------------------------------------------------------------------------------
# The TRL-style loss: log_softmax/gather on fp32 logits, the method on (B, T) vectors, autograd.
# --------------------------------------------------------------------------------------------


def trl_style_objective(logp, old_logp, advantages, mask, method: str, config: MethodConfig):
    """TRL's ``_compute_loss`` on per-token log-probs, token-mean aggregation (TRL's ``bnpo``): grpo exactly
    as TRL writes it (the log ratio clamped to +-LOG_RATIO_CLAMP straight-through, as dgpo_ops does); any other
    method through the package's own per-token torch function (``dgpo_ops.token_terms``), as a user
    porting it into TRL's loss would."""
    adv = advantages.unsqueeze(1).expand_as(logp)
    if method == "grpo":
        log_ratio = logp - old_logp
        log_ratio = log_ratio + (log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) - log_ratio).detach()
        coef_1 = torch.exp(log_ratio)
        coef_2 = torch.clamp(coef_1, 1.0 - config.eps_low, 1.0 + config.eps_high)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    else:
        per_token_loss = token_terms(config, logp - old_logp, adv, old_logp).loss
    mask = mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def trl_style_loss(logits, target_ids, old_logps, advantages, mask, method: str, config: MethodConfig):
    """What most users run today: upcast, log_softmax, gather, entropy for logging (no gradient, as in
    TRL), the method in torch, autograd back through the fp32 (N, V) log-softmax."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    logp = log_probs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return trl_style_objective(logp, old_logps, advantages, mask, method, config), entropy


def check_trl_style_against_reference(method: str) -> float:
    """The TRL-style loss equals dgpo_ops.reference_loss (value and gradient) on a small fp32 batch."""
    from dgpo_ops import reference_loss

    gen = torch.Generator().manual_seed(1)
    batch, seq, vocab = 3, 40, 257
    logits = (torch.randn(batch, seq, vocab, generator=gen) * 2).requires_grad_(True)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    with torch.no_grad():
        true = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    old = true + 0.4 * torch.randn(batch, seq, generator=gen)
    adv = torch.randn(batch, generator=gen)
    mask = torch.arange(seq)[None] < torch.tensor([[seq], [seq - 7], [seq - 20]])
    ref = reference_loss(logits, targets, adv, mask, old, method=method, aggregation="token_mean")
    (ref_grad,) = torch.autograd.grad(ref.loss, logits)
    ours, _ = trl_style_loss(logits, targets, old, adv, mask, method, default_config(method))
    (grad,) = torch.autograd.grad(ours, logits)
    err = max(abs(float(ours.detach() - ref.loss.detach())), float((grad - ref_grad).abs().max()))
    if err > 1e-5:
        raise AssertionError(f"TRL-style {method} differs from dgpo_ops.reference_loss by {err:.3g}")
    return err


def _cuda_only(what: str, dev: torch.device) -> None:
    if dev.type != "cuda":
        raise Skip(f"{what} launches Triton GPU kernels and has no CPU path, and this machine has no CUDA "
                   f"device (torch {torch.__version__})")


# --------------------------------------------------------------------------------------------
# Competitors
# --------------------------------------------------------------------------------------------


class Competitor:
    name: str
    label: str

    def unavailable(self, method: str, dev: torch.device) -> list[str]:
        """Why it cannot run ``method`` on ``dev``: one sentence per reason (empty: it can)."""
        return []

    def prepare(self, method: str, x) -> Prepared:
        raise NotImplementedError


class Eager(Competitor):
    name, label = "eager", "TRL-style eager torch"

    def __init__(self):
        self.checked: set[str] = set()

    def prepare(self, method, x):
        if method not in self.checked:
            check_trl_style_against_reference(method)
            self.checked.add(method)
        config = default_config(method)
        return Prepared(x.logits, lambda: trl_style_loss(x.logits, x.target_ids, x.old_logps, x.advantages,
                                                         x.mask, method, config)[0])


class Compiled(Competitor):
    name, label = "compile", "TRL-style eager under torch.compile"

    def __init__(self):
        self.compiled: dict[str, Callable] = {}

    def _function(self, method: str) -> Callable:
        if method not in self.compiled:
            import torch._dynamo

            # One static graph per shape: automatic dynamic shapes would recompile the second size with
            # symbolic shapes (slower to compile and to run on CPU); raise the recompile limit so no size
            # silently falls back to eager.
            torch._dynamo.config.automatic_dynamic_shapes = False
            torch._dynamo.config.recompile_limit = 64
            config = default_config(method)

            def loss_fn(logits, target_ids, old_logps, advantages, mask):
                return trl_style_loss(logits, target_ids, old_logps, advantages, mask, method, config)

            self.compiled[method] = torch.compile(loss_fn, fullgraph=True, dynamic=False)
        return self.compiled[method]

    def prepare(self, method, x):
        fn = self._function(method)
        return Prepared(x.logits, lambda: fn(x.logits, x.target_ids, x.old_logps, x.advantages, x.mask)[0])


class Ours(Competitor):
    name, label = "ours", "dgpo_ops.fused_dgpo_loss"

    def prepare(self, method, x):
        from dgpo_ops import fused_dgpo_loss

        def forward():
            return fused_dgpo_loss(x.logits, x.target_ids, x.advantages, x.mask, x.old_logps, method=method,
                                   aggregation="token_mean", backend="auto").loss

        return Prepared(x.logits, forward,
                        notes={"backend": "triton" if x.logits.is_cuda else "torch (chunked CPU path)"})


class Liger(Competitor):
    name, label = "liger", "Liger-Kernel triton_grpo_loss"

    def unavailable(self, method, dev):
        reasons = []
        if method != "grpo":
            reasons.append("Liger-Kernel has no DGPO loss (its loss_type is one of grpo/bnpo/dr_grpo/dapo/"
                           "cispo/sapo/luspo/vespo)")
        try:
            _cuda_only("liger_kernel.transformers.grpo_loss.triton_grpo_loss", dev)
            import liger_kernel.transformers.grpo_loss  # noqa: F401
        except Skip as why:
            reasons.append(str(why))
        except Exception as error:  # noqa: BLE001
            reasons.append(f"liger_kernel does not import: {type(error).__name__}: {error}")
        return reasons

    def prepare(self, method, x):
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        config = default_config(method)
        # Liger takes (B, T+1, V) logits and drops the last position itself, as TRL's logits come.
        batch, seq, vocab = x.logits.shape
        with torch.no_grad():
            padded = torch.zeros(batch, seq + 1, vocab, dtype=x.logits.dtype, device=x.logits.device)
            padded[:, :seq] = x.logits
        padded.requires_grad_(True)
        completion_mask = x.mask.to(torch.int32).contiguous()

        def forward():
            loss, _metrics = triton_grpo_loss(padded, x.old_logps, None, x.target_ids, x.advantages,
                                              completion_mask=completion_mask, temperature=1.0, beta=0.0,
                                              eps_low=config.eps_low, eps_high=config.eps_high,
                                              inplace=False, loss_type="bnpo", reduce=True)
            return loss

        return Prepared(padded, forward, grad_view=lambda g: g[:, :seq],
                        notes={"loss_type": "bnpo (token mean)", "inplace": False})


class Trl(Competitor):
    name, label = "trl", "TRL 1.16 trl.kernels log-probs + TRL loss"

    def unavailable(self, method, dev):
        try:
            _cuda_only("trl.kernels.selective_log_softmax_and_entropy (TRL's own dispatcher "
                       "_supports_trl_loss_kernel accepts only cuda/xpu tensors)", dev)
            from trl.kernels import selective_log_softmax_and_entropy  # noqa: F401
        except Skip as why:
            return [str(why)]
        except Exception as error:  # noqa: BLE001
            return [f"trl.kernels.selective_log_softmax_and_entropy does not import: "
                    f"{type(error).__name__}: {error}"]
        return []

    def prepare(self, method, x):
        from trl.kernels import selective_log_softmax_and_entropy

        config = default_config(method)

        def forward():
            logp, _entropy = selective_log_softmax_and_entropy(x.logits, x.target_ids, 1.0, x.mask)
            return trl_style_objective(logp, x.old_logps, x.advantages, x.mask, method, config)

        return Prepared(x.logits, forward)


REGISTRY: dict[str, Competitor] = {c.name: c for c in (Eager(), Ours(), Compiled(), Liger(), Trl())}
