"""Grid, inputs, competitors and measurement helpers shared by the benchmark (``test_policy_loss.py``),
its memory probe (``memprobe.py``) and the report (``report.py``).

Every competitor computes the same thing from the same inputs: forward + backward of a token-mean
policy loss from bf16 logits ``(B, T, V)`` (``N = B * T`` tokens, T = 1024 per response, about 12%
of each response masked as padding), off-policy old log-probs, one advantage per response, no KL,
temperature 1. The eager competitor is the reference for a parity check of every other one.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

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
COMPETITORS = ("eager", "ours", "compile", "liger", "trl")
LABELS = {
    "eager": "TRL-style eager torch",
    "ours": "dgpo_ops.fused_dgpo_loss",
    "compile": "TRL-style eager under torch.compile",
    "liger": "Liger-Kernel triton_grpo_loss",
    "trl": "TRL 1.16 trl.kernels log-probs + TRL loss",
}

# The grid: N tokens x V vocabulary, both methods. CUDA runs all of it.
FULL_SIZES = [(n, v) for n in (1024, 4096, 8192) for v in (32000, 151936, 262144)]
# The CPU grid (2 cores, 24 GiB, the whole run in about 10 minutes). Everything else of the full grid
# is dropped on CPU with the reason below, which the results and the README repeat.
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
# The TRL-style loss: log_softmax/gather on fp32 logits, the method on (B, T) vectors, autograd.
# --------------------------------------------------------------------------------------------


def method_params(method: str) -> dict:
    from dgpo_ops import method_config

    cfg = method_config(method)
    if method == "grpo":
        return {"eps_low": cfg.eps_low, "eps_high": cfg.eps_high}
    return {"eps_low": cfg.eps_low, "eps_high": cfg.eps_high, "n": cfg.n, "m": cfg.m}


def trl_style_objective(logp, old_logp, advantages, mask, method: str, params: dict):
    """TRL's ``_compute_loss`` on per-token log-probs: grpo exactly as TRL writes it, dgpo in the same
    style (LOSS_FAMILY.md); the log ratio clamped to [-20, 20] straight-through as dgpo_ops does;
    token-mean aggregation (TRL's ``bnpo``)."""
    log_ratio = logp - old_logp
    log_ratio = log_ratio + (log_ratio.clamp(-20.0, 20.0) - log_ratio).detach()
    coef_1 = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)
    low, high = 1.0 - params["eps_low"], 1.0 + params["eps_high"]
    if method == "grpo":
        coef_2 = torch.clamp(coef_1, low, high)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    elif method == "dgpo":
        ratio, log_rd = coef_1.detach(), log_ratio.detach()
        in_ln = (ratio < low) & (adv < 0)
        in_hp = (ratio > high) & (adv > 0)
        # LN: r^(n+1) / low^n, HP: high^(1/m) r^((m-1)/m), both with gradient psi = the value; exponents
        # zeroed outside their region so that they cannot overflow there.
        ln_exp = torch.where(in_ln, log_ratio + params["n"] * (log_rd - math.log(low)), log_rd * 0)
        hp_exp = torch.where(in_hp, log_ratio + (math.log(high) - log_rd) / params["m"], log_rd * 0)
        weight = torch.where(in_ln, torch.exp(ln_exp), torch.where(in_hp, torch.exp(hp_exp), coef_1))
        per_token_loss = -adv * weight
    else:
        raise ValueError(f"no TRL-style objective for {method!r}")
    mask = mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def trl_style_loss(logits, target_ids, old_logps, advantages, mask, method: str, params: dict):
    """What most users run today: upcast, log_softmax, gather, entropy for logging (no gradient, as in
    TRL), the method in torch, autograd back through the fp32 (N, V) log-softmax."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    logp = log_probs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return trl_style_objective(logp, old_logps, advantages, mask, method, params), entropy


_checked_against_reference: set[str] = set()


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
    ours, _ = trl_style_loss(logits, targets, old, adv, mask, method, method_params(method))
    (grad,) = torch.autograd.grad(ours, logits)
    err = max(abs(float(ours.detach() - ref.loss.detach())), float((grad - ref_grad).abs().max()))
    if err > 1e-5:
        raise AssertionError(f"TRL-style {method} differs from dgpo_ops.reference_loss by {err:.3g}")
    _checked_against_reference.add(method)
    return err


# --------------------------------------------------------------------------------------------
# Competitors
# --------------------------------------------------------------------------------------------


class Skip(Exception):
    """A competitor that cannot run here; the message is the recorded reason."""


@dataclass
class Prepared:
    leaf: torch.Tensor  # the tensor whose .grad the backward fills
    forward: Callable[[], torch.Tensor]  # returns the scalar loss
    grad_view: Callable[[torch.Tensor], torch.Tensor] = lambda g: g  # the (B, T, V) part of leaf.grad
    notes: dict = field(default_factory=dict)


def _cuda_only(what: str, dev: torch.device) -> None:
    if dev.type != "cuda":
        raise Skip(f"{what} launches Triton GPU kernels and has no CPU path, and this machine has no CUDA "
                   f"device (torch {torch.__version__})")


def unavailable(competitor: str, method: str, dev: torch.device) -> list[str]:
    """Why ``competitor`` cannot run ``method`` on ``dev``: one sentence per reason (empty: it can)."""
    reasons = []
    if competitor == "liger":
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
    elif competitor == "trl":
        try:
            _cuda_only("trl.kernels.selective_log_softmax_and_entropy (TRL's own dispatcher "
                       "_supports_trl_loss_kernel accepts only cuda/xpu tensors)", dev)
            from trl.kernels import selective_log_softmax_and_entropy  # noqa: F401
        except Skip as why:
            reasons.append(str(why))
        except Exception as error:  # noqa: BLE001
            reasons.append(f"trl.kernels.selective_log_softmax_and_entropy does not import: "
                           f"{type(error).__name__}: {error}")
    return reasons


_compiled: dict[str, Callable] = {}


def _compiled_trl_style(method: str) -> Callable:
    if method not in _compiled:
        import torch._dynamo

        # One static graph per shape: automatic dynamic shapes would recompile the second size with
        # symbolic shapes (slower to compile and to run on CPU); raise the recompile limit so no size
        # silently falls back to eager.
        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.recompile_limit = 64
        params = method_params(method)

        def loss_fn(logits, target_ids, old_logps, advantages, mask):
            return trl_style_loss(logits, target_ids, old_logps, advantages, mask, method, params)

        _compiled[method] = torch.compile(loss_fn, fullgraph=True, dynamic=False)
    return _compiled[method]


def prepare(competitor: str, method: str, x: Inputs) -> Prepared:
    """The competitor's forward as a closure over the inputs (the backward is ``loss.backward()``)."""
    params = method_params(method)
    if competitor == "eager":
        if method not in _checked_against_reference:
            check_trl_style_against_reference(method)
        return Prepared(x.logits, lambda: trl_style_loss(x.logits, x.target_ids, x.old_logps, x.advantages,
                                                         x.mask, method, params)[0])
    if competitor == "compile":
        fn = _compiled_trl_style(method)
        return Prepared(x.logits, lambda: fn(x.logits, x.target_ids, x.old_logps, x.advantages, x.mask)[0])
    if competitor == "ours":
        from dgpo_ops import fused_dgpo_loss

        def forward():
            return fused_dgpo_loss(x.logits, x.target_ids, x.advantages, x.mask, x.old_logps, method=method,
                                   aggregation="token_mean", backend="auto").loss

        return Prepared(x.logits, forward,
                        notes={"backend": "triton" if x.logits.is_cuda else "torch (chunked CPU path)"})
    if competitor == "trl":
        from trl.kernels import selective_log_softmax_and_entropy

        def forward():
            logp, _entropy = selective_log_softmax_and_entropy(x.logits, x.target_ids, 1.0, x.mask)
            return trl_style_objective(logp, x.old_logps, x.advantages, x.mask, method, params)

        return Prepared(x.logits, forward)
    if competitor == "liger":
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

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
                                              eps_low=params["eps_low"], eps_high=params["eps_high"],
                                              inplace=False, loss_type="bnpo", reduce=True)
            return loss

        return Prepared(padded, forward, grad_view=lambda g: g[:, :seq],
                        notes={"loss_type": "bnpo (token mean)", "inplace": False})
    raise ValueError(competitor)


