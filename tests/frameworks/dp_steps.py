"""Each framework's whole step over data-parallel ranks, and dgpo-ops' rows under the step convention
(``dgpo_ops.frameworks.core``: every call passes ``loss_normalizer = N / dp_size``): what each process of
tests/frameworks/test_data_parallel_steps.py runs.

A step is ``MICRO_BATCHES`` micro-batches on each of ``DP`` gloo ranks (real processes), ragged responses, a fully
masked response and a micro-batch with no scored token; the policy is a shared lm_head ``W`` whose gradient the
ranks average (``all_reduce`` / ``dp_size``: DDP's and FSDP's mean), each rank's micro-batch gradients summed
(accumulated). ``STEPS[framework]`` is the framework's step on one rank: its trainer's scaling, its worker's dp
factor, its backend's mean. TRL's runs ``GRPOTrainer._compute_loss`` of the installed trl (the main suite's) on a
stand-in trainer; verl's its ``agg_loss`` with the global batch info (the venv of .ci/verl_cpu.sh); OpenRLHF's,
SkyRL's and AReaL's are their released code read out of the installed wheels (the loaders of the
``test_<framework>_wheel`` modules, and ``wheel_source.load``; .ci/frameworks_cpu.sh's venv), with their own
``all_reduce`` of the step's counts; ROLL's and NeMo-RL's, not on PyPI, are their lines re-derived from the cited
source (``SOURCES``). A step whose distribution is not installed is skipped (``Step.where`` says what installs it).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.distributed as dist
from worlds import gloo_rank

import dgpo_ops
from dgpo_ops.frameworks import FRAMEWORK_AGGREGATIONS, FRAMEWORKS, Scope, step_normalizer
from dgpo_ops.kernels.interface import Denominator

DP, MICRO_BATCHES, B, T, H, V = 2, 3, 3, 6, 8, 17
EPS = 0.2  # every framework's PPO clip, both sides
STEPS_PER_GENERATION = MICRO_BATCHES  # TRL's generation batch is one optimizer step (its micro-batches)
SOURCES = {  # the re-derived steps' source
    "roll": "alibaba/ROLL 8eb27cc roll/utils/functionals.py agg_loss L229-282; the loss x micro-batches x dp "
            "(loss_scale), the backend's mean over micro-batches and ranks",
    "nemo_rl": "NVIDIA-NeMo/RL 7ea279a nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn L678-693 (over the "
               "global counts); nemo_rl/models/automodel/train.py L547 (loss x dp_size)",
}


def step_batches(seed: int = 3):
    """``(W, batches)``: the shared lm_head ``(V, H)`` and ``batches[rank][micro_batch]``, each a dict of hidden
    states, targets, a boolean mask, old log-probs (within 0.3 nats of the current ones) and per-response
    advantages, float64, the same on every process. Rank 1's last micro-batch has no scored token; every rank
    has a fully masked response."""
    generator = torch.Generator().manual_seed(seed)
    W = torch.randn(V, H, generator=generator, dtype=torch.float64) / 2
    batches = []
    for rank in range(DP):
        micro = []
        for m in range(MICRO_BATCHES):
            hidden = torch.randn(B, T, H, generator=generator, dtype=torch.float64)
            targets = torch.randint(0, V, (B, T), generator=generator)
            lengths = torch.randint(1, T + 1, (B,), generator=generator)
            lengths[(rank + m) % B] = 0
            if rank == 1 and m == MICRO_BATCHES - 1:
                lengths[:] = 0
            mask = torch.arange(T)[None, :] < lengths[:, None]
            logp = torch.log_softmax(hidden @ W.T, -1).gather(-1, targets[..., None]).squeeze(-1)
            spread = 2 * torch.rand(B, T, generator=generator, dtype=torch.float64) - 1
            micro.append(dict(hidden=hidden, targets=targets, mask=mask, old=(logp + 0.3 * spread).clamp(max=0.0),
                              advantages=torch.randn(B, generator=generator, dtype=torch.float64)))
        batches.append(micro)
    return W, batches


def log_probs(W, batch):
    return torch.log_softmax(batch["hidden"] @ W.T, -1).gather(-1, batch["targets"][..., None]).squeeze(-1)


def ppo_token_loss(logp, batch):
    """PPO's clipped per-token loss, as verl's vanilla loss, ROLL's and NeMo-RL's compute it (0 off the mask)."""
    ratio = torch.exp(logp - batch["old"])
    advantages = batch["advantages"][:, None]
    loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - EPS, 1 + EPS))
    return torch.where(batch["mask"], loss, 0.0)


def all_sum(value) -> torch.Tensor:
    total = torch.as_tensor(value, dtype=torch.float64).clone()
    dist.all_reduce(total)
    return total


RAW_COUNTS = {  # what each denominator counts in one micro-batch, before any clamp
    Denominator.TOKENS: lambda mask: mask.sum(), Denominator.RESPONSES: lambda mask: mask.shape[0],
    Denominator.GRID: lambda mask: mask.numel(), Denominator.ONE: lambda mask: 1,
    Denominator.SCORED_RESPONSES: lambda mask: mask.any(dim=1).sum(), Denominator.HORIZON: lambda mask: mask.shape[1],
}


# TRL's loss types of an objective of their own (FRAMEWORKS["trl"].loss_types): dgpo-ops' method and the parameters
# that match trl_trainer's config; every other row is PPO's clip at EPS (dgpo-ops' grpo) on both sides.
TRL_OBJECTIVES = {
    "sapo": {"method": "sapo", "tau_pos": 1.0, "tau_neg": 1.05},  # GRPOConfig's sapo_temperature_pos / _neg
    "cispo": {"method": "cispo", "eps_low": 1.0, "eps_high": EPS},  # no floor; the cap epsilon_high = 1 + EPS
    "vespo": {"method": "vespo", "k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0},  # vespo_*
}


def objective(name: str) -> dict:
    """The per-token objective ``ours`` runs for a row (the framework's step runs the same one)."""
    framework, mode = name.split(":", 1)
    if framework == "trl" and mode in TRL_OBJECTIVES:
        return TRL_OBJECTIVES[mode]
    return {"method": "grpo", "eps_low": EPS, "eps_high": EPS}


def ours(rank: int, name: str, W, batches):
    """dgpo-ops on this rank: every micro-batch one call with ``aggregation=name`` and the row's step normaliser
    (the count over the step summed over the ranks, or the micro-batch's own, at least 1)."""
    row = FRAMEWORK_AGGREGATIONS[name]
    count = RAW_COUNTS[row.denominator]
    step_total = all_sum(sum(float(count(b["mask"])) for b in batches[rank])).clamp(min=1.0)
    if row.denominator is Denominator.ONE:  # 1 over a step too, not one per micro-batch
        step_total = 1.0
    total = 0.0
    for b in batches[rank]:
        counted = step_total if row.scope is Scope.STEP else max(float(count(b["mask"])), 1.0)
        normalizer = step_normalizer(row, float(counted), micro_batches=MICRO_BATCHES, dp_size=DP)
        out = dgpo_ops.reference_loss(b["hidden"] @ W.T, b["targets"], b["advantages"], mask=b["mask"],
                                      old_logps=b["old"], **objective(name), aggregation=name,
                                      loss_normalizer=normalizer)
        total = total + out.loss
    return total


# ---- the frameworks' steps: (rank, mode, W, batches) -> this rank's loss, whose gradient it backpropagates ----


class _Accelerator:
    """The ``accelerator`` that ``_compute_loss`` calls, on this process's gloo group: ``gather`` concatenates every
    process's tensor along dim 0 (a scalar as one row, as accelerate's does), ``reduce`` sums."""

    num_processes = DP
    sync_gradients = True

    @staticmethod
    def gather(tensor):
        tensor = tensor.detach().reshape(-1) if tensor.dim() == 0 else tensor.detach()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    gather_for_metrics = gather

    @staticmethod
    def reduce(tensor, reduction="sum"):
        assert reduction == "sum", reduction
        return all_sum(tensor.detach())


def trl_trainer(mode):
    """A ``GRPOTrainer`` built without ``__init__``: the config fields ``_compute_loss`` reads (``GRPOConfig``'s own
    defaults, the clip at ``EPS``, CISPO's cap ``1 + EPS``, ``steps_per_generation`` and
    ``max_completion_length``), and the attributes ``__init__`` sets from them (grpo_trainer.py L782-1080)."""
    import dataclasses
    from collections import defaultdict

    from trl import GRPOConfig, GRPOTrainer

    defaults = {field.name: field.default for field in dataclasses.fields(GRPOConfig)}
    args = SimpleNamespace(**{**defaults, "loss_type": mode, "epsilon": EPS,
                              "epsilon_high": 1 + EPS if mode == "cispo" else EPS,
                              "steps_per_generation": STEPS_PER_GENERATION, "max_completion_length": T})
    trainer = object.__new__(GRPOTrainer)
    trainer.args, trainer.loss_type, trainer.beta = args, args.loss_type, args.beta
    trainer.epsilon_low, trainer.epsilon_high = args.epsilon, args.epsilon_high
    trainer.importance_sampling_level, trainer.max_completion_length = args.importance_sampling_level, T
    trainer.off_policy_mask_threshold, trainer.top_entropy_quantile = (args.off_policy_mask_threshold,
                                                                       args.top_entropy_quantile)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = (args.use_vllm,
                                                                     args.vllm_importance_sampling_correction)
    trainer.entropy_coef, trainer.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer.aux_loss_enabled = False  # no router
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.model = SimpleNamespace(training=True)  # mode "train"
    trainer.accelerator = _Accelerator()
    trainer.current_gradient_accumulation_steps = MICRO_BATCHES  # the step's micro-batches
    return trainer


def trl_step(rank, mode, W, batches):
    """TRL's own ``GRPOTrainer._compute_loss`` on every micro-batch of this process's generation batch (the
    loss type ``mode``: its per-token objective and its normalisation), on ``trl_trainer``'s stand-in ``self``
    whose ``_get_per_token_logps_and_entropies`` returns the micro-batch's log-probs of ``W``. The generation batch
    carries ``num_items_in_batch`` as _generate_and_score_completions makes it (grpo_trainer.py L2497-2498: the
    loss mask's sum gathered over the processes) and is split into the micro-batches by TRL's
    ``split_tensor_dict`` (``_prepare_inputs``, L1544; its ``shuffle_sequence_dict`` left out, so that the
    micro-batches are the ones dgpo-ops sees). Its Trainer leaves the loss unscaled (``loss_is_scaled_for_ga``):
    the micro-batches' losses add."""
    from trl import GRPOTrainer
    from trl.trainer.utils import split_tensor_dict

    assert GRPOTrainer.loss_is_scaled_for_ga is True  # transformers' training_step then does not divide
    trainer = trl_trainer(mode)
    mine = batches[rank]
    completion_mask = torch.cat([b["mask"] for b in mine]).long()
    rows = completion_mask.shape[0]
    loss_mask = completion_mask  # no tool mask
    num_items_in_batch = trainer.accelerator.gather(loss_mask.sum()).sum()
    generation_batch = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.cat([b["targets"] for b in mine]), "completion_mask": completion_mask,
        "advantages": torch.cat([b["advantages"] for b in mine]), "num_items_in_batch": num_items_in_batch,
        "old_per_token_logps": torch.cat([b["old"] for b in mine]),
    }
    total = 0.0
    for b, inputs in zip(mine, split_tensor_dict(generation_batch, STEPS_PER_GENERATION), strict=True):
        assert torch.equal(inputs["completion_mask"].bool(), b["mask"])
        logp = log_probs(W, b)
        trainer._get_per_token_logps_and_entropies = lambda *_, logp=logp, **__: (logp, torch.zeros_like(logp), None)
        total = total + GRPOTrainer._compute_loss(trainer, None, inputs)
    return total


