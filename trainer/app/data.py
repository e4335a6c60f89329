r"""Problems with exact answers for ``dgpo-ops train``: the default arithmetic task and user data sets.

Default task: ``a + b`` with 1- to ``max_digits``-digit operands, generated procedurally and offline by
``reasoning-gym``'s ``basic_arithmetic`` (Apache-2.0; prompt ``"Calculate 48 + 16."``), or by the
built-in generator below (``--generator builtin``), which draws problems the same way
(``num_digits ~ U{1..max_digits}``, operands ``~ U{0..10**num_digits}``) with Python's ``random``.

Splits are deterministic in ``data_seed``: the first ``train_size + eval_size`` distinct problems of
the stream, shuffled, then ``eval_size`` of them held out and the rest for training (disjoint by
expression, and from the same distribution). Every row has ``prompt``, ``answer`` (the exact result, what the rewards
check) and ``solution`` (the SFT warm start's target, ending in ``\boxed{answer}``: worked in the chosen
style, e.g. ``" 40+10=50, 8+6=14, 50+14=64. \boxed{64}"`` for ``48 + 16``, or the bare box).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import random

from .tiny_model import MissingPackage

GENERATORS = ("reasoning-gym", "builtin")
PROBLEM_COLUMNS = ("problem", "question", "prompt")
ANSWER_COLUMNS = ("answer", "solution")
BOXED_INSTRUCTION = "Put your final answer within \\boxed{}."


SOLUTION_STYLES = ("answer", "direct", "split", "column")


def worked_solution(a: int, b: int, style: str = "direct") -> str:
    r"""The SFT target for ``a + b``, ending in ``\boxed{a+b}``; the box always copies the line just before it.

    * ``direct``: ``" 48+16=64. \boxed{64}"``
    * ``split`` (tens and ones): ``" 40+10=50, 8+6=14, 50+14=64. \boxed{64}"``
    * ``column`` (digit by digit with carries): ``" 8+6=14, 4+1+1=6. \boxed{64}"``; the box must reassemble the
      digits in reverse order, which a tiny model often gets wrong independently of the steps.
    """
    total = a + b
    if style == "answer":
        return f" \\boxed{{{total}}}"
    if style == "direct":
        return f" {a}+{b}={total}. \\boxed{{{total}}}"
    if style == "split":
        ta, tb, oa, ob = a - a % 10, b - b % 10, a % 10, b % 10
        return f" {ta}+{tb}={ta + tb}, {oa}+{ob}={oa + ob}, {ta + tb}+{oa + ob}={total}. \\boxed{{{total}}}"
    if style == "column":
        width = max(len(str(a)), len(str(b)))
        steps, carry = [], 0
        for k in range(width):
            da, db = a // 10**k % 10, b // 10**k % 10
            digit_sum = da + db + carry
            steps.append(f"{da}+{db}" + (f"+{carry}" if carry else "") + f"={digit_sum}")
            carry = digit_sum // 10
        return " " + ", ".join(steps) + f". \\boxed{{{total}}}"
    raise ValueError(f"solution style must be one of {', '.join(SOLUTION_STYLES)}, got {style!r}")


def _builtin_stream(seed: int, max_digits: int):
    rng = random.Random(seed)
    while True:
        digits = rng.randint(1, max_digits)
        a, b = rng.randint(0, 10**digits), rng.randint(0, 10**digits)
        yield f"Calculate {a} + {b}.", a, b


def _reasoning_gym_stream(seed: int, max_digits: int, chunk: int = 4096):
    if importlib.util.find_spec("reasoning_gym") is None:
        raise MissingPackage("the default task needs reasoning-gym: pip install reasoning-gym (or pip install "
                             "'dgpo-ops[train]'), or use --generator builtin")
    import reasoning_gym

    start = 0
    while True:
        dataset = reasoning_gym.create_dataset(
            "basic_arithmetic", min_terms=2, max_terms=2, min_digits=1, max_digits=max_digits, operators=("+",),
            allow_parentheses=False, allow_negation=False, seed=seed + start, size=chunk)
        for item in dataset:
            a, b = (int(x) for x in item["metadata"]["expression"].split(" + "))
            if str(a + b) != item["answer"]:
                raise RuntimeError(f"reasoning-gym item disagrees with a + b: {item}")
            yield item["question"], a, b
        start += chunk


def arithmetic_splits(data_seed: int = 0, train_size: int = 2000, eval_size: int = 100, max_digits: int = 2,
                      generator: str = "reasoning-gym", style: str = "split", worked_fraction: float = 1.0
                      ) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows), disjoint by problem, deterministic in ``data_seed``.

    Each row's ``solution`` is in ``style``; with ``worked_fraction < 1`` a deterministic share
    ``1 - worked_fraction`` of the rows gets the bare answer (``answer`` style) instead.
    """
    if not 0.0 <= worked_fraction <= 1.0:
        raise ValueError(f"worked_fraction must be in [0, 1], got {worked_fraction}")
    mix = random.Random(f"{data_seed}-solution-mix")
    if generator not in GENERATORS:
        raise ValueError(f"--generator must be one of {', '.join(GENERATORS)}, got {generator!r}")
    if max_digits < 1:
        raise ValueError(f"max_digits must be >= 1, got {max_digits}")
    distinct = (10**max_digits + 1) ** 2  # operands 0..10**max_digits; fewer digits are a subset
    if train_size + eval_size > distinct // 2:
        raise ValueError(f"{train_size} + {eval_size} problems is too many for {max_digits}-digit addition "
                         f"({distinct} distinct problems at most); lower --train-size/--eval-size")
    stream = (_builtin_stream if generator == "builtin" else _reasoning_gym_stream)(data_seed, max_digits)
    problems: dict[str, tuple[int, int]] = {}
    for question, a, b in stream:
        problems.setdefault(question, (a, b))
        if len(problems) == train_size + eval_size:
            break
    # Held-out rows are a random sample of the same distinct problems, not the first ones drawn: the 121
    # one-digit problems run out early in the stream, so a prefix would over-represent them several times.
    questions = list(problems)
    random.Random(f"{data_seed}-split").shuffle(questions)
    splits: tuple[list[dict], list[dict]] = ([], [])
    for i, question in enumerate(questions):
        a, b = problems[question]
        row_style = style if mix.random() < worked_fraction else "answer"
        rows = splits[1] if i < eval_size else splits[0]
        rows.append({"prompt": question, "answer": str(a + b), "solution": worked_solution(a, b, row_style)})
    return splits


