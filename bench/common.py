"""Grid, inputs, timing step, parity and machine description shared by the benchmark
(``test_policy_loss.py``), its memory probe (``memprobe.py``) and the report (``report.py``); the
competitors are in ``competitors.py``, the memory measurement in ``memory.py``.

Every competitor computes the same thing from the same inputs: forward + backward of a token-mean
policy loss from bf16 logits ``(B, T, V)`` (``N = B * T`` tokens, T = 1024 per response, about 12%
of each response masked as padding), off-policy old log-probs, one advantage per response, no KL,
temperature 1. The eager competitor is the reference for a parity check of every other one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.competitors import REGISTRY, Prepared, Skip, step  # noqa: F401  (Skip, step: used through this module)
from bench.memory import (  # noqa: F401  (the benchmark's memory measurement, used through this module)
    CPU_MEMORY_METHOD,
    CUDA_MEMORY_METHOD,
    DEFAULT_MALLOC_PROBE_MAX,
    cpu_peak_bytes,
    cuda_peak_bytes,
    memory_in_subprocess,
)

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "bench"
RESULTS_DIR = BENCH_DIR / "results"
PLOTS_DIR = BENCH_DIR / "plots"

SEQ_LEN = 1024  # tokens per response
POOL_ROWS = 512  # distinct random logits rows, gathered into the (N, V) batch (fast to build, same work)
LOGIT_STD = 2.0
OLD_LOGP_NOISE = 0.3  # old log-prob = true log-prob + N(0, 0.3): every trust-region branch is taken
ROUNDS = 3  # timed rounds (pytest-benchmark pedantic), after one untimed warm-up call
COMPILE_BUDGET_S = 180.0  # a torch.compile first call slower than this is skipped, and the later ones too

METHODS = ("dgpo", "grpo")
COMPETITORS = tuple(REGISTRY)
LABELS = {name: competitor.label for name, competitor in REGISTRY.items()}

# The full grid: N tokens x V vocabulary, both methods. CUDA runs all of it.
FULL_SIZES = [(n, v) for n in (1024, 4096, 8192) for v in (32000, 151936, 262144)]
# The CPU grid (2 cores, 24 GiB, the whole run in about 10 minutes). Everything else of the full grid
# is dropped on CPU with the reason below, which the results and docs/benchmarks.md repeat.
CPU_SIZES = {
    "dgpo": [(1024, 32000), (1024, 151936), (1024, 262144), (4096, 32000), (4096, 151936)],
    "grpo": [(1024, 32000)],
}


def cpu_drop_reason(method: str, n: int, v: int) -> str:
    if n == 8192:
        return ("CPU time budget: N=8192 is not run on CPU (twice the N=4096 work: the eager path alone would "
                "take about 30 s to a minute per forward+backward on 2 cores, times 5 calls per case)")
    if n * v >= 4096 * 262144:
        return ("CPU time budget: at N=4096, V=262144 the eager path would take about 25 s per "
                "forward+backward on 2 cores, times 5 calls per case (and about 12 GiB beyond the 2 GiB of logits)")
    return ("CPU time budget: grpo runs only at N=1024, V=32000 on CPU (it is in the grid to compare with "
            "Liger, which needs CUDA; its cost is dgpo's); dgpo covers the other sizes")


@dataclass(frozen=True)
class Case:
    method: str
    n: int
    v: int
    competitor: str

    @property
    def id(self) -> str:
        return f"{self.method}-N{self.n}-V{self.v}-{self.competitor}"

    @property
    def size(self) -> tuple[int, int]:
        return self.n, self.v


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def grid(grid_name: str = "auto", dev: torch.device | None = None) -> tuple[list[Case], list[dict]]:
    """(cases to run, dropped (method, N, V) with the reason). ``grid_name``: auto | full | cpu | smoke
    (smoke: the smallest size only, to check the suite itself; its results never reach the report)."""
    dev = dev or device()
    if grid_name == "smoke":
        return [Case(m, 1024, 32000, c) for m in METHODS for c in COMPETITORS], []
    use_full = grid_name == "full" or (grid_name == "auto" and dev.type == "cuda")
    cases, dropped = [], []
    for n, v in FULL_SIZES:
        for method in METHODS:
            if use_full or (n, v) in CPU_SIZES[method]:
                cases += [Case(method, n, v, competitor) for competitor in COMPETITORS]
            else:
                dropped.append({"method": method, "N": n, "V": v, "reason": cpu_drop_reason(method, n, v)})
    return cases, dropped


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    logits: torch.Tensor  # (B, T, V) bf16 leaf, requires grad
    target_ids: torch.Tensor  # (B, T) int64
    advantages: torch.Tensor  # (B,) fp32
    mask: torch.Tensor  # (B, T) bool
    old_logps: torch.Tensor  # (B, T) fp32

    @property
    def logits_bytes(self) -> int:
        return self.logits.numel() * self.logits.element_size()


def make_inputs(n: int, v: int, dev: torch.device, seed: int = 0) -> Inputs:
    """Deterministic inputs: rows of a random bf16 pool gathered into (B, T, V) (building N*V normal
    samples would take longer than the benchmark; the work per row does not depend on the values)."""
    batch, seq = max(1, n // SEQ_LEN), min(n, SEQ_LEN)
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL_ROWS, v, generator=gen) * LOGIT_STD).to(torch.bfloat16)
    pool_lse = torch.logsumexp(pool.float(), dim=-1)
    rows = torch.randint(0, POOL_ROWS, (batch * seq,), generator=gen)
    targets = torch.randint(0, v, (batch * seq,), generator=gen)
    true_logp = pool[rows, targets].float() - pool_lse[rows]
    old_logps = true_logp + OLD_LOGP_NOISE * torch.randn(batch * seq, generator=gen)
    lengths = seq - torch.randint(0, seq // 4 + 1, (batch,), generator=gen)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    advantages = torch.randn(batch, generator=gen)
    pool, rows = pool.to(dev), rows.to(dev)
    logits = pool.index_select(0, rows).view(batch, seq, v)
    del pool
    return Inputs(
        logits=logits.requires_grad_(True),
        target_ids=targets.view(batch, seq).to(dev),
        advantages=advantages.to(dev),
        mask=mask.to(dev),
        old_logps=old_logps.view(batch, seq).to(dev),
    )


# --------------------------------------------------------------------------------------------
# Competitors (one class each: bench/competitors.py)
# --------------------------------------------------------------------------------------------


def unavailable(competitor: str, method: str, dev: torch.device) -> list[str]:
    """Why ``competitor`` cannot run ``method`` on ``dev``: one sentence per reason (empty: it can)."""
    return REGISTRY[competitor].unavailable(method, dev)


def prepare(competitor: str, method: str, x: Inputs) -> Prepared:
    """The competitor's forward as a closure over the inputs (the backward is ``loss.backward()``)."""
    return REGISTRY[competitor].prepare(method, x)


