"""The lm_head module as the fused linear op's weight (``dgpo_ops.distributed.head``): a head whose output is not
``hidden @ weight.T + bias`` is refused, since the op reads its weight and bias alone; the heads it can stand for
run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dgpo_ops

H, V = 8, 20


def call(head):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, H, generator=g)
    target, advantages = torch.randint(0, V, (2, 3), generator=g), torch.randn(2, generator=g)
    return dgpo_ops.fused_linear_dgpo_loss(hidden, head, target, advantages, None, None, method="gpg")


class ScaledHead(nn.Linear):
    def forward(self, hidden):
        return 2.0 * super().forward(hidden)


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return 2.0 * super().forward(ids)


def lora_head():
    peft = pytest.importorskip("peft")  # the trl extra installs it

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=False)

    model = peft.get_peft_model(Model(), peft.LoraConfig(target_modules=["lm_head"], r=4, init_lora_weights=False))
    return model.base_model.model.lm_head


@pytest.mark.parametrize("make, what", [
    (lora_head, "a PEFT adapter layer (peft.tuners.lora.layer.Linear)"),
    (lambda: ScaledHead(H, V), "an nn.Linear subclass with its own forward"),
    (lambda: ScaledEmbedding(V, H), "an nn.Embedding subclass with its own forward"),
], ids=["lora", "linear_subclass", "embedding_subclass"])
def test_a_head_whose_output_is_not_its_weights_product_is_refused(make, what):
    head = make()
    with pytest.raises(ValueError, match=r"the lm_head is " + what.replace("(", r"\(").replace(")", r"\)")):
        call(head)
    assert "forward" not in head.__dict__  # refused before its forward was redirected


@pytest.mark.parametrize("make", [
    lambda: nn.Linear(H, V),
    lambda: nn.Embedding(V, H),  # a tied head
    # a sharding engine's subclass (FSDP2 makes one per module class) keeps nn.Linear's forward
    lambda: type("FSDPLinear", (nn.Linear,), {})(H, V),
], ids=["linear", "embedding", "engine_subclass"])
def test_a_plain_head_runs_as_its_weight(make):
    head = make()
    out = call(head)
    out.loss.backward()
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad).all()
    weight = head.weight.detach().clone().requires_grad_(True)
    bias = getattr(head, "bias", None)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, H, generator=g)
    target, advantages = torch.randint(0, V, (2, 3), generator=g), torch.randn(2, generator=g)
    want = dgpo_ops.fused_linear_dgpo_loss(hidden, weight, target, advantages, None, None, method="gpg",
                                           bias=None if bias is None else bias.detach())
    torch.testing.assert_close(out.loss, want.loss)