def verl_step(rank, mode, W, batches):
    """verl's own ``agg_loss`` (verl/trainer/ppo/core_algos.py, verl 0.9.1) on every micro-batch's clipped PPO
    loss, with the global batch info its FSDP engine and ``ppo_loss`` pass (config.global_batch_info): ``dp_size``,
    ``batch_num_tokens`` (the loss mask's sum over the dp group, ``.item()``: verl/workers/engine/fsdp/
    transformer_impl.py L730-735; verl/workers/utils/losses.py L64-68), ``global_batch_size``
    (ppo_mini_batch_size x rollout.n, every rank's rows: verl/trainer/ppo/ray_trainer.py L1352-1362) and
    ``loss_scale_factor`` None (ActorConfig's default: the horizon); FSDP backpropagates each micro-batch's loss as
    it is, so the losses add."""
    from verl.trainer.ppo.core_algos import agg_loss

    batch_num_tokens = all_sum(sum(b["mask"].sum() for b in batches[rank])).item()
    global_batch_size = B * MICRO_BATCHES * DP
    total = 0.0
    for b in batches[rank]:
        loss = agg_loss(ppo_token_loss(log_probs(W, b), b), b["mask"], mode, dp_size=DP,
                        batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
                        loss_scale_factor=None)
        total = total + loss
    return total


