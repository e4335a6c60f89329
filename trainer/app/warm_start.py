r"""The SFT warm start and the held-out evaluation of ``dgpo-ops train``.

* :func:`sft_warm_start` -- a few hundred AdamW steps of next-token cross-entropy on the completion
  tokens of ``prompt + solution + <eos>`` (the prompt is tokenized alone, exactly as the RL trainer
  tokenizes it), so a randomly initialised policy emits ``\boxed{...}`` answers at all.
* :func:`evaluate` -- greedy decoding on the held-out problems, scored by the same math-verify
  :func:`~dgpo_ops.trainer.rewards.accuracy_reward` as the RL reward; returns the accuracy, the share
  of well-formatted completions and a few samples.
"""

from __future__ import annotations

import math
import random
import time

import torch

EVAL_SCORING_TIMEOUT_S = 600.0
EVAL_SAMPLING_SEED = 1234  # pass@k's samples (a fixed stream, apart from training's)


def _encode(tokenizer, texts: list) -> list[list[int]]:
    texts = [t if isinstance(t, str) else tokenizer.apply_chat_template(t, tokenize=False, add_generation_prompt=True)
             for t in texts]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def sft_warm_start(model, tokenizer, rows: list[dict], *, steps: int, batch_size: int = 64, lr: float = 3e-3,
                   warmup: int = 20, seed: int = 0, progress=None, log=None) -> list[dict]:
    """Train ``model`` in place on ``rows`` (``prompt``, ``solution``); returns the per-step loss history."""
    if steps <= 0:
        return []
    device = next(model.parameters()).device
    prompts = _encode(tokenizer, [r["prompt"] for r in rows])
    completions = _encode(tokenizer, [r["solution"] for r in rows])
    eos = tokenizer.eos_token_id
    examples = [(p, c + [eos]) for p, c in zip(prompts, completions, strict=True)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))

    def lr_factor(s: int) -> float:  # linear warm-up, then cosine decay to a tenth
        return min(1.0, (s + 1) / max(1, warmup)) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / steps))))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    rng = random.Random(seed)
    order: list[int] = []
    history = []
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        batch, order = [examples[i] for i in order[:batch_size]], order[batch_size:]
        length = max(len(p) + len(c) for p, c in batch)
        ids = torch.full((len(batch), length), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        attention = torch.zeros_like(ids)
        for i, (p, c) in enumerate(batch):  # right padding; the loss is on completion tokens only
            n = len(p) + len(c)
            ids[i, :n] = torch.tensor(p + c)
            labels[i, len(p):n] = torch.tensor(c)
            attention[i, :n] = 1
        start = time.perf_counter()
        out = model(input_ids=ids.to(device), attention_mask=attention.to(device), labels=labels.to(device))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss = out.loss.item()
        history.append({"step": step + 1, "loss": loss, "lr": schedule.get_last_lr()[0],
                        "step_time": time.perf_counter() - start})
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.3f}")
        if log is not None and ((step + 1) % max(1, steps // 10) == 0 or step + 1 == steps):
            log(f"sft step {step + 1}/{steps} | loss {loss:.4f} | lr {history[-1]['lr']:.2e}")
    return history


@torch.no_grad()
def generate_completions(model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int = 128,
                         samples: int = 0) -> tuple[list[str], list[int]]:
    """Greedy completions of plain-text or conversational prompts (left padding, stop at eos), and their
    lengths in tokens (eos included). ``samples`` > 0: that many completions per prompt sampled at temperature
    1 instead (no top-k or top-p), prompt after prompt (``samples`` consecutive entries each)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    texts, lengths = [], []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            if chunk and not isinstance(chunk[0], str):
                chunk = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in chunk]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=samples) \
                if samples else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, **sampling, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            new = out[:, enc["input_ids"].shape[1]:]
            texts += tokenizer.batch_decode(new, skip_special_tokens=True)
            ended = new == tokenizer.eos_token_id
            first_eos = torch.where(ended.any(1), ended.float().argmax(1) + 1, new.shape[1])
            lengths += first_eos.tolist()
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return texts, lengths


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are right: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al. 2021), the chance that k samples drawn without replacement hold a right one."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_rates(counts: list[int], samples: int) -> dict:
    """``pass@1`` and ``pass@<samples>`` over problems, from each problem's count of right samples."""
    ks = sorted({1, samples})
    if not counts:  # no problems: undefined, as the accuracy of none
        return {f"pass@{k}": float("nan") for k in ks}
    return {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in counts) / len(counts) for k in ks}


def evaluate(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 128, pass_k: int = 0) -> dict:
    """Greedy held-out accuracy (math-verify), format rate, mean completion length, three samples, and per
    problem (in ``rows`` order) whether it was right and its completion length in tokens. ``pass_k`` > 0: also
    ``pass_k`` completions per problem sampled at temperature 1, each problem's count of right ones
    (``pass_counts_each``) and the unbiased ``pass@1`` and ``pass@<pass_k>``."""
    from ..rewards import accuracy_reward, format_reward

    if not rows:
        empty = {"accuracy": float("nan"), "format": float("nan"), "length": float("nan"), "n": 0, "correct": 0,
                 "samples": [], "correct_each": [], "length_each": []}
        return {**empty, "pass_k": pass_k, "pass_counts_each": [], **pass_rates([], pass_k)} if pass_k else empty
    prompts = [r["prompt"] for r in rows]
    completions, lengths = generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size)
    answers = [r["answer"] for r in rows]
    # A deadline far beyond any batch's scoring time: an answer scored 0 for lack of time would bias the comparison.
    correct = accuracy_reward(prompts, completions, answer=answers, timeout_s=EVAL_SCORING_TIMEOUT_S)
    formatted = format_reward(prompts, completions)
    samples = [{"prompt": p if isinstance(p, str) else p[-1]["content"], "completion": c, "answer": a, "correct": s}
               for p, c, a, s in list(zip(prompts, completions, answers, correct))[:3]]
    result = {"accuracy": sum(correct) / len(rows), "format": sum(formatted) / len(rows),
              "length": sum(lengths) / len(rows), "n": len(rows),
              "correct": int(sum(correct)), "samples": samples,
              "correct_each": [int(c) for c in correct], "length_each": lengths}
    if pass_k:
        # Sampled from a fixed seed in a forked RNG: the evaluation is reproducible and leaves the training's
        # random stream (its own sampling) as it would be without --eval-pass-k.
        device = next(model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(EVAL_SAMPLING_SEED)
            sampled, _ = generate_completions(model, tokenizer, prompts, max_new_tokens, max(1, batch_size // pass_k),
                                              pass_k)
        right = accuracy_reward([p for p in prompts for _ in range(pass_k)], sampled,
                                answer=[a for a in answers for _ in range(pass_k)], timeout_s=EVAL_SCORING_TIMEOUT_S)
        counts = [int(sum(right[i * pass_k:(i + 1) * pass_k])) for i in range(len(rows))]
        result.update(pass_k=pass_k, pass_counts_each=counts, **pass_rates(counts, pass_k))
    return result


def evaluate_distributed(accelerator, model, tokenizer, rows, max_new_tokens, pass_k: int = 0) -> dict:
    """Greedy held-out accuracy; with several processes each scores a shard and the counts are summed.

    The policy is unwrapped the way TRL unwraps it for generation (DeepSpeed ZeRO-3 parameters gathered on every
    process), so each process then generates on its own shard without collectives.
    """
    from accelerate.utils import gather_object
    from trl.models.utils import unwrap_model_for_generation

    world, rank = accelerator.num_processes, accelerator.process_index
    with unwrap_model_for_generation(model, accelerator) as policy:
        part = evaluate(policy, tokenizer, rows[rank::world], max_new_tokens, pass_k=pass_k)
    if world == 1:
        return part
    parts = gather_object([part])
    return merge_evaluations(parts)


def merge_evaluations(parts: list[dict]) -> dict:
    """One evaluation from the shards of several processes (shard ``r`` holds rows ``r::world``)."""
    n = sum(p["n"] for p in parts)
    correct = sum(p.get("correct", 0) for p in parts)
    formatted = sum(p["format"] * p["n"] for p in parts if p["n"])
    tokens = sum(p["length"] * p["n"] for p in parts if p["n"])
    world = len(parts)
    pass_k = parts[0].get("pass_k", 0)
    keys = ("correct_each", "length_each") + (("pass_counts_each",) if pass_k else ())
    each = {key: [None] * n for key in keys}
    for rank, part in enumerate(parts):
        for key, values in each.items():
            values[rank::world] = part[key]
    merged = {"accuracy": correct / max(1, n), "format": formatted / max(1, n), "length": tokens / max(1, n), "n": n,
              "correct": correct, "samples": parts[0]["samples"], **each}
    if pass_k:
        merged.update(pass_k=pass_k, **pass_rates(each["pass_counts_each"], pass_k))
    return merged
