"""A method whose authors or framework fix its aggregation (``MethodSpec.aggregation``) aggregates by it
wherever the caller names none: fused_dgpo_loss (both kernel sets), fused_linear_dgpo_loss, reference_loss, DGPOLoss and DGPOConfig;
an explicit aggregation still wins. Before, the loss functions took token_mean for every method: geo_mean gave
-0.069460 where verl's geo_mean (a mean over responses, whatever loss_agg_mode says) gives -0.223223."""

from __future__ import annotations

import pytest
import torch
from helpers import logits_batch

import dgpo_ops
from dgpo_ops.integrations import verl_params
from dgpo_ops.methods.table import METHODS

# The aggregations the sources fix: verl's geo_mean is a mean over the micro-batch's rows of each response's token
# mean (verl_params.METHOD_AGGREGATIONS, "row-mean"); DCPO's "only token mean" is the sum over responses of their token means.
NATURAL = {"geo_mean": "seq_mean_token_mean", "dcpo": "seq_sum_token_mean"}


def test_the_table_names_each_methods_own_aggregation():
    assert {name: spec.aggregation for name, spec in METHODS.items() if spec.aggregation} == NATURAL
    for name, mode in verl_params.METHOD_AGGREGATIONS.items():  # verl's fixed aggregation is the table's
        if mode == verl_params.ROW_MEAN:
            assert METHODS[name].aggregation == "seq_mean_token_mean", name


def losses(route: str, method: str, **keywords):
    """(loss, d loss / d logits or hidden) of one route on a batch with ragged responses and spread ratios."""
    batch = logits_batch(3, 6, 40, seed=31)
    logits = batch.pop("logits").double()
    batch.pop("ref_logps", None)
    if route == "reference":
        leaf = logits.clone().requires_grad_(True)
        out = dgpo_ops.reference_loss(leaf, **batch, method=method, **keywords)
    elif route == "module":
        leaf = logits.clone().requires_grad_(True)
        out = dgpo_ops.DGPOLoss(method, backend="torch", **keywords)(leaf, **batch)
    elif route.startswith("fused-"):
        dtype = torch.float32 if route == "fused-triton" else torch.float64
        leaf = logits.to(dtype).clone().requires_grad_(True)
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        out = dgpo_ops.fused_dgpo_loss(leaf, **batch, method=method, backend=route.split("-")[1], **keywords)
    else:  # fused_linear_dgpo_loss: the logits of hidden @ weight.T
        g = torch.Generator().manual_seed(32)
        leaf = torch.randn(3, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(40, 8, generator=g, dtype=torch.float64)
        out = dgpo_ops.fused_linear_dgpo_loss(leaf, weight, **batch, method=method, backend="torch", **keywords)
    (grad,) = torch.autograd.grad(out.loss, [leaf])
    return out.loss.detach().double(), grad.double()


ROUTES = ["reference", "module", "fused-torch", "fused-triton", "linear"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("method", sorted(NATURAL))
def test_a_methods_own_aggregation_is_its_default(route, method):
    tolerance = dict(rtol=1e-5, atol=1e-7) if route == "fused-triton" else dict(rtol=1e-12, atol=1e-14)
    default = losses(route, method)
    natural = losses(route, method, aggregation=NATURAL[method])
    token_mean = losses(route, method, aggregation="token_mean")
    for got, want in zip(default, natural):
        torch.testing.assert_close(got, want, **tolerance)
    assert not torch.isclose(token_mean[0], natural[0], rtol=1e-3)  # an explicit aggregation wins, and differs


def test_methods_without_one_keep_token_mean():
    for name in METHODS:
        if name not in NATURAL:
            assert dgpo_ops.LossOptions.build(name, **({"dro_beta": 0.1} if name == "dro" else {})).aggregation \
                == "token_mean", name


def test_flat_logits_name_the_methods_own_aggregation():
    """Flat (N, V) logits carry no responses, so a method whose own aggregation is per response says so."""
    batch = logits_batch(2, 4, 20, seed=33)
    flat = {k: v.reshape(8, *v.shape[2:]) for k, v in batch.items() if k != "advantages"}
    flat["advantages"] = batch["advantages"][:, None].expand(2, 4).reshape(8)
    with pytest.raises(ValueError, match=r"aggregation 'seq_sum_token_mean' \(the own aggregation of dcpo, taken where "
                                         r"none is passed: pass aggregation='token_mean'\)$"):
        dgpo_ops.fused_dgpo_loss(**flat, method="dcpo")
    dgpo_ops.fused_dgpo_loss(**flat, method="dcpo", aggregation="token_mean")


@pytest.mark.parametrize("fields, aggregation", [
    ({"policy_loss": "geo_mean"}, "seq_mean_token_mean"),
    ({"policy_loss": "geo_mean", "loss_aggregation": "token_mean"}, "token_mean"),
    ({"policy_loss": "dcpo"}, "seq_sum_token_mean"),
    ({"policy_loss": "dgpo", "loss_type": "grpo"}, "trl:grpo"),  # TRL's loss_type where the method has none
])
def test_dgpo_config_takes_a_methods_own_aggregation_unless_loss_aggregation_is_set(tmp_path, fields, aggregation):
    pytest.importorskip("trl")
    from dgpo_ops.trainer import DGPOConfig

    config = DGPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **fields)
    assert config.aggregation == aggregation == config.loss_options().aggregation