def roll_step(rank, mode, W, batches):
    """ROLL's agg_loss with the step's counts over every rank (batch_num_tokens, global_valid_samples), the loss x
    micro-batches x dp (loss_scale), the backend's mean over the micro-batches (the ranks' by the all-reduce)."""
    tokens = all_sum(sum(b["mask"].sum() for b in batches[rank]))
    valid = all_sum(sum(b["mask"].any(-1).sum() for b in batches[rank]))
    total = 0.0
    for b in batches[rank]:
        loss_mat, mask = ppo_token_loss(log_probs(W, b), b), b["mask"].double()
        scored = (mask.sum(-1) > 0).double()
        if mode == "token-mean":  # agg_loss sums loss_mat as given: the worker's is masked
            loss = loss_mat.sum() / tokens
        elif mode == "seq-mean-token-mean":
            means = torch.where(mask.sum(-1) > 0, (loss_mat * mask).sum(-1) / (mask.sum(-1) + 1e-8), 0.0)
            loss = (means * scored).sum() / (valid + 1e-8)
        elif mode == "seq-mean-token-sum":
            loss = ((loss_mat * mask).sum(-1) * scored).sum() / (valid + 1e-8)
        elif mode == "seq-mean-token-sum-norm":
            loss = ((loss_mat * mask).sum(-1) * scored).sum() / mask.shape[-1]
        else:
            raise ValueError(mode)
        total = total + loss * (MICRO_BATCHES * DP) / MICRO_BATCHES
    return total


