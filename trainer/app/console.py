"""What ``dgpo-ops train`` prints: log lines (main process only), tqdm progress bars, before the first step
what its terms mean and how steps share a generation, one line per RL step with the held-out accuracy every
``--eval-every`` steps, and the closing summary with where the trained policies are."""

from __future__ import annotations

import math
import pathlib
import time


class Console:
    """Prints on the main process only; progress bars via tqdm (on stderr) unless disabled."""

    def __init__(self, enabled: bool, progress: bool):
        self.enabled, self.progress_enabled = enabled, progress and enabled
        self.said: set[str] = set()

    def once(self, message: str) -> None:
        """``log``, unless this message was logged before: an explanation is given once per invocation."""
        if message not in self.said:
            self.said.add(message)
            self.log(message)

    def log(self, message: str) -> None:
        if not self.enabled:
            return
        if self.progress_enabled:
            from tqdm.auto import tqdm

            tqdm.write(message)
        else:
            print(message, flush=True)

    def bar(self, total: int, desc: str):
        if not self.progress_enabled:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def fmt(value, spec=".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def step_line(step: int, total: int, logs: dict, last_reward: dict) -> str:
    acc = logs.get("rewards/accuracy_reward/mean", last_reward.get("acc"))
    format_score = logs.get("rewards/format_reward/mean", last_reward.get("fmt"))
    reward = logs.get("reward", last_reward.get("reward"))
    regions = "/".join(fmt(logs.get(k), ".3f") for k in ("clip_ratio/low_mean", "clip_ratio/high_mean",
                                                         "clip_ratio/lp_mean", "clip_ratio/hn_mean"))
    return (f"step {step:>4}/{total} | reward {fmt(reward)} (acc {fmt(acc)}, fmt {fmt(format_score)}) | "
            f"entropy {fmt(logs.get('entropy'))} | regions ln/hp/lp/hn {regions} | EUR {fmt(logs.get('eur'))} | "
            f"ratio {fmt(logs.get('ratio_mean'))} | len {fmt(logs.get('completions/mean_length'), '.1f')} | "
            f"loss {fmt(logs.get('loss'), '.4f')}")


# What the step line's terms mean, said once before the first step line (docs/math.md: "Regions", "Metrics").
TERMS = ("terms: regions ln/hp/lp/hn = fractions of tokens whose importance ratio r = p/p_old left the method's "
         "trust region [1-eps_low, 1+eps_high]: ln r below with A<0, hp r above with A>0 (the two grpo clips), "
         "lp r below with A>0, hn r above with A<0; EUR = effective update ratio mean(psi/r), the share of the "
         "plain policy gradient the loss keeps (1: all of it); ratio = mean r (docs/math.md)")


def updates_per_generation(config) -> float:
    """Optimizer steps one generation serves, as TRL's GRPOTrainer schedules it: it generates every
    ``steps_per_generation * num_iterations`` micro-batches, ``gradient_accumulation_steps`` to a step."""
    return config.steps_per_generation * config.num_iterations / config.gradient_accumulation_steps


def generation_text(config) -> str:
    """Why consecutive step lines share a reward: how many optimizer steps each generation serves."""
    updates = updates_per_generation(config)
    sampled = (f"one generation ({config.generation_batch_size // config.num_generations} prompts x "
               f"{config.num_generations} completions)")
    fields = (f"num_iterations {config.num_iterations} x steps_per_generation {config.steps_per_generation} / "
              f"gradient_accumulation_steps {config.gradient_accumulation_steps}")
    if updates == 1:
        return f"steps: each optimizer step samples {sampled} anew ({fields})"
    if updates != int(updates) or updates < 1:
        return f"steps: {sampled} serves {updates:g} optimizer steps ({fields})"
    group = "pairs" if updates == 2 else f"groups of {int(updates)}"
    return (f"steps: {sampled} serves {int(updates)} optimizer steps ({fields}), so the step lines come in "
            f"{group} with that generation's reward, its length on the first (len - after it); the first step of "
            "each is on-policy (ratio 1, regions 0), the later ones see the policy move")


def curve_point(step: int, result: dict) -> dict:
    """One point of the held-out curve: greedy accuracy, format, length, and pass@k where it was measured."""
    return {"step": step, **{key: result[key] for key in ("accuracy", "format", "length")},
            **{key: value for key, value in result.items() if key.startswith("pass@")}}


def pass_text(result: dict) -> str:
    """``, pass@1 0.41, pass@8 0.78 (8 samples, t=1)`` when pass@k was measured, else nothing."""
    rates = [f"{key} {value:.3f}" for key, value in result.items() if key.startswith("pass@")]
    return f", {', '.join(rates)} ({result['pass_k']} samples, t=1)" if rates else ""


def make_callback(console: Console, eval_fn, eval_every: int, total_steps: int, record: dict):
    from transformers import TrainerCallback

    class TrainCallback(TrainerCallback):
        """One compact line per logged step, a progress bar, and held-out accuracy every ``eval_every`` steps."""

        def __init__(self):
            self.bar, self.last, self.started, self.pending = None, {}, time.perf_counter(), None

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = console.bar(total_steps, "RL")
            self.started = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            if "loss" not in logs:
                return
            if "reward" in logs:
                self.last = {"reward": logs.get("reward"), "acc": logs.get("rewards/accuracy_reward/mean"),
                             "fmt": logs.get("rewards/format_reward/mean")}
            logs["step"], logs["time"] = state.global_step, time.perf_counter() - self.started
            record["log_history"].append(logs)
            console.log(step_line(state.global_step, total_steps, logs, self.last))
            if self.pending is not None:
                self._evaluate(self.pending)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(1)
            step = state.global_step
            if eval_fn is not None and eval_every and step % eval_every == 0 and step < total_steps:
                self.pending = step
                if not (args.logging_steps and step % args.logging_steps == 0):
                    self._evaluate(step)  # no log line this step: evaluate now

        def _evaluate(self, step):
            self.pending = None
            result = eval_fn()
            record["eval_curve"].append(curve_point(step, result))
            console.log(f"step {step:>4}/{total_steps} | held-out accuracy {result['accuracy']:.3f} "
                        f"(format {result['format']:.3f}, length {result['length']:.1f}, greedy, n={result['n']})"
                        + pass_text(result))

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return TrainCallback()


def summary_text(result: dict) -> str:
    n = (result["runs"][0]["before"] or {}).get("n", "?") if result["runs"] else "?"
    lines = ["", f"held-out accuracy (greedy, n={n}), before -> after RL:"]
    for method, summary in result["summary"].items():
        per_seed = ", ".join(f"seed {s['seed']}: {fmt(s['before'])} -> {fmt(s['after'])}" for s in summary["seeds"])
        lines.append(f"  {method:>8}: {fmt(summary['before_mean'])} -> {fmt(summary['after_mean'])} "
                     f"(mean over {len(summary['seeds'])} seed(s); {per_seed})")
    lines.append(f"wall time {result['wall_time_s']:.0f} s")
    files = [result["output_dir"] + "/run.json"] + ([result["figure"]] if result.get("figure") else [])
    lines.append(f"outputs written to {result['output_dir']}/ ({', '.join(pathlib.Path(f).name for f in files)})")
    lines.append(saved_models_text(result["runs"], result["output_dir"]))
    return "\n".join(lines)


def saved_models_text(runs: list[dict], output_dir: str) -> str:
    """Where the trained policies are (``AutoModelForCausalLM.from_pretrained`` loads each), or that they
    were not saved and the option that saves them."""
    saved = [run["saved_model"] for run in runs if run.get("saved_model")]
    if not saved:
        return "trained policy not saved (--no-save-model; without it: <output>/seed-<seed>/<method>/)"
    if len(saved) == 1:
        return f"trained policy saved to {saved[0]}/ (AutoModelForCausalLM.from_pretrained loads it)"
    return (f"trained policies saved to {output_dir}/seed-<seed>/<method>/, {len(saved)} of them "
            "(AutoModelForCausalLM.from_pretrained loads each)")


def quiet_libraries() -> None:
    """No weight-loading progress bars or v6 deprecation notices between the log lines."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*deprecated and will be removed in v6.*", category=FutureWarning)
