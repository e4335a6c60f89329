"""``python -m dgpo_ops.trainer.app.report`` over several run JSONs: runs of one command on disjoint seeds (run in
several sittings or on several machines) merge into one result, and anything else is refused; the figure's
panels: log scales only where they help, with readable ticks, and no panel without data."""

from __future__ import annotations

import json
import re

import pytest
from dgpo_ops.trainer.app.report import final_numbers, final_table, main, merge_results

METHODS = ["dgpo", "grpo"]


def fake_result(seeds, **arguments):
    """A run.json of ``dgpo-ops train --compare dgpo,grpo`` on ``seeds``: accuracy after RL = 0.5 + seed/10
    (+0.05 for dgpo), pass@2 0.1 above it, entropy 0.3 - seed/100."""
    runs = []
    for seed in seeds:
        for method in METHODS:
            after = 0.5 + seed / 10 + (0.05 if method == "dgpo" else 0.0)
            runs.append({
                "method": method, "seed": seed,
                "before": {"accuracy": 0.2, "n": 8}, "after": {"accuracy": after, "n": 8, "pass@1": after - 0.1,
                                                               "pass@2": after + 0.1},
                "eval_curve": [{"step": 0, "accuracy": 0.2, "pass@1": 0.1, "pass@2": 0.3},
                               {"step": 4, "accuracy": after, "pass@1": after - 0.1, "pass@2": after + 0.1}],
                "log_history": [{"step": s, "entropy": 0.3 - seed / 100} for s in range(1, 5)],
                "rl_time_s": 1.0, "sft_time_s": 0.5, "run_time_s": 2.0,
            })
    from dgpo_ops.trainer.app.report import summarize

    args = {"seed": seeds[0], "seeds": len(seeds), "output_dir": f"/tmp/out-{seeds[0]}", "no_progress": True,
            "max_steps": 4, "compare": ",".join(METHODS), **arguments}
    return {"command": f"dgpo-ops train --seed {seeds[0]} --seeds {len(seeds)}", "arguments": args,
            "methods": METHODS, "seeds": list(seeds), "task": "addition", "model": "tiny", "complete": True,
            "output_dir": f"/tmp/out-{seeds[0]}",
            "wall_time_s": 10.0 * len(seeds), "environment": {"git_commit": "abc"}, "summary": summarize(runs),
            "warm_start": [{"seed": s, "steps": 2} for s in seeds], "runs": runs}


def test_merge_of_disjoint_seeds_equals_the_run_on_all_of_them():
    whole = fake_result([0, 1, 2])
    merged = merge_results([fake_result([2]), fake_result([0, 1])])  # any order of the parts
    assert merged["seeds"] == [0, 1, 2]
    assert [(r["seed"], r["method"]) for r in merged["runs"]] == [(r["seed"], r["method"]) for r in whole["runs"]]
    assert [w["seed"] for w in merged["warm_start"]] == [0, 1, 2]
    assert merged["summary"] == whole["summary"]
    assert final_table(merged) == final_table(whole)
    assert merged["arguments"]["seed"] == 0 and merged["arguments"]["seeds"] == 3
    assert merged["wall_time_s"] == pytest.approx(30.0)
    assert [m["seeds"] for m in merged["merged_from"]] == [[2], [0, 1]]
    dgpo = next(row for row in final_numbers(merged) if row["method"] == "dgpo")
    assert dgpo["seeds"] == 3
    assert dgpo["after"] == pytest.approx((0.65, 0.55, 0.75))
    assert dgpo["pass@2"] == pytest.approx((0.75, 0.65, 0.85))