def nemo_rl_step(rank, mode, W, batches):
    """ClippedPGLossFn over the global batch's counts (process_global_batch: global_valid_toks, and
    global_valid_seqs, the sample_mask's sum, every sample valid here), x dp_size."""
    tokens = all_sum(sum(b["mask"].sum() for b in batches[rank]))
    sequences = all_sum(sum(torch.ones(B).sum() for b in batches[rank]))
    total = 0.0
    for b in batches[rank]:
        loss_mat, mask = ppo_token_loss(log_probs(W, b), b), b["mask"].double()
        if mode == "token_level_loss=true":
            loss = (loss_mat * mask).sum() / tokens
        elif mode == "token_level_loss=false":
            sample_mask = torch.ones(B, dtype=torch.float64)
            loss = ((loss_mat * mask).sum(-1) / (mask.sum(-1) + 1e-8) * sample_mask).sum() / sequences
        else:
            raise ValueError(mode)
        total = total + loss * DP
    return total


def openrlhf_step(rank, mode, W, batches):
    """OpenRLHF's window normalisers (``_optimizer_step_loss_norm``: its all_reduce over the ranks, / gas) and
    ``PolicyLoss`` with them (x dp_size), DeepSpeed's 1 / gas on every backward."""
    from test_openrlhf_wheel import LOSS
    from wheel_source import load

    norm = load("openrlhf", "openrlhf/utils/loss_utils.py", ["_optimizer_step_loss_norm"], {"dist": dist})
    masks = [b["mask"] for b in batches[rank]]
    info = norm["_optimizer_step_loss_norm"](masks, None, DP, MICRO_BATCHES)
    policy_loss = LOSS["PolicyLoss"](clip_eps_low=EPS, clip_eps_high=EPS, token_level_loss=mode == "token-mean")
    total = 0.0
    for b in batches[rank]:
        mask = b["mask"].double()
        loss = policy_loss(log_probs(W, b), b["old"], b["advantages"][:, None] * mask, action_mask=mask, **info)[0]
        total = total + loss / MICRO_BATCHES
    return total


