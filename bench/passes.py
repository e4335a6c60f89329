"""How many GEMM passes over the lm_head weight one policy update pays: DGPOTrainer (fused linear and
fused logits) against TRL's GRPOTrainer, for each of TRL's loss options and three kinds of method.

    python bench/passes.py [--model tiny] [--methods ...] [--options ...] [--paths ...] [--output PATH]

A pass is one product of every completion position with the whole vocabulary: ``2 H V`` FLOPs per position.
The fused-linear op is designed around three (logits tile, d hidden, d weight); TRL's chunked head pays four
(its forward, then in the backward the recomputed logits, d hidden and d weight) over every position but the
last, the prompt's included. ``VocabularyGemmCounter`` (a ``TorchDispatchMode``) sees every matmul dispatched
during ``_compute_loss`` (the model's forward and the loss) and the backward, and counts the ones with an operand
dimension equal to the vocabulary size: the lm_head's products, wherever they run (the model's ``lm_head``, TRL's
``ChunkedLogProbFunction``, ``fused_linear_dgpo_loss``'s tiles). ``passes`` is their FLOPs over one pass of the
batch's completion positions (``B x completion length``; passes per scored token when every position is
scored, as here: every completion has the full length). The vocabulary size is checked to differ from every
other dimension of the model and batch, so that no other matmul is taken for the lm_head's.

The grid: options (``OPTIONS``: none, TRL's high-entropy token mask, its off-policy sequence mask, the entropy
bonus, adaptive entropy while it applies a bonus, all of them) x methods (``METHODS``: grpo, token-local; TRL's
GSPO, a sequence ratio; clip_cov, whose token selection needs the whole batch) x paths (``PATHS``). GRPOTrainer
has no clip_cov: its clip_cov row is its default loss (TRL's head is the same whatever the loss). Each case is
one update of ``bench/train_step.py``'s tiny model (its trainers, its synthetic rollouts); the counts are the
same on every run of the same code on the same device kind (no time is involved), and ``tests/bench/test_passes.py``
pins them next to ``designed_passes``.

Writes ``bench/results/passes-<device>.json`` (machine and commit from ``dgpo_ops.trainer.app.environment.describe``)
after every case, and the table beside it (``.md``) at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/passes.py` from anywhere: bench.* imports from the repository
    sys.path.insert(0, str(REPO))

from bench.train_step import MODELS, RESPONSES, synthetic_rollouts
from dgpo_ops.core.options import DEFAULT_MEMORY_BUDGET
from dgpo_ops.ops.linear import vocab_block_rows

RESULTS_DIR = REPO / "bench" / "results"

# option -> GRPOConfig fields (both trainers take them). Adaptive entropy applies its bonus only once the
# previous step's entropy is at or below the target (`ACTIVE_ADAPTIVE_ENTROPY` puts the trainer there).
OPTIONS = {
    "plain": {},
    "entropy_mask": {"top_entropy_quantile": 0.2},
    "off_policy_mask": {"off_policy_mask_threshold": 0.5},
    "entropy_bonus": {"entropy_coef": 0.01},
    "adaptive_entropy": {"use_adaptive_entropy": True, "entropy_coef": 0.01},
    "all": {"top_entropy_quantile": 0.2, "off_policy_mask_threshold": 0.5, "use_adaptive_entropy": True,
            "entropy_coef": 0.01},
}
# method -> (DGPOTrainer's policy_loss, GRPOConfig fields of the method, for both trainers)
METHODS = {
    "grpo": ("grpo", {}),
    "gspo": ("grpo", {"importance_sampling_level": "sequence", "loss_type": "grpo"}),  # TRL's GSPO recipe
    "clip_cov": ("clip_cov", {}),
}
PATHS = ("dgpo_linear", "dgpo_logits", "trl")
PATH_LABELS = {"dgpo_linear": "DGPOTrainer fused linear", "dgpo_logits": "DGPOTrainer fused logits",
               "trl": "GRPOTrainer"}
# TRL's first accumulation window applies no adaptive bonus (its last entropy starts at inf); an entropy of 0 is at
# or below any target, so the bonus applies from the first update: the case that costs passes.
ACTIVE_ADAPTIVE_ENTROPY = 0.0
# the options whose mask needs every token's current log-prob or entropy before any coefficient exists
MASK_FIELDS = ("top_entropy_quantile", "off_policy_mask_threshold")
COUNT_SHAPE = {"tiny": (16, 32)}  # model -> (prompt length, completion length) of the counted update
# aten matmuls by overload packet name; the trailing-underscore in-place forms (`addmm_`, a gradient accumulated
# into its buffer) and the `out=` overloads (`mm.out`, a tile written into its buffer) have the same operands
MATMUL_OPERANDS = {"mm": (0, 1), "_scaled_mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2),
                   "addbmm": (1, 2)}


def matmul_flops(name: str, args) -> int | None:
    """2 M K N (times the batch of a batched product) of one aten matmul call, None for another op."""
    operands = MATMUL_OPERANDS.get(name.rstrip("_") if name != "_scaled_mm" else name)
    if operands is None:
        return None
    a, b = args[operands[0]], args[operands[1]]
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class VocabularyGemmCounter(TorchDispatchMode):
    """Counts the matmuls dispatched inside it that have an operand dimension equal to ``vocab`` (calls and
    FLOPs), under the phase name in ``phase``, and lists each distinct call (op and operand shapes)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.phase, self.counts, self.calls = vocab, "forward", {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flops = matmul_flops(func.overloadpacket.__name__, args)
        if flops is not None:
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            if any(self.vocab in shape for shape in shapes):
                entry = self.counts.setdefault(self.phase, {"calls": 0, "flops": 0})
                entry["calls"] += 1
                entry["flops"] += flops
                key = f"{self.phase} {func} {shapes}"
                self.calls[key] = self.calls.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def _other_dimensions(config: dict, prompt_length: int, completion_length: int) -> set[int]:
    """Every size a matmul of the model's layers can have: a vocabulary equal to one of them is refused."""
    heads = config["num_attention_heads"]
    sizes = {config["hidden_size"], config["intermediate_size"], config["hidden_size"] // heads,
             config["num_key_value_heads"] * config["hidden_size"] // heads}
    for length in (completion_length, prompt_length + completion_length, prompt_length + completion_length + 1):
        sizes |= {length, RESPONSES * length}
    return sizes


def count_case(path: str, method: str, option: str, model_name: str = "tiny", device: str = "cpu",
               workdir: str | None = None) -> dict:
    """The lm_head's matmul calls, FLOPs and passes of one update (forward with the loss, then backward) of
    ``path`` with ``METHODS[method]`` and ``OPTIONS[option]``."""
    from bench.train_step import build_trainer

    prompt_length, completion_length = COUNT_SHAPE.get(model_name, (16, 32))
    config = MODELS[model_name]
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    if vocab in _other_dimensions(config, prompt_length, completion_length):
        raise ValueError(f"the vocabulary ({vocab}) equals another dimension of {model_name}: its matmuls would "
                         "be counted as the lm_head's")
    if vocab > vocab_block_rows(DEFAULT_MEMORY_BUDGET, torch.empty(0, hidden)):
        # a weight cast one vocabulary block at a time (autocast; bf16 on the CPU) is multiplied in products whose
        # dimension is the block's, not the vocabulary's: the counter would miss them
        raise ValueError(f"the vocabulary ({vocab}) spans several of the fused linear's cast blocks at hidden size "
                         f"{hidden}: its lm_head products would not be counted")
    policy_loss, method_fields = METHODS[method]
    with tempfile.TemporaryDirectory() as scratch:
        trainer = build_trainer(path, model_name, completion_length, workdir or scratch, device,
                                policy_loss=policy_loss, fields={**method_fields, **OPTIONS[option]})
        if trainer.use_adaptive_entropy:
            trainer._last_world_entropy = ACTIVE_ADAPTIVE_ENTROPY
        inputs = synthetic_rollouts(prompt_length, completion_length, vocab, device)
        inputs["completion_mask"] = torch.ones_like(inputs["completion_mask"])  # every position scored
        inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
        counter = VocabularyGemmCounter(vocab)
        model = trainer.model_wrapped
        with counter:
            counter.phase = "forward"
            with trainer.compute_loss_context_manager():
                loss = trainer._compute_loss(model, inputs)
            counter.phase = "backward"
            trainer.accelerator.backward(loss)
        positions = RESPONSES * completion_length
        one_pass = 2 * hidden * vocab * positions
        counts = counter.counts
        flops = sum(c["flops"] for c in counts.values())
        return {"path": path, "method": method, "option": option,
                "passes": flops / one_pass,
                "forward_passes": counts.get("forward", {}).get("flops", 0) / one_pass,
                "backward_passes": counts.get("backward", {}).get("flops", 0) / one_pass,
                "calls": sum(c["calls"] for c in counts.values()), "flops": flops,
                "completion_positions": positions, "scored_tokens": int(inputs["completion_mask"].sum()),
                "loss_finite": bool(torch.isfinite(loss.detach()).item()), "distinct_calls": counter.calls}


def designed_passes(path: str, method: str, option: str, prompt_length: int, completion_length: int,
                    device: str = "cpu") -> float:
    """The passes each path is built to pay for one case (the same on CUDA and on the CPU).

    ``dgpo_linear``: three (logits tile, d hidden, d weight) when every token's coefficients are known where its
    row is finished (a token-local method, no mask that needs the whole batch's log-probs or entropies; the
    entropy bonus is one more term of the same pass); four otherwise: one shared first sweep (log-probs and
    entropies, for the masks and the sequence statistics) and the full sweep. ``dgpo_logits``: the model's
    ``lm_head`` and its backward, three over the completion positions and the one after the last (the loss reads
    the logits, not the weight). ``trl``: TRL's chunked head, four (its forward, then the recomputed logits, d hidden
    and d weight): on a Triton device (CUDA) over the labelled positions alone (its ``compact`` branch), elsewhere
    over every position but the last, the prompt's included. Not ours to change: its count is here to compare with."""
    if path == "trl":
        return 4.0 if device == "cuda" else 4 * (prompt_length + completion_length - 1) / completion_length
    if path == "dgpo_logits":
        return 3 * (completion_length + 1) / completion_length
    first_sweep = method != "grpo" or any(key in OPTIONS[option] for key in MASK_FIELDS)
    return 4.0 if first_sweep else 3.0


def markdown(doc: dict) -> str:
    m = doc["machine"]
    where = m.get("device_name") or "CPU"
    prompt_length, completion_length = doc["prompt_length"], doc["completion_length"]
    lines = [
        (f"{where} ({m['device']}), torch {m['torch']}, trl {m.get('trl')}, transformers {m.get('transformers')}; "
        f"dgpo_ops {m.get('dgpo_ops_commit')}{' + local changes' if m.get('dgpo_ops_worktree_dirty') else ''}; "
        f"`{doc['command']}`. Model {doc['model']} (hidden {doc['hidden_size']}, vocabulary {doc['vocab_size']}), "
        f"{RESPONSES} responses, prompt {prompt_length}, completion {completion_length} (every position scored). "
        "Passes: FLOPs of the matmuls with a vocabulary-sized operand during `_compute_loss` and the backward, over "
        f"2 x hidden x vocabulary x {RESPONSES * completion_length} completion positions; `today / designed` "
        "(`designed_passes`). The counts do not depend on the machine's load."),
        "",
        "| method | option | " + " | ".join(PATH_LABELS[p] for p in doc["paths"]) + " |",
        "|---|---|" + "---|" * len(doc["paths"]),
    ]
    rows = {(r["method"], r["option"], r["path"]): r for r in doc["rows"]}

    def cell(method, option, path):
        row = rows.get((method, option, path))
        if row is None:
            return "-"
        text = f"{row['passes']:.2f} / {row['designed_passes']:.2f}"
        return f"**{text}**" if row["passes"] > row["designed_passes"] + 1e-9 else text

    for method in doc["methods"]:
        for option in doc["options"]:
            lines.append(f"| {method} | {option} | " + " | ".join(cell(method, option, p) for p in doc["paths"]) + " |")
    lines += ["", "Bold: more passes than designed."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=tuple(COUNT_SHAPE))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--output", default=None, help="JSON path (default: bench/results/passes-<device>.json)")
    args = parser.parse_args(argv)
    from dgpo_ops.trainer.app.environment import describe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    methods, options, paths = (_choose(args.methods, METHODS), _choose(args.options, OPTIONS),
                               _choose(args.paths, PATHS))
    prompt_length, completion_length = COUNT_SHAPE[args.model]
    config = MODELS[args.model]
    doc = {
        "command": "python bench/passes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe(torch.device(device), packages=("trl", "transformers")),
        "model": args.model, "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"],
        "prompt_length": prompt_length, "completion_length": completion_length, "responses": RESPONSES,
        "methods": methods, "options": options, "paths": paths,
        "option_fields": {o: OPTIONS[o] for o in options},
        "method_fields": {m: {"policy_loss": METHODS[m][0], **METHODS[m][1]} for m in methods},
        "rows": [], "complete": False,
    }
    tag = doc["machine"]["device_name"].lower().replace(" ", "-") if device == "cuda" else "cpu"
    out = Path(args.output) if args.output else RESULTS_DIR / f"passes-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    total = len(methods) * len(options) * len(paths)
    for method in methods:
        for option in options:
            for path in paths:
                started = time.perf_counter()
                row = count_case(path, method, option, args.model, device)
                row["designed_passes"] = designed_passes(path, method, option, prompt_length, completion_length, device)
                row["seconds"] = round(time.perf_counter() - started, 2)
                doc["rows"].append(row)
                out.write_text(json.dumps(doc, indent=1) + "\n")  # after every case: a cut-short run keeps them
                print(f"[passes {len(doc['rows'])}/{total}] {method:<8} {option:<17} {path:<12} "
                      f"{row['passes']:.2f} (designed {row['designed_passes']:.2f}; forward {row['forward_passes']:.2f},"
                      f" backward {row['backward_passes']:.2f}, {row['calls']} calls)", flush=True)
    return finish(doc, out, markdown(doc))


def finish(doc: dict, out, table: str) -> int:
    """Mark a grid's results complete, write them with their table beside them (``.md``), print the table."""
    doc["complete"] = True
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


def _choose(text: str, known) -> list[str]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise SystemExit(f"unknown {unknown}; choose from {list(known)}")
    return chosen


if __name__ == "__main__":
    sys.exit(main())
