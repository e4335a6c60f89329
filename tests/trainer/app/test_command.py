"""The ``dgpo-ops`` command: its help, ``table`` and ``plot``, and ``train`` on an install without the "train"
extra."""

import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

from dgpo_ops.methods.table import GATES, METHODS
from dgpo_ops.trainer.app import command as cli

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_table_lists_every_method_for_both_signs(capsys):
    assert cli.main(["table"]) == 0
    out = capsys.readouterr().out
    for name in [m for m in METHODS if m != "sapo"] + [f"sapo {gate}" for gate in GATES]:
        assert f"\n{name} " in out
    assert out.count("\ndgpo ") == 2


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "atlas.png"
    assert cli.main(["plot", "--out", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


def test_help_opens_with_what_the_command_does_for_a_user(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    opening = out[:out.index("positional arguments")].split("\n\n", 1)[1]  # what follows the usage line
    assert opening.split()[0] == "Train" and "held-out accuracy" in opening
    for command in ("train", "table", "plot"):
        assert f"dgpo-ops {command} " in opening
    for internal in (".py", "``", "import", "TRL", "module", "dgpo_ops"):  # the package's inside, not the user's
        assert internal not in opening, internal


def test_version_names_the_installed_package(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.split() == ["dgpo-ops", importlib.metadata.version("dgpo-ops")]


# `dgpo-ops train` where the library was installed without the "train" extra: trl cannot be imported.
NO_TRL = """
import sys

class NoTRL:
    def find_spec(self, name, path=None, target=None):
        if name == "trl" or name.startswith("trl."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTRL())
"""
TRAIN_COMMANDS = [["train"], ["train", "--help"], ["train", "--method", "grpo"]]
# The commands above and `table`, one after another in one interpreter (an import that failed is tried again
# by the next command, as in a new process): each one's exit code, standard output and error, as JSON.
WITHOUT_TRL = NO_TRL + """
import contextlib, io, json
from dgpo_ops.trainer.app.command import main

results = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def without_trl() -> dict[str, tuple[int, str, str]]:
    """``dgpo-ops`` where the library was installed without the "train" extra: command line -> (exit code,
    stdout, stderr)."""
    import json

    commands = [*TRAIN_COMMANDS, ["table"]]
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRL, json.dumps(commands)], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return {" ".join(args): tuple(outcome) for args, outcome in zip(commands, json.loads(result.stdout))}


# the tests that read the process without TRL: one xdist worker starts it, once
WITHOUT_TRL_GROUP = pytest.mark.xdist_group("command_without_trl")


@WITHOUT_TRL_GROUP
@pytest.mark.parametrize("args", TRAIN_COMMANDS, ids=" ".join)
def test_train_without_trl_names_the_extra_to_install(args, without_trl):
    code, stdout, stderr = without_trl[" ".join(args)]
    assert code == 2, stderr
    assert stderr.strip().splitlines() == [(
        "dgpo-ops train: error: training needs the packages of dgpo-ops' \"train\" extra, and trl is not installed: "
        'pip install "dgpo-ops[train]"')]
    assert stdout == ""


@WITHOUT_TRL_GROUP
def test_the_other_commands_run_without_trl(without_trl):
    code, stdout, stderr = without_trl["table"]
    assert code == 0 and "psi(r)" in stdout, stderr


def test_only_the_extras_missing_packages_are_reported_as_such():
    assert "dgpo-ops[train]" in cli.missing_train_extra(ModuleNotFoundError(name="transformers.models"))
    assert cli.missing_train_extra(ModuleNotFoundError(name="trlx")) is None
    assert cli.missing_train_extra(ImportError("cannot import name 'x'")) is None


@pytest.mark.parametrize(("preset", "entry"), [(None, "module"), (None, "script"), ("active", "module")])
def test_the_train_program_runs_itself_again_with_passive_openmp_threads(tmp_path, preset, entry):
    """``dgpo-ops train`` restarts once with OMP_WAIT_POLICY=passive (read by libgomp when torch loads), unless
    the environment names a policy: every interpreter start is recorded by a sitecustomize. It restarts before
    it imports TRL: the sitecustomize makes TRL unimportable, so a restart after the import would never happen
    (the first process would stop at the missing extra)."""
    import os
    import pathlib
    import subprocess
    import sys

    import dgpo_ops

    starts = tmp_path / "starts.txt"
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        f"open({str(starts)!r}, 'a').write(str(os.environ.get('OMP_WAIT_POLICY')) + '\\n')\n"
        + NO_TRL)
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    checkout = str(pathlib.Path(dgpo_ops.__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), checkout, *filter(None, [env.get("PYTHONPATH")])])
    program = ["-m", "dgpo_ops.trainer.app.command"]
    if entry == "script":  # as pip writes the console script
        (tmp_path / "bin").mkdir()
        script = tmp_path / "bin" / "dgpo-ops"
        script.write_text("import sys\nfrom dgpo_ops.trainer.app.command import main\nsys.exit(main())\n")
        program = [str(script)]
    result = subprocess.run([sys.executable, *program, "train"], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 2
    assert 'and trl is not installed: pip install "dgpo-ops[train]"' in result.stderr
    assert starts.read_text().split() == (["None", "passive"] if preset is None else [preset])


def test_a_caller_of_the_train_main_is_never_replaced(monkeypatch):
    import os

    from dgpo_ops.trainer.app import restart

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "execv", lambda *args: pytest.fail(f"execv{args}"))
    restart.wait_passively()  # here __main__ is pytest's, not the program
    assert "OMP_WAIT_POLICY" not in os.environ