def skyrl_step(rank, mode, W, batches):
    """SkyRL's trainer scales the advantages over the mini-batch of every rank
    (``apply_loss_reduction_to_advantages_minibatch``), the registered ``regular`` loss sums each micro-batch, the
    worker multiplies it by dp_size."""
    from test_skyrl_wheel import PPO_UTILS, REGISTRY, algorithm

    config = algorithm("regular", mode, eps_clip_low=EPS, eps_clip_high=EPS)
    everyone = [b for rank_batches in batches for b in rank_batches]
    mask = torch.cat([b["mask"] for b in everyone]).double()
    advantages = torch.cat([b["advantages"] for b in everyone])[:, None] * mask
    scaled = PPO_UTILS["apply_loss_reduction_to_advantages_minibatch"](advantages, mask, mode, micro_batch_size=B,
                                                                       max_seq_len=T)
    total = 0.0
    for m, b in enumerate(batches[rank]):
        rows = slice((rank * MICRO_BATCHES + m) * B, (rank * MICRO_BATCHES + m + 1) * B)
        loss = REGISTRY["regular"](log_probs(W, b), b["old"], scaled[rows], config, b["mask"].double(), None)[0]
        total = total + loss * DP
    return total


def areal_step(rank, mode, W, batches):
    """AReaL's FSDP engine: ``compute_total_loss_weight`` (the step's scored tokens, its all_reduce over the
    ranks), each micro-batch's ``grpo_loss_fn`` x its tokens / the total x dp_size (``loss_multiplier``); a
    micro-batch without a token gives 0."""
    from test_areal_wheel import areal_loss
    from wheel_source import load

    engine = load("areal", "areal/engine/core/train_engine.py", ["compute_total_loss_weight"], {"dist": dist})
    weight = lambda mb: mb["loss_mask"].count_nonzero()  # noqa: E731 - actor.py's loss_weight_fn
    mbs = SimpleNamespace(mbs=[{"loss_mask": b["mask"]} for b in batches[rank]])
    total_weight = engine["compute_total_loss_weight"](mbs, weight, None)
    total = 0.0
    for b in batches[rank]:
        logp = log_probs(W, b)
        local = weight({"loss_mask": b["mask"]})
        if local == 0:
            total = total + logp.mean() * 0.0
            continue
        loss = areal_loss((None, None, b["mask"], b["old"], b["old"], b["advantages"]), eps_clip=EPS)(logp)
        total = total + loss * (local / total_weight * DP)
    return total


FRAMEWORKS_VENV = ".ci/frameworks_cpu.sh"


class Step(NamedTuple):
    run: object  # (rank, mode, W, batches) -> this rank's loss
    distribution: str | None  # the distribution whose released code it runs, None: re-derived (SOURCES)
    version: str | None = None
    where: str | None = None  # what installs it: the script of its venv, or the main suite's extra


STEPS = {
    "trl": Step(trl_step, "trl", "1.16.0", "the main suite's extra [trl]"),
    "verl": Step(verl_step, "verl", "0.9.1", ".ci/verl_cpu.sh"),
    "roll": Step(roll_step, None), "nemo_rl": Step(nemo_rl_step, None),
    "openrlhf": Step(openrlhf_step, "openrlhf", "0.11.2", FRAMEWORKS_VENV),
    "skyrl": Step(skyrl_step, "skyrl", "0.3.0", FRAMEWORKS_VENV),
    "areal": Step(areal_step, "areal", "1.0.4", FRAMEWORKS_VENV),
}


def rank_gradients(rank: int, framework: str) -> dict:
    """For every row of ``framework``: dgpo-ops' and the framework's step gradient of ``W`` on this rank, each
    averaged over the ranks (DDP's mean)."""
    W, batches = step_batches()
    results = {}
    for row in FRAMEWORKS[framework].aggregations:
        name = f"{framework}:{row.mode}"
        pair = []
        for loss_of in (lambda w: ours(rank, name, w, batches),
                        lambda w: STEPS[framework].run(rank, row.mode, w, batches)):
            leaf = W.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(loss_of(leaf), leaf)
            dist.all_reduce(grad)
            pair.append(grad / DP)
        results[name] = tuple(pair)
    return results


def worker(rank: int, world: int, init_file: str, out_dir: str, framework: str) -> None:
    gloo_rank(rank, world, init_file, out_dir, lambda: {"gradients": rank_gradients(rank, framework)})