def test_merge_refuses_different_commands_and_shared_seeds():
    with pytest.raises(ValueError, match="max_steps"):
        merge_results([fake_result([0]), fake_result([1], max_steps=8)])
    with pytest.raises(ValueError, match=r"seeds \[1\]"):
        merge_results([fake_result([0, 1]), fake_result([1, 2])])
    other_task = fake_result([1])
    other_task["task"] = "addition, 1-3 digits"
    with pytest.raises(ValueError, match="task"):
        merge_results([fake_result([0]), other_task])
    with pytest.raises(ValueError, match="one range"):
        merge_results([fake_result([0]), fake_result([5])])  # not what --seed 0 --seeds 2 would run
    incomplete = fake_result([1])
    incomplete["complete"] = False
    assert merge_results([fake_result([0]), incomplete])["complete"] is False


def test_merge_keeps_each_parts_provenance_and_only_what_they_share():
    later = fake_result([1])
    later["environment"] = {"git_commit": "def"}
    merged = merge_results([fake_result([0]), later])
    assert merged["environment"] is None and merged["command"] is None and merged["output_dir"] is None
    assert [m["environment"]["git_commit"] for m in merged["merged_from"]] == ["abc", "def"]
    assert [m["output_dir"] for m in merged["merged_from"]] == ["/tmp/out-0", "/tmp/out-1"]
    assert [m["command"] for m in merged["merged_from"]] == ["dgpo-ops train --seed 0 --seeds 1",
                                                             "dgpo-ops train --seed 1 --seeds 1"]
    assert merge_results([fake_result([0]), fake_result([1])])["environment"] == {"git_commit": "abc"}


def test_table_of_a_part_where_one_method_has_no_pass_at_k():
    """A run where one method's evaluations lack pass@k (e.g. cut short) still tabulates: '-' there."""
    result = fake_result([0])
    for run in result["runs"]:
        if run["method"] == "grpo":
            run["after"] = {"accuracy": run["after"]["accuracy"], "n": 8}
            run["eval_curve"] = [{k: v for k, v in e.items() if not k.startswith("pass@")} for e in run["eval_curve"]]
    rows = {cells[0]: cells for line in final_table(result).splitlines()[2:]
            if (cells := [c.strip() for c in line.strip("|").split("|")])}
    assert rows["grpo"][2:4] == ["-", "-"]
    assert rows["dgpo"][2:4] == ["0.450", "0.650"]