def step(prepared: Prepared) -> torch.Tensor:
    """One forward + backward; the gradient stays in ``leaf.grad``."""
    prepared.leaf.grad = None
    loss = prepared.forward()
    loss.backward()
    if prepared.leaf.is_cuda:
        torch.cuda.synchronize()
    return loss.detach()


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
# Peak memory
# --------------------------------------------------------------------------------------------

CPU_MEMORY_METHOD = (
    "subprocess per case (python -m bench.memprobe): build the inputs, run one warm-up call (on the same "
    "inputs for torch.compile, so that it compiles; on a 64-token batch of the same V otherwise, so that "
    "the first call's code and library pages are not counted), reset the kernel's peak-RSS counter "
    "(write 5 to /proc/self/clear_refs), then peak resident set (VmHWM) during one forward+backward minus the resident set just before it; includes "
    "the gradient buffer (N*V bf16) the backward leaves behind. glibc's mmap threshold is pinned at 64 KiB "
    "(MALLOC_MMAP_THRESHOLD_=65536) in the probe so that freed tensors leave the RSS and it follows the live "
    "tensors; for `ours` at N*V <= 1024*262144 a second probe runs with glibc's default dynamic threshold "
    "(memory.default_malloc_peak_bytes), which keeps freed chunk buffers in the heap"
)
CUDA_MEMORY_METHOD = (
    "in process: torch.cuda.max_memory_allocated() during one forward+backward minus "
    "torch.cuda.memory_allocated() before it (after reset_peak_memory_stats); includes the gradient buffer"
)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1))