# ----------------------------------------------------------------------------- user data sets


def _read_rows(source: str, split: str | None) -> list[dict]:
    path = pathlib.Path(source)
    if path.exists():
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            text = path.read_text()
            if suffix == ".json" and text.lstrip().startswith("["):
                return json.loads(text)
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        if suffix == ".csv":
            import csv

            with open(path, newline="") as f:
                return list(csv.DictReader(f))
        raise ValueError(f"{source}: expected a .jsonl, .json, .parquet or .csv file")
    if path.suffix.lower() in (".jsonl", ".json", ".parquet", ".csv"):
        raise ValueError(f"{source}: no such file")
    from datasets import load_dataset

    try:
        return list(load_dataset(source, split=split or "train"))
    except Exception as e:  # noqa: BLE001 -- unreachable hub, unknown name, missing split: several types
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ValueError(f"cannot load dataset {source!r}: {first.strip()} -- pass a local file, or a hub name "
                         "this machine can reach (offline: HF_HUB_OFFLINE=1 and a filled cache)") from None


def _column(rows: list[dict], names: tuple[str, ...], source: str, what: str) -> str:
    columns = set(rows[0]) if rows else set()
    for name in names:
        if name in columns:
            return name
    raise ValueError(f"{source}: no {what} column (looked for {', '.join(names)}; found {', '.join(sorted(columns))})")


def load_problem_rows(source: str, split: str | None = None, conversational: bool = False,
                      instruction: str = BOXED_INSTRUCTION) -> list[dict]:
    r"""Rows ``{prompt, answer}`` from a hub data set or a local .jsonl/.json/.parquet/.csv file with a
    problem (or question/prompt) and an answer (or solution: the rewards compare its last ``\boxed{}``) column."""
    rows = _read_rows(source, split)
    if not rows:
        raise ValueError(f"{source}: no rows")
    problem, answer = _column(rows, PROBLEM_COLUMNS, source, "problem"), _column(rows, ANSWER_COLUMNS, source, "answer")
    out = []
    for row in rows:
        value = row[problem]
        if isinstance(value, list):  # already a conversation (TRL's conversational "prompt" column)
            if not conversational:
                raise ValueError(f"{source}: the {problem!r} column holds conversations; they need a tokenizer with a "
                                 "chat template (--chat auto or yes)")
            messages = [dict(m) for m in value]
            last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
            if last_user is None:
                raise ValueError(f"{source}: a conversation in the {problem!r} column has no user message")
            if instruction and instruction not in messages[last_user]["content"]:
                messages[last_user]["content"] = f"{messages[last_user]['content']}\n\n{instruction}"
            out.append({"prompt": messages, "answer": str(row[answer])})
            continue
        text = str(value).strip()
        if instruction and instruction not in text:
            text = f"{text}\n\n{instruction}"
        prompt = [{"role": "user", "content": text}] if conversational else text
        out.append({"prompt": prompt, "answer": str(row[answer])})
    return out


def split_rows(rows: list[dict], eval_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """A deterministic disjoint (train, held-out) split of a user data set."""
    if eval_size >= len(rows):
        raise ValueError(f"--eval-size {eval_size} leaves no training rows out of {len(rows)}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[:eval_size])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in order[:eval_size]]
