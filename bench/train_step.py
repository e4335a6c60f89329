"""One policy update of a real-size model, as a user runs it: ``DGPOTrainer`` against TRL's ``GRPOTrainer``.

    python bench/train_step.py [--model qwen2.5-1.5b] [--completions 2048,8192,16384] [--paths ...]
                               [--repeats 3] [--no-search]

The model has Qwen2.5-1.5B's architecture (``MODELS``, built from its config with random weights; nothing is
downloaded), fp32 master weights under bf16 autocast (on CUDA) and activation checkpointing on. The rollouts are
synthetic: 8 responses to one prompt of 512 tokens, completions of the given length (the longest response; the
others end uniformly between half of it and all of it, padded as TRL pads them), one advantage per response,
on-policy (no old log-probs: TRL 1.16's default ``num_iterations=1``). One update is what the trainer does
per optimizer step after generation: ``_compute_loss`` (the model's forward and the loss), the backward, gradient
clipping at 1.0 and the AdamW step (TRL's default, fused).

Paths (``PATHS``): ``DGPOTrainer`` with ``fused="linear"`` (the default: hidden states and the lm_head through
``fused_linear_dgpo_loss``) and ``fused="logits"`` (the model's logits through ``fused_dgpo_loss``), both with
``policy_loss="grpo"`` so that the loss is TRL's; stock ``GRPOTrainer`` (TRL 1.16's default loss path, its chunked
fused lm_head); and ``GRPOTrainer(use_liger_kernel=True)`` (Liger's RMSNorm/RoPE/SwiGLU kernels, TRL's loss).
Every path starts from the same weights and batch; the first update's loss and gradient norm are recorded and
compared with TRL's, so a path computing something else shows in the table.

Each path runs in its own process (one path's allocator cache or Liger's patches never reach another). Per
completion length: one untimed update (it allocates the optimizer state and compiles), then ``--repeats`` timed
updates (synchronised wall time); peak memory is ``torch.cuda.max_memory_allocated()`` over the timed updates
(CUDA) or the peak resident set (``VmHWM``, CPU), both absolute: weights, gradients, optimizer state and
activations, what decides whether a length fits. On CUDA, unless ``--no-search``, the longest completion that
fits is searched in steps of 1,024 tokens (doubling until an update runs out of memory, then bisecting).

Writes ``bench/results/train_step-<device>.json``, the table beside it (``.md``) and
``bench/plots/train_step-<device>.png``; ``python -m bench.report`` puts the tables and plots into the README.
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


def longest_fitting(fits, step: int = SEARCH_STEP, limit: int = SEARCH_LIMIT) -> tuple[int | None, list[int]]:
    """The largest multiple of ``step`` up to ``limit`` for which ``fits(length)`` holds, assuming it holds up to
    some length and never above it; ``(None, probes)`` when even ``step`` does not fit. Doubles from ``step``
    until a length fails, then bisects between the last that fit and the first that failed."""
    probes = []

    def probe(length):
        probes.append(length)
        return fits(length)

    if not probe(step):
        return None, probes
    good, bad = step, None
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


def build_trainer(path: str, model_name: str, completion_length: int, workdir: str, device: str):
    import torch
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dgpo_ops.trainer.tiny_model import build_tokenizer

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
                  save_strategy="no")
    if spec.dgpo_fused is not None:
        from dgpo_ops.trainer import DGPOConfig, DGPOTrainer

        cls, args = DGPOTrainer, DGPOConfig(policy_loss="grpo", fused=spec.dgpo_fused, **common)
    else:
        from trl import GRPOConfig, GRPOTrainer

        cls, args = GRPOTrainer, GRPOConfig(**common)
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                  train_dataset=Dataset.from_dict({"prompt": ["1+1="] * RESPONSES}), processing_class=tokenizer)
    # What Trainer.train() does before its first step, and nothing of its loop: Liger's kernels, checkpointing.
    if spec.liger:
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(trainer.model, trainer.args.liger_kernel_config)
    trainer.model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=trainer.args.activation_checkpointing_kwargs or None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.create_optimizer()
    return trainer


def synthetic_rollouts(prompt_length: int, completion_length: int, vocab: int, device: str, seed: int = 0) -> dict:
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
        "num_items_in_batch": completion_mask.sum(),
    }
    return {k: v.to(device) for k, v in inputs.items()}


def update(trainer, inputs) -> tuple:
    """One optimizer step on ``inputs``: (loss, pre-clip gradient norm), on the device."""
    import torch

    model, optimizer = trainer.model, trainer.optimizer
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=trainer.args.bf16):
        loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm


def _rss_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        pass


def _peak_bytes(device: str) -> int | None:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    hwm = _rss_kib("VmHWM")
    return None if hwm is None else hwm * 1024


def measure_lengths(trainer, prompt_length, lengths, repeats, device) -> list[dict]:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    vocab = trainer.model.config.vocab_size
    rows = []
    for length in lengths:
        inputs = synthetic_rollouts(prompt_length, length, vocab, device)
        tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
        row = {"completion_length": length, "prompt_length": prompt_length, "responses": RESPONSES, "tokens": tokens}
        try:
            started = time.perf_counter()
            loss, grad_norm = update(trainer, inputs)
            sync()
            row["first_update_s"] = time.perf_counter() - started
            row["loss"], row["grad_norm"] = float(loss), float(grad_norm)
            _reset_peak(device)
            times = []
            for _ in range(repeats):
                sync()
                started = time.perf_counter()
                update(trainer, inputs)
                sync()
                times.append(time.perf_counter() - started)
            row.update(seconds=times, seconds_median=statistics.median(times), peak_bytes=_peak_bytes(device))
            row["tokens_per_s"] = tokens / row["seconds_median"]
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e).splitlines()[0]}"
        trainer.optimizer.zero_grad(set_to_none=True)
        del inputs
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def fits_in_memory(trainer, prompt_length, device):
    import torch

    vocab = trainer.model.config.vocab_size

    def fits(length: int) -> bool:
        inputs = synthetic_rollouts(prompt_length, length, vocab, device)
        try:
            update(trainer, inputs)
            torch.cuda.synchronize()
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        trainer.optimizer.zero_grad(set_to_none=True)
        del inputs
        gc.collect()
        torch.cuda.empty_cache()
        return ok

    return fits


def child(path: str, model_name: str, prompt_length: int, lengths: list[int], repeats: int, search: bool) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    reason = unavailable(path, device)
    if reason:
        return {"path": path, "skipped": reason}
    with tempfile.TemporaryDirectory() as workdir:
        trainer = build_trainer(path, model_name, max(lengths), workdir, device)
        result = {"path": path, "rows": measure_lengths(trainer, prompt_length, lengths, repeats, device)}
        if search and device == "cuda":
            longest, probes = longest_fitting(fits_in_memory(trainer, prompt_length, device))
            result.update(longest_completion=longest, search_probes=probes)
        elif search:
            result["longest_completion_skipped"] = "searched on CUDA only: the CPU has no device memory to run out of"
    return result


# ----------------------------------------------------------------------------- the driver


def run_path(path, model_name, prompt_length, lengths, repeats, search, timeout=3600.0) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "bench.train_step", "--child", path, "--model", model_name,
           "--prompt-length", str(prompt_length), "--completions", ",".join(map(str, lengths)),
           "--repeats", str(repeats)] + ([] if search else ["--no-search"])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"path": path, "error": f"exited {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


def check_against_trl(results: list[dict], rtol: float) -> None:
    """Each path's first-update loss and gradient norm against TRL's at every length: ``loss_vs_trl`` and
    ``grad_norm_vs_trl`` (relative differences) and ``matches_trl`` on each row."""
    trl = {row["completion_length"]: row for r in results if r["path"] == "trl" for row in r.get("rows", ())}
    for result in results:
        for row in result.get("rows", ()):
            ref = trl.get(row["completion_length"])
            if ref is None or "loss" not in row or "loss" not in ref:
                continue
            row["loss_vs_trl"] = abs(row["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
            row["grad_norm_vs_trl"] = abs(row["grad_norm"] - ref["grad_norm"]) / max(abs(ref["grad_norm"]), 1e-12)
            row["matches_trl"] = row["loss_vs_trl"] <= rtol and row["grad_norm_vs_trl"] <= rtol


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def markdown(doc: dict) -> str:
    m = doc["machine"]
    where = m.get("device_name") or f"CPU ({m['cpu_count']} cores)"
    lines = [
        f"{where}, torch {m['torch']}, trl {m.get('trl')}, transformers {m.get('transformers')}, liger-kernel "
        f"{m.get('liger_kernel')}; dgpo_ops {m.get('dgpo_ops_commit')}"
        f"{' + local changes' if m.get('dgpo_ops_worktree_dirty') else ''}; `{doc['command']}`. Model "
        f"{doc['model']} ({doc['parameters'] / 1e6:.1f} M parameters, vocabulary {doc['vocab_size']:,}), "
        f"{RESPONSES} responses, prompt {doc['prompt_length']} tokens, {'bf16 autocast' if doc['bf16'] else 'fp32'}, "
        f"activation checkpointing; one update = loss forward, backward, clip, AdamW step; median of "
        f"{doc['repeats']} updates; peak memory absolute ({doc['memory_method']}).",
        "",
        "| completion | path | update (s) | tokens/s | peak (GB) | loss vs TRL | grad norm vs TRL |",
        "|---|---|---|---|---|---|---|",
    ]
    for length in doc["completion_lengths"]:
        for result in doc["results"]:
            row = next((r for r in result.get("rows", ()) if r["completion_length"] == length), None)
            if row is None or "seconds_median" not in row:
                why = result.get("skipped") or result.get("error") or (row or {}).get("error", "not run")
                lines.append(f"| {length:,} | {result['path']} | - | - | - | {why} | |")
                continue
            lines.append(f"| {length:,} | {result['path']} | {row['seconds_median']:.3f} | "
                         f"{row['tokens_per_s']:,.0f} | {_gb(row['peak_bytes'])} | "
                         f"{row.get('loss_vs_trl', float('nan')):.1e} | {row.get('grad_norm_vs_trl', float('nan')):.1e} |")
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


def parameter_count(model_name: str) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**MODELS[model_name]))
    return sum(p.numel() for p in model.parameters())


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
        print(json.dumps(child(args.child, model_name, prompt_length, lengths, args.repeats, not args.no_search)))
        return 0

    from dgpo_ops.environment import describe

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        parser.error(f"unknown path(s) {bad}; choose from {list(PATHS)}")
    results = []
    for path in paths:
        started = time.perf_counter()
        result = run_path(path, model_name, prompt_length, lengths, args.repeats, not args.no_search)
        result["wall_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps(result), flush=True)
        results.append(result)
    # fp32 on the CPU: the paths sum in other orders (1e-4); bf16 autocast on CUDA rounds differently (2e-2)
    check_against_trl(results, rtol=2e-2 if device == "cuda" else 1e-4)
    doc = {
        "command": "python bench/train_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe(torch.device(device), packages=("trl", "transformers", "liger-kernel")),
        "model": model_name, "model_config": MODELS[model_name], "parameters": parameter_count(model_name),
        "vocab_size": MODELS[model_name]["vocab_size"], "prompt_length": prompt_length,
        "completion_lengths": lengths, "repeats": args.repeats, "bf16": device == "cuda",
        "memory_method": "torch.cuda.max_memory_allocated" if device == "cuda" else "VmHWM after clear_refs",
        "paths": {p: PATHS[p].description for p in paths}, "results": results,
    }
    tag = doc["machine"].get("device_name", "cpu").lower().replace(" ", "-") if device == "cuda" else "cpu"
    out = Path(args.output) if args.output else RESULTS_DIR / f"train_step-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    table = markdown(doc)
    out.with_suffix(".md").write_text(table)
    plot(doc, (PLOTS_DIR if args.output is None else out.parent) / f"{out.stem}.png")
    print(table)
    mismatched = [(r["path"], row["completion_length"]) for r in results for row in r.get("rows", ())
                  if row.get("matches_trl") is False]
    if mismatched:
        print(f"paths whose first update differs from TRL's: {mismatched}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
