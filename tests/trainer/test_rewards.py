r"""Math rewards: real math-verify parsing in the worker pool, no mocks.

In file order the pool starts twice (first use; fresh from a thread after the forced timeout has
recycled it): each start costs seconds, as the workers import dgpo_ops (hence torch) and math_verify.
"""

from __future__ import annotations

import importlib.util
import signal
import threading
import time

import pytest
from dgpo_ops.trainer import rewards
from dgpo_ops.trainer.rewards import (
    accuracy_reward,
    dcpo_accuracy_reward,
    extract_boxed,
    format_reward,
    shutdown_pool,
)

# The tests run in file order on one xdist worker: the pool starts twice in that order (above).
pytestmark = [pytest.mark.xdist_group("rewards_pool"), pytest.mark.early]

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="math-verify is not installed (dgpo-ops[trl])"
)

# Parsing this takes ~0.2 s, but verify() against 1 ran for over 20 s when measured (no result).
PATHOLOGICAL = r"\boxed{9^{9^{9^{9}}}}"


def msg(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


# ----------------------------------------------------------------------------- extraction (no pool)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{5}.", "5"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{\frac{1}{2}}}{2}}", r"\frac{\sqrt{\frac{1}{2}}}{2}"),
        (r"first \boxed{1}, then \boxed{ 2 }", "2"),
        (r"\boxed{\boxed{3}}", r"\boxed{3}"),  # a box nested in a box belongs to it
        (r"\boxed {4}", "4"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are literal
        (r"\boxed{\left\{ x \right\}}", r"\left\{ x \right\}"),
        (r"\boxed{1} then \boxed{2", None),  # the last box is unclosed (truncated completion)
        (r"\boxed{a\}", None),
        (r"\boxed{}", None),
        (r"\boxed{   }", None),
        ("no box at all", None),
        ("", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "a" * 200_000 + r"\boxed{42}",
        r"\boxed{" * 40_000,
        r"\boxed{}" * 25_000 + r"\boxed{42}",
        "{" * 100_000 + r"\boxed{" + "{" * 50_000 + "42" + "}" * 50_000 + "}",
        "}" * 200_000 + r"\boxed{42}" + "\\" * 1000,
    ],
)
def test_extract_boxed_is_linear_on_200k_chars(text):
    start = time.perf_counter()
    answer = extract_boxed(text)
    assert time.perf_counter() - start < 0.5
    assert answer is None or answer.strip("{}") == "42"


# ----------------------------------------------------------------------------- format reward


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (r"The answer is \boxed{5}", 1.0),
        (r"The answer is $\boxed{5}$.", 1.0),
        ("The answer is \\[\\boxed{5}\\]\n\n", 1.0),
        (r"**Answer:** **\boxed{5}**!", 1.0),
        (r"so \(\boxed{5}\);", 1.0),
        (r"\boxed{\frac{1}{2}}", 1.0),
        (r"\boxed {5}", 1.0),
        (msg(r"thus \boxed{x = 3}."), 1.0),
        (r"\boxed{5} because 2 + 3 = 5", 0.0),  # not the last thing
        (r"\boxed{5} \text{cm}", 0.0),
        (r"\boxed{5}}", 0.0),  # a stray brace is not punctuation
        (r"\boxed{4} or maybe \boxed{5}", 0.0),  # two boxes
        (r"\boxed{\boxed{5}}", 0.0),  # nested: \boxed occurs twice
        (r"\boxed{}", 0.0),
        (r"\boxed{  }.", 0.0),
        (r"\boxed{5", 0.0),
        (r"\boxed 5", 0.0),
        ("5", 0.0),
        ("", 0.0),
        (msg(""), 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(None, [completion]) == [expected]


def test_format_reward_is_batched_and_ignores_the_answer():
    completions = [r"\boxed{1}", "none", msg(r"\boxed{2}.")]
    assert format_reward(["p"] * 3, completions, answer=["7", "7", "7"]) == [1.0, 0.0, 1.0]


# ----------------------------------------------------------------------------- accuracy reward


@needs_math_verify
@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        (r"so \boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),  # nested braces
        (r"\boxed{\frac12}", "$0.5$", 1.0),
        (r"\boxed{2.0}", r"\boxed{2}", 1.0),  # a boxed gold is reduced to its box
        (r"\boxed{2}", "2.0", 1.0),
        (r"\boxed{x = 3}", "3", 1.0),
        (r"\boxed{\{2, 1\}}", r"\{1,2\}", 1.0),
        (r"\boxed{\sqrt{18}}", r"3\sqrt{2}", 1.0),
        (r"\boxed{\text{(A)}}", "A", 1.0),
        (r"\boxed{3}", "2", 0.0),  # wrong
        (r"\boxed{0.6}", r"\frac{1}{2}", 0.0),
        (r"\boxed{-2}", "2", 0.0),
        (r"first \boxed{2} then \boxed{3}", "2", 0.0),  # the last box is the answer
        (r"first \boxed{3} then \boxed{2}", "2", 1.0),
        ("the answer is 2", "2", 0.0),  # no box
        (r"\boxed{}", "2", 0.0),
        (r"\boxed{2", "2", 0.0),  # unclosed
        (r"\boxed{)(*&^%$#@!}", "2", 0.0),  # garbage
        (r"\boxed{\frac{1}{}", r"\frac{1}{2}", 0.0),
        ("\x00\ud7ff\uffff" + r"\boxed{\x\y\z{{}}}", "2", 0.0),
        ("\\boxed{\ud800}", "2", 0.0),  # a lone surrogate
        ("a" * 200_000 + r"\boxed{42}", "42", 1.0),  # very long completion
        (r"\boxed{" * 50_000 + "42", "42", 0.0),
        (r"\boxed{" + "x" * 20_000 + "}", "2", 0.0),  # too long to parse: skipped, not 10 s of sympy
    ],
)
def test_accuracy_reward(completion, gold, expected):
    assert accuracy_reward(["prompt"], [completion], answer=[gold]) == [expected]


@needs_math_verify
def test_accuracy_reward_batch_conversational_and_columns():
    completions = [
        msg(r"so \boxed{\frac{1}{2}}"),
        msg(r"so \boxed{3}"),
        [{"role": "assistant", "content": [{"type": "text", "text": r"\boxed{5}"}]}],
        [
            {"role": "assistant", "content": r"let me check \boxed{1}"},
            {"role": "tool", "content": r"\boxed{7}"},
            {"role": "assistant", "content": r"final: \boxed{7}"},
        ],
        msg("no answer"),
        r"plain string \boxed{2}",
    ]
    answers = ["0.5", "2", "5", "7", "1", 2]  # non-string golds (ints) are fine
    assert accuracy_reward([""] * 6, completions, answer=answers) == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    # A `solution` column works the same; a worked solution is reduced to its last box.
    solutions = [r"Hence $x = \boxed{\dfrac{1}{2}}$.", "2", "5", "7", "1", "2"]
    assert accuracy_reward([""] * 6, completions, solution=solutions) == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    # `answer` wins over `solution`; TRL's extra kwargs are ignored.
    rewards_ = accuracy_reward(
        ["p"], [r"\boxed{2}"], answer=["2"], solution=["3"], completion_ids=[[1]], trainer_state=None
    )
    assert rewards_ == [1.0]
    assert accuracy_reward(["p"], [r"\boxed{2}"], answer=[None]) == [0.0]
    # GRPO groups repeat answers: duplicates are verified once and all scored.
    group = [r"\boxed{4}"] * 8 + [r"\boxed{5}"] * 8
    assert accuracy_reward([""] * 16, group, answer=["4"] * 16) == [1.0] * 8 + [0.0] * 8


def test_accuracy_reward_needs_a_ground_truth_column():
    with pytest.raises(ValueError, match="answer"):
        accuracy_reward(["p"], [r"\boxed{2}"])
    with pytest.raises(ValueError, match="2 completions"):
        accuracy_reward(["p", "q"], [r"\boxed{2}", r"\boxed{3}"], answer=["2"])


# ----------------------------------------------------------------------------- DCPO reward


@needs_math_verify
def test_dcpo_reward_follows_the_paper():
    # DCPO Appendix A.4, Eq. (15): +1 correct, 0 right format but wrong answer, -1 wrong format.
    completions = [
        r"\boxed{\frac{1}{2}}",
        r"\boxed{3}",
        r"\boxed{)(*&^%$#@!}",  # well-formed box, unparsable answer: wrong, not badly formatted
        "the answer is 0.5",
        r"\boxed{}",
        r"\boxed{0.5",
        msg(r"so \boxed{0.5} because"),  # format_reward would say 0, but the answer is usable
    ]
    expected = [1.0, 0.0, 0.0, -1.0, -1.0, -1.0, 1.0]
    assert dcpo_accuracy_reward([""] * 7, completions, solution=["0.5"] * 7) == expected


# ----------------------------------------------------------------------------- threads and signals


@needs_math_verify
def test_math_verify_itself_breaks_threads_and_alarms():
    """Why the pool exists: math_verify's own timeout fails off the main thread and cancels alarms."""
    from math_verify import parse

    errors: list[BaseException] = []

    def run() -> None:
        try:
            parse("$1$")
        except ValueError as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        parse("$1$")
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if not errors and remaining > 0:
        pytest.skip("this math_verify no longer uses signal.alarm for its timeouts")
    assert errors and "thread" in str(errors[0])
    assert remaining == 0.0  # math_verify cancelled the caller's alarm


@needs_math_verify
def test_rewards_leave_the_callers_alarm_and_handler_in_place():
    fired: list[int] = []

    def handler(signum, frame):
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        scores = accuracy_reward(["p"] * 2, [r"\boxed{0.5}", r"\boxed{3}"], answer=[r"\frac12", "2"])
        assert scores == [1.0, 0.0]
        assert dcpo_accuracy_reward(["p"], ["no box"], answer=["2"]) == [-1.0]
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 90.0 < remaining <= 100.0
        assert signal.getsignal(signal.SIGALRM) is handler
        assert signal.alarm(0) > 0  # the plain-alarm view of the same timer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired


@needs_math_verify
def test_timeout_argument_overrides_the_module_setting(monkeypatch):
    monkeypatch.setattr(rewards, "BATCH_TIMEOUT_S", 0.0)
    assert accuracy_reward(["p"], [r"\boxed{0.5}"], answer=["1/2"], timeout_s=120.0) == [1.0]


@needs_math_verify
def test_timeout_scores_zero_and_recycles_the_pool(monkeypatch):
    monkeypatch.setattr(rewards, "BATCH_TIMEOUT_S", 1.0)
    completions = [r"\boxed{0.5}", PATHOLOGICAL, r"\boxed{2}", r"\boxed{3}", "no box"]
    accuracy_reward(["p"], [r"\boxed{1}"], answer=["1"])  # start the pool outside the timed call
    workers = list(rewards._pool._processes.values())
    start = time.perf_counter()
    scores = dcpo_accuracy_reward([""] * 5, completions, answer=[r"\frac{1}{2}", "1", "2", "2", "2"])
    elapsed = time.perf_counter() - start
    # The hung answer is well-formed but unverified: 0 (not -1). The other worker drains the rest
    # of the batch, so answers queued after the hung one are still scored.
    assert scores == [1.0, 0.0, 1.0, 0.0, -1.0]
    assert 1.0 <= elapsed < 8.0
    # Recycled: every worker, the stuck one included, is gone; the next call starts a fresh pool
    # (the thread test below does exactly that, so this test does not pay for a second start).
    assert rewards._pool is None
    assert not any(p.is_alive() for p in workers)


@needs_math_verify
def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_period(monkeypatch, tmp_path):
    monkeypatch.setattr(rewards, "NUM_WORKERS", 1)
    monkeypatch.setattr(rewards, "KILL_GRACE_S", 1.0)  # 5 s by default: the test waits it out
    shutdown_pool()
    pool = rewards._get_pool()
    (worker,) = pool._processes.values()
    started = tmp_path / "started"
    stubborn = (
        "import signal, time, pathlib\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        "time.sleep(120)\n"
    )
    future = pool.submit(exec, stubborn)
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started.exists()
    start = time.perf_counter()
    shutdown_pool()
    elapsed = time.perf_counter() - start
    assert 1.0 <= elapsed < 30.0  # the SIGTERM grace period, then SIGKILL
    assert worker.exitcode == -signal.SIGKILL
    assert future.done()
    assert rewards._pool is None


@needs_math_verify
def test_works_from_a_thread_including_pool_start(monkeypatch):
    monkeypatch.setattr(rewards, "NUM_WORKERS", 1)  # a one-worker pool starts faster
    completions = [msg(r"\boxed{\frac{1}{2}}"), r"\boxed{2.0}", r"\boxed{7}", "none"]
    answers = ["0.5", r"\boxed{2}", "8", "1"]
    expected = [1.0, 1.0, 0.0, 0.0]
    assert accuracy_reward([""] * 4, completions, answer=answers) == expected
    shutdown_pool()  # the thread starts its own pool
    results: dict[str, object] = {}

    def run() -> None:
        try:
            results["acc"] = accuracy_reward([""] * 4, completions, answer=answers)
            results["dcpo"] = dcpo_accuracy_reward([""] * 4, completions, answer=answers)
        except BaseException as e:  # pragma: no cover - reported below
            results["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    shutdown_pool()  # do not leave the one-worker pool to other tests
    assert not thread.is_alive()
    assert "error" not in results, results.get("error")
    assert results["acc"] == expected
    assert results["dcpo"] == [1.0, 1.0, 0.0, -1.0]
