"""One policy update of a real-size model, as a user runs it: ``DGPOTrainer`` against TRL's ``GRPOTrainer``.

    python bench/train_step.py [--model qwen2.5-1.5b] [--completions 2048,8192,16384] [--paths ...]
                               [--repeats 3] [--no-search]

The model has Qwen2.5-1.5B's architecture (``MODELS``, built from its config with random weights; nothing is
downloaded), fp32 master weights under bf16 autocast (on CUDA) and activation checkpointing on. The rollouts are
synthetic: 8 responses to one prompt of 512 tokens, completions of the given length (the longest response; the
others end uniformly between half of it and all of it, padded as TRL pads them), one advantage per response,
old log-probs around a uniform policy's (so the ratios leave the clip range and the loss depends on the model).
One update is what Trainer's loop does per optimizer step after generation, on the model and optimizer as
``accelerator.prepare`` leaves them: ``_compute_loss`` (the model's forward and the loss), the backward, gradient
clipping at 1.0 and the AdamW step (TRL's default, fused).

Paths (``PATHS``): ``DGPOTrainer`` with ``fused="linear"`` (the default: hidden states and the lm_head through
``fused_linear_dgpo_loss``) and ``fused="logits"`` (the model's logits through ``fused_dgpo_loss``), both with
``policy_loss="grpo"`` so that the loss is TRL's; stock ``GRPOTrainer`` (TRL 1.16's default loss path, its chunked
fused lm_head); and ``GRPOTrainer(use_liger_kernel=True)`` (Liger's RMSNorm/RoPE/SwiGLU kernels, TRL's loss).
Every path starts from the same weights and batch; the first update's loss, logged entropy and gradient norms
(total and of three parameters) are compared with TRL's, so a path computing something else shows in the table.

Each path runs in its own process (one path's allocator cache or Liger's patches never reach another). Per
completion length: one untimed update (it allocates the optimizer state and compiles), then ``--repeats`` timed
updates (synchronised wall time), each path's result printed as it grows so that a cut-short run keeps what it
measured; peak memory is ``torch.cuda.max_memory_allocated()`` over the timed updates
(CUDA) or the peak resident set (``VmHWM``, CPU), both absolute: weights, gradients, optimizer state and
activations, what decides whether a length fits. On CUDA, unless ``--no-search``, the longest completion that
fits is searched in steps of 1,024 tokens (doubling until an update runs out of memory, then bisecting).

Writes ``bench/results/train_step-<device>.json``, the table beside it (``.md``) and
``bench/plots/train_step-<device>.png``; ``python -m bench.report`` puts the tables and plots into docs/benchmarks.md.
On the CPU the default is a small model (``--model cpu-small``); the test suite runs ``--model tiny`` as a
smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
PLOTS_DIR = REPO / "bench" / "plots"

# Qwen2.5-1.5B's config.json (hub: Qwen/Qwen2.5-1.5B), written out so that nothing is downloaded; `cpu-small`
# keeps its vocabulary (the logits are what the loss paths differ in) on a model the 2-core CPU can update.
QWEN25_15B = dict(vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131_072,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")
MODELS = {
    "qwen2.5-1.5b": QWEN25_15B,
    "cpu-small": {**QWEN25_15B, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096},
    "tiny": {**QWEN25_15B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512},
}
# model -> (prompt length, completion lengths) run by default
SHAPES = {"qwen2.5-1.5b": (512, (2048, 8192, 16384)), "cpu-small": (128, (256, 512, 1024)), "tiny": (16, (16, 32))}
RESPONSES = 8
SEARCH_STEP = 1024
SEARCH_LIMIT = 131_072


@dataclasses.dataclass(frozen=True)
class TrainerPath:
    description: str
    dgpo_fused: str | None  # DGPOTrainer's `fused`, or None for TRL's GRPOTrainer
    liger: bool = False


PATHS = {
    "dgpo_linear": TrainerPath("DGPOTrainer(fused='linear'): hidden states + lm_head through fused_linear_dgpo_loss",
                               "linear"),
    "dgpo_logits": TrainerPath("DGPOTrainer(fused='logits'): the model's logits through fused_dgpo_loss", "logits"),
    "trl": TrainerPath("GRPOTrainer: TRL 1.16's default loss path (its chunked fused lm_head)", None),
    "trl_liger": TrainerPath("GRPOTrainer(use_liger_kernel=True): Liger's layer kernels, TRL's loss", None, liger=True),
}


def unavailable(path: str, device: str) -> str | None:
    """Why ``path`` cannot run here, or None."""
    if not PATHS[path].liger:
        return None
    from importlib.util import find_spec

    if find_spec("liger_kernel") is None:
        return "liger-kernel is not installed"
    if device != "cuda":
        return "Liger's kernels need CUDA"
    return None


def longest_fitting(fits, step: int = SEARCH_STEP, limit: int = SEARCH_LIMIT,
                    known_fit: int | None = None) -> tuple[int | None, list[int]]:
    """The largest multiple of ``step`` up to ``limit`` for which ``fits(length)`` holds, assuming it holds up to
    some length and never above it; ``(None, probes)`` when even ``step`` does not fit. Doubles from ``step``
    (or from ``known_fit``, a length already seen to fit, rounded down to a multiple of ``step``) until a length
    fails, then bisects between the last that fit and the first that failed."""
    limit = limit // step * step
    probes = []

    def probe(length):
        probes.append(length)
        return fits(length)

    if limit < step:
        return None, probes
    good = min(known_fit // step * step, limit) if known_fit else 0
    if good < step:
        if not probe(step):
            return None, probes
        good = step
    bad = None
    while bad is None:
        nxt = min(good * 2, limit)
        if nxt == good:
            return good, probes
        if probe(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if probe(mid):
            good = mid
        else:
            bad = mid
    return good, probes


# ----------------------------------------------------------------------------- one path, in its own process


def build_trainer(path: str, model_name: str, completion_length: int, workdir: str, device: str,
                  policy_loss: str = "grpo", fields: dict | None = None):
    """The trainer as ``train()`` leaves it before its first step: Liger's kernels applied, activation
    checkpointing on, model and optimizer prepared by accelerate (under bf16 the model's forward then runs
    in autocast and returns fp32 outputs, as in a real run). ``fields``: more ``GRPOConfig`` fields, for both
    trainers (``bench/passes.py``'s options); ``policy_loss``: DGPOTrainer's method (GRPOTrainer runs TRL's)."""
    import torch
    from datasets import Dataset
    from dgpo_ops.trainer.app.tiny_model import build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = PATHS[path]
    tokenizer = build_tokenizer("chars")
    config = Qwen2Config(**MODELS[model_name], pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains: a 1.5B model built on the host takes minutes
        model = Qwen2ForCausalLM(config)
    common = dict(output_dir=workdir, per_device_train_batch_size=RESPONSES, num_generations=RESPONSES,
                  max_completion_length=completion_length, bf16=device == "cuda", use_cpu=device != "cuda",
                  report_to=[], gradient_checkpointing=True, max_grad_norm=1.0, use_liger_kernel=spec.liger,
                  save_strategy="no", **(fields or {}))
    if spec.dgpo_fused is not None:
        from dgpo_ops.trainer import DGPOConfig, DGPOTrainer

        cls, args = DGPOTrainer, DGPOConfig(policy_loss=policy_loss, fused=spec.dgpo_fused, **common)
    else:
        from trl import GRPOConfig, GRPOTrainer

        cls, args = GRPOTrainer, GRPOConfig(**common)
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                  train_dataset=Dataset.from_dict({"prompt": ["1+1="] * RESPONSES}), processing_class=tokenizer)
    # What Trainer.train() does before its first step, and nothing of its loop.
    if spec.liger:
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(trainer.model, trainer.args.liger_kernel_config)
    checkpointing = dict(trainer.args.activation_checkpointing_kwargs or {})
    trainer.model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={k: v for k, v in checkpointing.items() if k not in ("every_n_layers", "offload")}
        or None, every_n_layers=checkpointing.get("every_n_layers", 1), offload=checkpointing.get("offload", False))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.create_optimizer()
    trainer.model_wrapped, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    return trainer


def synthetic_rollouts(prompt_length: int, completion_length: int, vocab: int, device: str, seed: int = 0) -> dict:
    """8 responses to one prompt; old log-probs around a uniform policy's, -log V +- 0.3, so that with a freshly
    initialised model the ratios spread over both sides of the clip and the loss depends on the model."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(completion_length // 2, completion_length + 1, (RESPONSES,), generator=g)
    lengths[0] = completion_length
    completion_mask = (torch.arange(completion_length)[None] < lengths[:, None]).long()
    inputs = {
        "prompt_ids": torch.randint(0, vocab, (RESPONSES, prompt_length), generator=g),
        "prompt_mask": torch.ones(RESPONSES, prompt_length, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (RESPONSES, completion_length), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.randn(RESPONSES, generator=g),
        "old_per_token_logps": -math.log(vocab) + 0.3 * torch.randn(RESPONSES, completion_length, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }
    return {k: v.to(device) for k, v in inputs.items()}


# parameters whose gradient norms are compared with TRL's on the first update (the tied embedding / lm_head, the
# final norm, the first attention projection), beside the total norm
GRADIENT_PROBES = {"embedding": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                   "layer0_q_proj": "model.layers.0.self_attn.q_proj.weight"}


def update(trainer, inputs, record: bool = False) -> dict | None:
    """One optimizer step on ``inputs`` as Trainer's loop makes it: ``_compute_loss`` on the prepared model, the
    backward, ``_clip_grad_norm``/``_get_grad_norm`` (DGPOTrainer's non-finite check included), the optimizer
    step. With ``record``: the loss, the logged entropy and gradient norms, read on the host (not timed)."""
    model = trainer.model_wrapped
    with trainer.compute_loss_context_manager():
        loss = trainer._compute_loss(model, inputs)
    trainer.accelerator.backward(loss)
    probes = None
    if record:
        params = dict(trainer.model.named_parameters())
        probes = {name: float(params[param].grad.float().norm()) for name, param in GRADIENT_PROBES.items()}
    grad_norm = trainer._clip_grad_norm(model) if trainer.args.max_grad_norm > 0 else None
    grad_norm = trainer._get_grad_norm(model, grad_norm=grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    if not record:
        return None
    return {"loss": float(loss), "grad_norm": float(grad_norm), "entropy": trainer._metrics["train"]["entropy"][-1],
            "grad_norms": probes}


def _reset_peak(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return
    from bench.memory import reset_peak_rss

    reset_peak_rss()


def _peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    from bench.memory import _status_kib

    return _status_kib("VmHWM") * 1024


def timed_updates(trainer, inputs, repeats: int, device: str) -> dict:
    """``repeats`` synchronised, timed updates after the peak reset: their times, median and peak memory."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    _reset_peak(device)
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        update(trainer, inputs)
        sync()
        times.append(time.perf_counter() - started)
    return {"seconds": times, "seconds_median": statistics.median(times), "peak_bytes": _peak_bytes(device)}


def out_of_memory(error: BaseException) -> bool:
    """An allocation failure of the device (the caching allocator's, or cuBLAS's workspace)."""
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("out of memory" in str(error) or "ALLOC_FAILED" in str(error)))


def _release(trainer, device: str) -> None:
    import torch

    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_lengths(trainer, prompt_length, lengths, repeats, device):
    """One row per completion length, yielded as soon as it is measured."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    vocab = trainer.model.config.vocab_size
    for length in lengths:
        inputs = synthetic_rollouts(prompt_length, length, vocab, device)
        tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
        row = {"completion_length": length, "prompt_length": prompt_length, "responses": RESPONSES, "tokens": tokens}
        try:
            started = time.perf_counter()
            row.update(update(trainer, inputs, record=True))
            sync()
            row["first_update_s"] = time.perf_counter() - started
            row.update(timed_updates(trainer, inputs, repeats, device))
            row["tokens_per_s"] = tokens / row["seconds_median"]
        except (RuntimeError, torch.OutOfMemoryError) as e:
            if not out_of_memory(e):
                raise
            row["error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
        del inputs
        _release(trainer, device)
        yield row


def fits_in_memory(trainer, prompt_length, device):
    import torch

    vocab = trainer.model.config.vocab_size

    def fits(length: int) -> bool:
        inputs = synthetic_rollouts(prompt_length, length, vocab, device)
        try:
            update(trainer, inputs)
            torch.cuda.synchronize()
            ok = True
        except (RuntimeError, torch.OutOfMemoryError) as e:
            if not out_of_memory(e):
                raise
            ok = False
        del inputs
        _release(trainer, device)
        return ok

    return fits


def child(path: str, model_name: str, prompt_length: int, lengths: list[int], repeats: int, search: bool) -> dict:
    """Measure one path; prints the result so far as one JSON line after every length and every search probe,
    so that a crash or the command's time limit loses only what was still running."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"path": path}

    def emit():
        print(json.dumps(result), flush=True)

    with tempfile.TemporaryDirectory() as workdir:
        trainer = build_trainer(path, model_name, max(lengths), workdir, device)
        result.update(attn_implementation=trainer.model.config._attn_implementation,
                      parameters=sum(p.numel() for p in trainer.model.parameters()), rows=[])
        for row in measure_lengths(trainer, prompt_length, lengths, repeats, device):
            result["rows"].append(row)
            emit()
        if search and device == "cuda":
            fits = fits_in_memory(trainer, prompt_length, device)
            result["search_probes"] = []

            def logged(length):
                ok = fits(length)
                result["search_probes"].append([length, ok])
                emit()
                return ok

            known = max((r["completion_length"] for r in result["rows"] if "seconds_median" in r), default=None)
            result["longest_completion"], _ = longest_fitting(logged, known_fit=known)
            emit()
        elif search:
            result["longest_completion_skipped"] = "searched on CUDA only: the CPU has no device memory to run out of"
            emit()
    return result


# ----------------------------------------------------------------------------- the driver


def run_path(path, model_name, prompt_length, lengths, repeats, search, timeout=3600.0) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # After an out-of-memory probe, fragmentation must not decide the next probe (and long-sequence runs set it).
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cmd = [sys.executable, "-m", "bench.train_step", "--child", path, "--model", model_name,
           "--prompt-length", str(prompt_length), "--completions", ",".join(map(str, lengths)),
           "--repeats", str(repeats)] + ([] if search else ["--no-search"])
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, code = f"timed out after {timeout:.0f} s", "timeout"
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"path": path}
    if code != 0:  # what it measured before it died is kept
        tail = (stderr or stdout).strip().splitlines()[-3:]
        result["error"] = f"exited {code}: {' | '.join(tail)}"
    return result


