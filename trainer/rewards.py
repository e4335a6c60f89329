r"""Verifiable math rewards for TRL trainers (``GRPOTrainer`` and friends).

Every reward has TRL's signature ``fn(prompts, completions, **kwargs) -> list[float]``. A completion
is a string or a conversational list such as ``[{"role": "assistant", "content": "..."}]`` (the last
assistant message is scored). The ground truth comes from the dataset column ``answer`` or, when
there is no ``answer`` column, ``solution``; a gold text that contains ``\boxed{...}`` (a worked
solution) is reduced to its last boxed answer.

* :func:`accuracy_reward` -- 1.0 if the last ``\boxed{...}`` of the completion is mathematically
  equal to the gold answer according to ``math_verify`` (``parse`` + ``verify``), else 0.0.
* :func:`format_reward` -- 1.0 if the completion ends with its one and only ``\boxed{...}``.
* :func:`dcpo_accuracy_reward` -- DCPO's +1 / 0 / -1 reward (paper, Appendix A.4, Eq. 15).

Timeout design
--------------
math_verify bounds ``parse``/``verify`` with ``signal.alarm`` (whole seconds). That only works on the
main thread (elsewhere it raises ``ValueError``), it ends with ``signal.alarm(0)``, which cancels
any alarm the caller had set, and a signal cannot interrupt work stuck inside a C call. So this
module never calls math_verify in the calling process and never touches signals there:

* ``parse(..., parsing_timeout=None)`` and ``verify(..., timeout_seconds=None)`` disable
  math_verify's own alarms; the work runs in a small ``ProcessPoolExecutor`` (``spawn`` context,
  :data:`NUM_WORKERS` processes) created lazily on first use, warmed up, and reused across batches.
* Each batch gets one deadline, :data:`BATCH_TIMEOUT_S` seconds (or the ``timeout_s`` argument),
  counted from submission; pool start-up is not counted. Each distinct (gold, answer) pair of a
  batch is one task, so a hung answer does not hold up the others: the remaining workers keep
  draining the shared queue. Any task not finished at the deadline, or lost to a crashed worker,
  scores 0 (like a wrong answer) and the pool is recycled: its processes are terminated (which,
  unlike an alarm, also stops C-level work; one that ignores SIGTERM is killed 5 s later) and a
  fresh pool starts on the next call.
* Parsing dominates the cost (a few ms per parse, ``verify`` is ~10 us), so each worker keeps an
  LRU cache of parsed gold answers: a gold answer is parsed at most once per worker (at most
  :data:`NUM_WORKERS` times per batch, usually zero times after its first batch), and identical
  (gold, answer) pairs in a batch are scored once.
* Completions with no usable boxed answer, or one longer than :data:`MAX_ANSWER_CHARS`, score 0 in
  the calling process and never reach the pool; only extracted answers cross the process boundary.
* There is one code path: even a one-item batch goes through the pool. A warm round trip costs
  about a millisecond, small against one parse, and an in-process shortcut would bring back the
  signal problems above.
* The pool is guarded by a lock (concurrent callers are serialized) and is dropped in a forked
  child. As with any ``spawn`` pool, the training script must guard its entry point with
  ``if __name__ == "__main__":``, since the workers import the main module.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from functools import lru_cache
from typing import Any

__all__ = [
    "BATCH_TIMEOUT_S",
    "MAX_ANSWER_CHARS",
    "NUM_WORKERS",
    "accuracy_reward",
    "dcpo_accuracy_reward",
    "extract_boxed",
    "format_reward",
    "shutdown_pool",
]

BATCH_TIMEOUT_S: float = 30.0
"""Deadline in seconds for scoring one batch; unfinished answers score 0 (a ``timeout_s`` argument wins)."""
NUM_WORKERS: int = 2
"""Worker processes in the verification pool (read when the pool is created)."""
MAX_ANSWER_CHARS: int = 1000
"""Longer boxed answers score as wrong without being parsed (a 20k-char box can take 10 s to parse)."""
STARTUP_TIMEOUT_S: float = 180.0
"""Deadline for starting the pool (the workers import dgpo_ops, hence torch, and math_verify)."""
KILL_GRACE_S: float = 5.0
"""Seconds a stopped pool's workers have to exit after SIGTERM before they are sent SIGKILL."""