def release_free_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_peak_bytes(prepared: Prepared, warm_up: Prepared) -> dict:
    """Peak extra RSS of one ``step(prepared)`` after one ``step(warm_up)`` (which loads the code and
    libraries a first call touches, and compiles, for torch.compile)."""
    step(warm_up)
    warm_up.leaf.grad = None
    release_free_memory()
    resettable = reset_peak_rss()
    base = _status_kib("VmRSS")
    if not resettable:
        import resource

        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(prepared)
    if resettable:
        peak = _status_kib("VmHWM")
        how = "VmHWM after clear_refs"
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        how = "ru_maxrss (peak could not be reset: a lower bound)" if peak <= before else "ru_maxrss"
    return {"peak_bytes": (peak - base) * 1024, "baseline_rss_bytes": base * 1024, "how": how}


def cuda_peak_bytes(prepared: Prepared) -> dict:
    prepared.leaf.grad = None
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(prepared)
    return {"peak_bytes": torch.cuda.max_memory_allocated() - base, "baseline_allocated_bytes": base,
            "how": "torch.cuda.max_memory_allocated"}


MMAP_THRESHOLD = 65536
DEFAULT_MALLOC_PROBE_MAX = 1024 * 262144  # N * V up to which `ours` is also probed under glibc's default


def memory_in_subprocess(case: Case, fixed_mmap_threshold: bool = True, timeout: float = 900.0) -> dict:
    """Run ``bench.memprobe`` for ``case`` in a fresh process. With ``fixed_mmap_threshold`` glibc's
    mmap threshold is pinned at 64 KiB (MALLOC_MMAP_THRESHOLD_) for the whole process, so every tensor
    buffer is its own mapping, returned to the OS when freed, and the RSS follows the live tensors;
    glibc's default dynamic threshold rises to the largest freed buffer (up to 32 MiB) and then keeps
    freed buffers of that size in the heap, so the RSS also counts the allocator's retention."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if fixed_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    cmd = [sys.executable, "-m", "bench.memprobe", case.competitor, case.method, str(case.n), str(case.v)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    wall = round(time.perf_counter() - started, 1)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"memory probe exited {proc.returncode}: {' | '.join(tail)}", "probe_wall_s": wall}
    return {**json.loads(lines[-1]), "probe_wall_s": wall}


# --------------------------------------------------------------------------------------------
# Machine description
# --------------------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict:
    import triton

    dev = device()
    info = {
        "device": dev.type,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "trl": _version("trl"),
        "liger_kernel": _version("liger-kernel"),
        "transformers": _version("transformers"),
        "pytest_benchmark": _version("pytest-benchmark"),
        # A tree copied to another machine without its history (a GPU lent for one run) names its
        # commit in DGPO_OPS_COMMIT; the copy's own git metadata would name another.
        "dgpo_ops_commit": os.environ.get("DGPO_OPS_COMMIT") or _git("rev-parse", "--short", "HEAD"),
        "dgpo_ops_worktree_dirty": (False if os.environ.get("DGPO_OPS_COMMIT")
                                    else bool(_git("status", "--porcelain", "--", "dgpo_ops", "kernels"))),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            model = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        info["cpu_model"] = model.group(1).strip() if model else platform.processor()
        with open("/proc/meminfo") as f:
            info["memory_total_gib"] = round(int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1)) / 2**20, 1)
    except OSError:
        info["cpu_model"] = platform.processor()
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, capability=f"sm_{props.major}{props.minor}",
                    device_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info["device_name"] = info.get("cpu_model", "cpu")
    return info


def results_tag(info: dict) -> str:
    if info["device"] == "cuda":
        return "cuda-" + re.sub(r"[^A-Za-z0-9]+", "-", info["device_name"]).strip("-").lower()
    return "cpu"