COMPARED = ("loss", "grad_norm", "entropy")


def check_against_trl(results: list[dict], rtol: float) -> None:
    """Each path's first update at every length against TRL's: the loss, the total gradient norm, the logged
    entropy and the gradient norms of ``GRADIENT_PROBES``; ``vs_trl`` holds the relative differences and
    ``matches_trl`` whether all are within ``rtol`` (None where TRL's row is missing: nothing was checked)."""
    trl = {row["completion_length"]: row for r in results if r["path"] == "trl" for row in r.get("rows", ())}
    for result in results:
        for row in result.get("rows", ()):
            ref = trl.get(row["completion_length"])
            if "loss" not in row:
                continue
            if ref is None or "loss" not in ref:
                row["matches_trl"] = None
                continue
            pairs = [(row[k], ref[k]) for k in COMPARED] + [(row["grad_norms"][k], ref["grad_norms"][k])
                                                             for k in GRADIENT_PROBES]
            names = list(COMPARED) + [f"grad_norm.{k}" for k in GRADIENT_PROBES]
            row["vs_trl"] = {name: abs(a - b) / max(abs(b), 1e-12) for name, (a, b) in zip(names, pairs)}
            row["matches_trl"] = max(row["vs_trl"].values()) <= rtol


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _largest(row: dict) -> str:
    return "-" if "vs_trl" not in row else f"{max(row['vs_trl'].values()):.1e}"