Completion = str | Sequence[dict[str, Any]]

# ----------------------------------------------------------------------------- answer extraction

_BOX_OPEN = re.compile(r"\\boxed\s*\{")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)  # an escape pair (\{, \}, \\, \frac...) or a brace
# What may follow the box for format_reward: whitespace, . , ; : ! ?, $ and markdown *, \] and \).
_FORMAT_TAIL = re.compile(r"(?:\s|[.,;:!?$*]|\\\]|\\\))*")


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` closing the group whose ``{`` is just before ``start``; escaped braces skip."""
    depth = 1
    for m in _BRACE_TOKEN.finditer(text, start):
        tok = m.group()
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    return None


def _last_box(text: str) -> tuple[str, int] | None:
    """(raw content, index after its ``}``) of the last top-level box; None if none or it is unclosed.

    Boxes nested inside a box belong to it. Linear time: the scan resumes after each closing brace
    and stops at the first unclosed box (everything after it would be inside it).
    """
    found = None
    pos = 0
    while (m := _BOX_OPEN.search(text, pos)) is not None:
        close = _closing_brace(text, m.end())
        if close is None:
            return None
        found = (text[m.end() : close], close + 1)
        pos = close + 1
    return found


def extract_boxed(text: str) -> str | None:
    r"""Stripped content of the last ``\boxed{...}`` in ``text`` (nested braces handled).

    None when there is no box, the last box is never closed (e.g. a truncated completion) or it is
    empty. ``\{`` and ``\}`` are literal braces and do not open or close groups.
    """
    box = _last_box(text)
    if box is None:
        return None
    return box[0].strip() or None


def _completion_text(completion: Completion) -> str:
    """The text of a completion: the string itself, or the last assistant message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if not isinstance(completion, Sequence):
        return ""
    messages = [m for m in completion if isinstance(m, dict)]
    if not messages:
        return ""
    content = ([m for m in messages if m.get("role") == "assistant"] or messages)[-1].get("content")
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text") or "" if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _gold_answers(kwargs: dict[str, Any], n: int) -> list[str | None]:
    column = kwargs.get("answer")
    if column is None:
        column = kwargs.get("solution")
    if column is None:
        raise ValueError("math rewards need the ground truth in an `answer` or `solution` dataset column")
    if len(column) != n:
        raise ValueError(f"got {n} completions but {len(column)} ground-truth answers")
    golds: list[str | None] = []
    for gold in column:
        text = "" if gold is None else str(gold)
        boxed = extract_boxed(text)
        text = (boxed if boxed is not None else text).strip()
        if len(text) > 1 and text[0] == "$" and text[-1] == "$":
            text = text.strip("$").strip()
        golds.append(text or None)
    return golds


# ----------------------------------------------------------------------------- worker side


def _parse_answer(answer: str) -> list[Any]:
    from math_verify import LatexExtractionConfig, parse

    config = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    return parse("\\boxed{" + answer + "}", extraction_config=config, parsing_timeout=None)


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list[Any]:
    from math_verify import parse

    # A plain-text gold that is not LaTeX falls back to math_verify's default extraction.
    return _parse_answer(gold) or parse(gold, parsing_timeout=None)


def _verify_one(gold: str, answer: str) -> bool:
    """Runs in a worker: True iff ``answer`` equals ``gold``. Errors count as wrong."""
    from math_verify import verify

    try:
        parsed_gold = _parse_gold(gold)
        return bool(parsed_gold) and bool(verify(parsed_gold, _parse_answer(answer), timeout_seconds=None))
    except Exception:
        return False


def _init_worker() -> None:
    from math_verify import grader, parser

    # The timeout is enforced by the parent, so math_verify's "timeout is disabled" warning is noise.
    for module in (parser, grader):
        if hasattr(module, "TIMEOUT_WARNING_SHOWN"):
            module.TIMEOUT_WARNING_SHOWN = True
    _verify_one("1", "1")  # warm up sympy and the LaTeX grammar


# ----------------------------------------------------------------------------- pool (parent side)

_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None


def _reset_after_fork() -> None:
    global _lock, _pool
    _lock, _pool = threading.Lock(), None  # the parent's workers are not ours to use or stop


os.register_at_fork(after_in_child=_reset_after_fork)


def _kill(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now, including workers stuck in a computation (``shutdown`` alone would wait)."""
    # ``_processes`` and ``_executor_manager_thread`` are private (there since 3.2 and 3.9); Python
    # 3.14 adds ``terminate_workers()``.
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    for p in processes:
        p.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    if manager is None:  # nothing was ever submitted, so no worker was started
        return
    # The pool's manager thread reaps the terminated workers itself. Joining them here as well would
    # race it for each pid: the loser's waitpid fails with ECHILD, and multiprocessing then reports
    # the dead worker as alive (and a kill() could hit a recycled pid). So wait for the manager, and
    # SIGKILL only what is still running after the grace period.
    manager.join(KILL_GRACE_S)
    if manager.is_alive():
        for p in processes:
            p.kill()
        manager.join()


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    if _pool is None:
        if importlib.util.find_spec("math_verify") is None:
            raise ImportError("the math rewards need math-verify: pip install 'dgpo-ops[trl]'")
        pool = ProcessPoolExecutor(
            max_workers=NUM_WORKERS, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker
        )
        try:  # wait until every worker is up, so the first batch's deadline does not pay for start-up
            deadline, pids = time.monotonic() + STARTUP_TIMEOUT_S, set()
            while len(pids) < NUM_WORKERS:
                pings = [pool.submit(os.getpid) for _ in range(NUM_WORKERS)]
                pids.update(f.result(timeout=max(0.0, deadline - time.monotonic())) for f in pings)
                time.sleep(0.01)
        except BaseException as e:
            _kill(pool)
            if isinstance(e, BrokenProcessPool):
                raise RuntimeError(
                    "the math-verify worker pool failed to start (see the worker's traceback above); with "
                    "the spawn start method the main script needs an `if __name__ == '__main__':` guard"
                ) from e
            raise
        _pool = pool
    return _pool


def _discard_pool() -> None:
    global _pool
    if _pool is not None:
        pool, _pool = _pool, None
        _kill(pool)


def shutdown_pool() -> None:
    """Stop the worker pool now (it restarts on the next call). Optional: workers exit with Python."""
    with _lock:
        _discard_pool()


def _verify_batch(golds: list[str | None], answers: list[str | None], timeout_s: float | None) -> list[bool]:
    """Verify each (gold, answer) pair in the pool; missing values, timeouts and crashes give False."""
    pairs = list(zip(golds, answers, strict=True))
    jobs = [(g, a) for g, a in dict.fromkeys(pairs) if g is not None and a is not None]
    jobs = [(g, a) for g, a in jobs if len(a) <= MAX_ANSWER_CHARS]
    results: dict[tuple[str, str], bool] = {}
    if jobs:
        with _lock:
            for attempt in range(2):  # a worker that died between batches breaks the pool: renew once
                pool = _get_pool()
                try:
                    futures = {pool.submit(_verify_one, g, a): (g, a) for g, a in jobs}
                    break
                except (BrokenProcessPool, RuntimeError):
                    _discard_pool()
                    if attempt:
                        raise
            try:
                done, not_done = wait(futures, timeout=BATCH_TIMEOUT_S if timeout_s is None else timeout_s)
            except BaseException:  # e.g. KeyboardInterrupt: do not leave busy workers behind
                _discard_pool()
                raise
            failed = bool(not_done)
            for f in done:
                try:
                    results[futures[f]] = f.result()
                except Exception:  # BrokenProcessPool: a worker crashed
                    failed = True
            if failed:
                _discard_pool()
    return [results.get(pair, False) for pair in pairs]


# ----------------------------------------------------------------------------- rewards


def _score(
    completions: Sequence[Completion], kwargs: dict[str, Any], timeout_s: float | None
) -> tuple[list[bool], list[str | None]]:
    answers = [extract_boxed(_completion_text(c)) for c in completions]
    return _verify_batch(_gold_answers(kwargs, len(answers)), answers, timeout_s), answers


def accuracy_reward(
    prompts: Sequence[Any] | None,
    completions: Sequence[Completion],
    *,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> list[float]:
    r"""1.0 if the last ``\boxed{...}`` of a completion equals the ground truth, else 0.0.

    Equality is math_verify's (``\frac{1}{2}`` equals ``0.5``, ``2`` equals ``2.0``). No box, an
    unclosed or empty last box, an answer longer than :data:`MAX_ANSWER_CHARS`, an unparsable
    answer, a missing gold value, a timeout or a crashed worker all score 0.0. ``timeout_s``
    overrides :data:`BATCH_TIMEOUT_S` for this batch. Ground truth: ``kwargs["answer"]``, else
    ``kwargs["solution"]`` (ValueError if neither).
    """
    correct, _ = _score(completions, kwargs, timeout_s)
    return [1.0 if ok else 0.0 for ok in correct]


def format_reward(
    prompts: Sequence[Any] | None, completions: Sequence[Completion], **kwargs: Any
) -> list[float]:
    r"""1.0 if the completion ends with its only box, else 0.0. Exact rule, all must hold:

    1. ``\boxed`` occurs exactly once in the text (so nested boxes fail);
    2. it opens a group (``\boxed{``, whitespace allowed before ``{``) that is closed, with balanced
       braces inside (``\{`` and ``\}`` are literal and not counted);
    3. the content is non-empty after stripping whitespace;
    4. after the closing ``}`` there is nothing but whitespace, the punctuation ``. , ; : ! ?``,
       ``$``, ``*`` (markdown bold) and the math delimiters ``\]`` and ``\)``.

    The answer's correctness is not checked.
    """
    scores = []
    for completion in completions:
        text = _completion_text(completion)
        box = _last_box(text) if text.count("\\boxed") == 1 else None
        ok = box is not None and box[0].strip() != "" and _FORMAT_TAIL.fullmatch(text, box[1]) is not None
        scores.append(1.0 if ok else 0.0)
    return scores


def dcpo_accuracy_reward(
    prompts: Sequence[Any] | None,
    completions: Sequence[Completion],
    *,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> list[float]:
    r"""DCPO's rule-based reward: +1 correct, 0 well-formed but wrong, -1 badly formatted.

    DCPO (Yang et al., "DCPO: Dynamic Clipping Policy Optimization", Baichuan), Appendix A.4,
    Eq. (15): "a reward of +1 is assigned when both the format and the answer are correct; a reward
    of 0 is given when the format is correct but the answer is incorrect; and a reward of -1 is
    assigned when the format is incorrect". (Not +1/-1/0: a wrong answer scores 0, bad format -1.)

    The paper's template (Appendix A.8) asks to "put your final answer within \boxed{}" and defines
    no stricter check, so the format is correct when the completion has a usable final answer: its
    last ``\boxed{...}`` is closed and non-empty (see :func:`extract_boxed`; :func:`format_reward`
    is the stricter rule). A well-formed answer that cannot be verified (timeout, crashed worker,
    unparsable, too long, missing gold value) counts as incorrect: 0.
    """
    correct, answers = _score(completions, kwargs, timeout_s)
    return [1.0 if ok else -1.0 if a is None else 0.0 for ok, a in zip(correct, answers, strict=True)]