def test_report_command_writes_the_merge_and_redraws_it(tmp_path, capsys):
    parts = []
    for seeds in ([0], [1, 2]):
        path = tmp_path / f"seeds{seeds[0]}.json"
        path.write_text(json.dumps(fake_result(seeds)))
        parts.append(str(path))
    merged_path = tmp_path / "all.json"
    assert main([*parts, "--merged", str(merged_path)]) == 0
    first = capsys.readouterr().out
    assert (tmp_path / "all.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(merged_path.read_text())["seeds"] == [0, 1, 2]
    assert main([str(merged_path), "--out", str(tmp_path / "again.png")]) == 0  # the merge reproduces itself
    assert capsys.readouterr().out.split("figure:")[0] == first.split("figure:")[0]
    with pytest.raises(SystemExit):
        main([parts[0], parts[0], "--merged", str(tmp_path / "x.json")])  # the same seeds twice: a usage error
    with pytest.raises(SystemExit):
        main(parts)  # several parts and nowhere named for the merge: the figure would land beside a part


def test_horizon_tables_average_over_seeds_with_their_range():
    """docs/train/horizon_tables.py: evaluation curves at chosen steps and windowed training metrics, as the mean
    over seeds with the min-max."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[3] / "docs" / "train" / "horizon_tables.py"
    spec = importlib.util.spec_from_file_location("horizon_tables", path)
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    result = fake_result([0, 1, 2])
    accuracy = tables.eval_table(result, "accuracy", [0, 4]).splitlines()
    assert accuracy[0] == "| accuracy at step | dgpo | grpo |"
    assert accuracy[3] == "| 4 | 0.650 [0.550, 0.750] | 0.600 [0.500, 0.700] |"
    passes = tables.eval_table(result, "pass@2", [4]).splitlines()
    assert passes[2] == "| 4 | 0.750 [0.650, 0.850] | 0.700 [0.600, 0.800] |"
    entropy = tables.window_table(result, "entropy", "entropy", 2, 4).splitlines()
    assert entropy[2:] == ["| 1-2 | 0.290 [0.280, 0.300] | 0.290 [0.280, 0.300] |",
                           "| 3-4 | 0.290 [0.280, 0.300] | 0.290 [0.280, 0.300] |"]
    clipped = tables.window_table(result, "clipped", "clipped", 4, 4).splitlines()
    assert clipped[2] == "| 1-4 | - | - |"  # the fake runs log no regions: no number is made up


def drawn_panels(result, tmp_path, monkeypatch) -> dict:
    """The figure of ``result`` as ``{panel title before its comma: its axes}``, drawn with every warning an
    error (matplotlib warns of a log axis without positive values)."""
    import warnings

    import matplotlib.pyplot as plt
    from dgpo_ops.trainer.app.report import plot_runs

    figures, matplotlib_close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its panels
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_runs(result, tmp_path / "curves.png")
    figures[0].canvas.draw()  # the tick labels are made at drawing
    monkeypatch.setattr(plt, "close", matplotlib_close)
    return {ax.get_title().split(",")[0]: ax for ax in figures[0].axes if ax.get_title()}


def test_a_log_scale_panel_stays_linear_where_nothing_is_positive(tmp_path, monkeypatch):
    """EUR and the gradient norm are drawn on a log scale where they span a decade, but not where a (short)
    run logged no positive value: matplotlib would warn and draw nothing."""
    result = fake_result([0])
    for run in result["runs"]:
        for entry in run["log_history"]:
            entry.update(eur=10.0 ** entry["step"], grad_norm=0.0)
    panels = drawn_panels(result, tmp_path, monkeypatch)
    assert panels["EUR (effective update ratio)"].get_yscale() == "log"
    assert panels["gradient norm (before clipping)"].get_yscale() == "linear"


def test_log_axes_only_beyond_a_decade_and_their_ticks_plain_numbers(tmp_path, monkeypatch):
    """EUR within 0.998-1 (every on-policy run) reads on a linear axis, not as ticks 9.995x10^-1; a gradient
    norm over four decades gets a log axis labelled 0.1, 1, 10, 100."""
    result = fake_result([0])
    for run in result["runs"]:
        for entry in run["log_history"]:
            entry.update(eur=1.0 - entry["step"] / 2000, grad_norm=10.0 ** (entry["step"] - 2))
    panels = drawn_panels(result, tmp_path, monkeypatch)
    eur, grad_norm = panels["EUR (effective update ratio)"], panels["gradient norm (before clipping)"]
    assert eur.get_yscale() == "linear" and "log scale" not in eur.get_title()
    assert grad_norm.get_yscale() == "log"
    labels = [label.get_text() for label in grad_norm.get_yticklabels(which="both") if label.get_text()]
    assert labels and all(re.fullmatch(r"[0-9.]+", label) for label in labels), labels


def test_pass_at_k_panel_only_where_pass_at_k_was_measured(tmp_path, monkeypatch):
    """A run without --eval-pass-k draws no pass@k panel (an empty frame titled "not measured"); one with it
    draws the panel."""
    measured = drawn_panels(fake_result([0]), tmp_path, monkeypatch)
    assert "held-out pass@k (sampled" in measured
    result = fake_result([0])
    for run in result["runs"]:
        run["after"] = {key: value for key, value in run["after"].items() if not key.startswith("pass@")}
        run["eval_curve"] = [{key: value for key, value in point.items() if not key.startswith("pass@")}
                             for point in run["eval_curve"]]
    titles = drawn_panels(result, tmp_path, monkeypatch)
    assert not [title for title in titles if "pass@" in title], list(titles)