def markdown(doc: dict) -> str:
    m = doc["machine"]
    where = m.get("device_name") or f"CPU ({m['cpu_count']} cores)"
    attention = sorted({r["attn_implementation"] for r in doc["results"] if r.get("attn_implementation")})
    lines = [
        f"{where}, torch {m['torch']}, trl {m.get('trl')}, transformers {m.get('transformers')}, liger-kernel "
        f"{m.get('liger_kernel')}; dgpo_ops {m.get('dgpo_ops_commit')}"
        f"{' + local changes' if m.get('dgpo_ops_worktree_dirty') else ''}; `{doc['command']}`"
        f"{'' if doc.get('complete', True) else ' (incomplete: cut short)'}. Model {doc['model']} "
        f"({(doc['parameters'] or 0) / 1e6:.1f} M parameters, vocabulary {doc['vocab_size']:,}, attention "
        f"{'/'.join(attention) or '?'}), {RESPONSES} responses, prompt {doc['prompt_length']} tokens, "
        f"{'bf16 autocast over fp32 weights' if doc['bf16'] else 'fp32'}, activation checkpointing; one update = "
        f"forward and loss, backward, clip, AdamW step; median of {doc['repeats']} updates; peak memory absolute "
        f"({doc['memory_method']}); vs TRL: the largest relative difference of the first update's loss, entropy "
        "and gradient norms to GRPOTrainer's.",
        "",
        "| completion | path | update (s) | tokens/s | peak (GB) | vs TRL |",
        "|---|---|---|---|---|---|",
    ]
    for length in doc["completion_lengths"]:
        for result in doc["results"]:
            row = next((r for r in result.get("rows", ()) if r["completion_length"] == length), None)
            if row is None or "seconds_median" not in row:
                why = (row or {}).get("error") or result.get("skipped") or result.get("error") or "not run"
                lines.append(f"| {length:,} | {result['path']} | - | - | - | {why} |")
                continue
            lines.append(f"| {length:,} | {result['path']} | {row['seconds_median']:.3f} | "
                         f"{row['tokens_per_s']:,.0f} | {_gb(row['peak_bytes'])} | {_largest(row)} |")
    fits = [f"{r['path']} {r['longest_completion']:,}" if r.get("longest_completion") else f"{r['path']} none"
            for r in doc["results"] if "longest_completion" in r]
    if fits:
        lines += ["", f"Longest completion that fits (steps of {SEARCH_STEP:,} tokens): " + ", ".join(fits) + "."]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_memory) = plt.subplots(1, 2, figsize=(10, 3.8))
    for result in doc["results"]:
        rows = [r for r in result.get("rows", ()) if "seconds_median" in r]
        if not rows:
            continue
        x = [r["completion_length"] for r in rows]
        ax_time.plot(x, [r["seconds_median"] for r in rows], marker="o", label=result["path"])
        ax_memory.plot(x, [(r["peak_bytes"] or 0) / 1e9 for r in rows], marker="o", label=result["path"])
    for ax, label in ((ax_time, "one update (s)"), (ax_memory, "peak memory (GB)")):
        ax.set_xlabel("completion length (tokens)")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    ax_time.legend(fontsize=8)
    fig.suptitle(f"policy update, {doc['model']}, {doc['machine'].get('device_name') or 'CPU'} "
                 f"(dgpo_ops {doc['machine'].get('dgpo_ops_commit')})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default=None,
                        help="default: qwen2.5-1.5b on CUDA, cpu-small on the CPU")
    parser.add_argument("--prompt-length", type=int, default=None)
    parser.add_argument("--completions", default=None, help="comma-separated completion lengths")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-search", action="store_true", help="skip the longest-completion search (CUDA)")
    parser.add_argument("--output", default=None, help="JSON path (default: bench/results/train_step-<device>.json)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_name = args.model or ("qwen2.5-1.5b" if device == "cuda" else "cpu-small")
    prompt_length = args.prompt_length or SHAPES[model_name][0]
    lengths = [int(x) for x in args.completions.split(",")] if args.completions else list(SHAPES[model_name][1])
    if args.child:
        child(args.child, model_name, prompt_length, lengths, args.repeats, not args.no_search)
        return 0

    from dgpo_ops.trainer.app.environment import describe

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        parser.error(f"unknown path(s) {bad}; choose from {list(PATHS)}")
    doc = {
        "command": "python bench/train_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe(torch.device(device), packages=("trl", "transformers", "liger-kernel")),
        # "parameters": from the first path that builds the model
        "model": model_name, "model_config": MODELS[model_name], "parameters": None,
        "vocab_size": MODELS[model_name]["vocab_size"], "prompt_length": prompt_length,
        "completion_lengths": lengths, "repeats": args.repeats, "bf16": device == "cuda",
        "memory_method": "torch.cuda.max_memory_allocated" if device == "cuda" else "VmHWM after clear_refs",
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        "paths": {p: PATHS[p].description for p in paths}, "results": [], "complete": False,
    }
    tag = doc["machine"].get("device_name", "cpu").lower().replace(" ", "-") if device == "cuda" else "cpu"
    out = Path(args.output) if args.output else RESULTS_DIR / f"train_step-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # fp32 on the CPU: the paths sum in other orders (1e-4); bf16 autocast on CUDA rounds differently (2e-2)
    rtol = 2e-2 if device == "cuda" else 1e-4
    for path in paths:
        started = time.perf_counter()
        reason = unavailable(path, device)  # known here: no process started to find it out
        result = {"path": path, "skipped": reason} if reason else run_path(
            path, model_name, prompt_length, lengths, args.repeats, not args.no_search)
        result["wall_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps(result), flush=True)
        doc["results"].append(result)
        doc["parameters"] = doc["parameters"] or result.get("parameters")
        check_against_trl(doc["results"], rtol)
        out.write_text(json.dumps(doc, indent=1) + "\n")  # after every path: a cut-short run keeps what it measured
    doc["complete"] = True
    out.write_text(json.dumps(doc, indent=1) + "\n")
    table = markdown(doc)
    out.with_suffix(".md").write_text(table)
    plot(doc, (PLOTS_DIR if args.output is None else out.parent) / f"{out.stem}.png")
    print(table)
    rows = [(r["path"], row["completion_length"], row.get("matches_trl")) for r in doc["results"]
            for row in r.get("rows", ()) if "loss" in row]
    if any(ok is None for *_, ok in rows):
        print("TRL's path did not run: the first updates were not checked against it", file=sys.stderr)
    mismatched = [(path, length) for path, length, ok in rows if ok is False]
    if mismatched:
        print(f"paths whose first update differs from TRL's: {mismatched}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