# --------------------------------------------------------------------------------------------
# Parity: every competitor against the eager one, on the loss and a sample of gradient rows
# --------------------------------------------------------------------------------------------

PARITY_ROWS = 16


def grad_sample(prepared: Prepared) -> torch.Tensor:
    grad = prepared.grad_view(prepared.leaf.grad)
    flat = grad.reshape(-1, grad.shape[-1])
    rows = torch.linspace(0, flat.shape[0] - 1, PARITY_ROWS).round().long().to(flat.device)
    return flat.index_select(0, rows).float().cpu()


def parity(loss: torch.Tensor, sample: torch.Tensor, ref_loss: torch.Tensor, ref_sample: torch.Tensor) -> dict:
    loss_err = abs(float(loss) - float(ref_loss))
    grad_err = float((sample - ref_sample).abs().max())
    scale = float(ref_sample.abs().max())
    # The gradient is stored in bf16: differently ordered fp32 sums may round to a neighbouring bf16 value.
    ok = loss_err <= 1e-4 * max(1.0, abs(float(ref_loss))) and grad_err <= 2.0**-7 * scale + 1e-30
    return {"loss_abs_diff": loss_err, "grad_max_abs_diff": grad_err, "grad_max_abs": scale, "ok": ok,
            "reference": "eager"}


# --------------------------------------------------------------------------------------------
# Machine description (dgpo_ops.trainer.app.environment: the same for the trainer's run.json)
# --------------------------------------------------------------------------------------------


def machine() -> dict:
    from dgpo_ops.trainer.app.environment import describe

    return describe(device(), packages=("trl", "liger-kernel", "transformers", "pytest-benchmark"))


def results_tag(info: dict) -> str:
    if info["device"] == "cuda":
        return "cuda-" + re.sub(r"[^A-Za-z0-9]+", "-", info["device_name"]).strip("-").lower()
    return "cpu"
