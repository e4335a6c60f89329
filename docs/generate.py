"""The docs' generated tables, written from the code so that they cannot drift from it:

    python docs/generate.py            # rewrite every table below in place
    python docs/generate.py --check    # exit 1 and name each stale table (tests/package/test_generated_docs.py)

* docs/methods.md, between ``<!-- methods:start -->`` and ``<!-- methods:end -->``: every method and alias, its
  parameters and the ``DGPOConfig`` field each is read from (TRL's spec, ``dgpo_ops/frameworks/trl.py``); README.md,
  between ``<!-- method-names:start -->`` and ``<!-- method-names:end -->``: their names;
* docs/integrations.md, between ``<!-- verl-methods:start -->`` and ``<!-- verl-methods:end -->``: verl's loss
  names and the verl field each parameter is read from (``dgpo_ops/frameworks/verl.py``); between
  ``<!-- skyrl-methods:start -->`` and ``<!-- skyrl-methods:end -->``: SkyRL's, and the field of its algorithm config
  each parameter is read from (``dgpo_ops/frameworks/skyrl.py``);
* docs/design.md, between ``<!-- method-files:start -->`` and ``<!-- method-files:end -->``: each method's file,
  its Triton branch (``MethodId``) and the stage that evaluates it (``method_files_markdown`` below); between
  ``<!-- package-layout:start -->`` and ``<!-- package-layout:end -->``: every folder and module of the
  package and what its docstring says it is (``package_layout_markdown``);
* docs/normalization.md, between ``<!-- framework-aggregations:start -->`` and ``<!-- framework-aggregations:end
  -->``: every framework's aggregation row (``dgpo_ops.frameworks``), what it divides by;
* docs/benchmarks.md, between ``<!-- headline:start -->`` and ``<!-- headline:end -->``: every GPU figure of the
  headline, from the committed results files, with its card, run and commit (``docs/headline.py``; the README states
  none and links there);
* docs/api.md, between ``<!-- signature-NAME:start -->`` and ``<!-- signature-NAME:end -->``: the signature of the
  public function NAME, as ``inspect.signature`` gives it;
* README.md, docs/training.md and docs/train/README.md, between ``<!-- default-result:start -->`` and
  ``<!-- default-result:end -->``: the plain ``dgpo-ops train``'s held-out accuracy before -> after RL, read
  from its committed console log ``docs/train/default_run.log`` (``default_result``);
* docs/integrations.md, between ``<!-- skyrl-cpu-install:start -->`` and ``<!-- skyrl-cpu-install:end -->``:
  the install lines of SkyRL's CPU environment, read from ``.ci/skyrl_cpu.sh`` (``skyrl_cpu_packages``);
* dgpo_ops/api.py and dgpo_ops/ops/linear_logprobs.py, between ``# public-functions:start`` and
  ``# public-functions:end``: the definition of each public function of the module's ``PUBLIC_FUNCTIONS``,
  each keyword annotated and defaulted as the call object's field, and its docstring
  (``public_functions_source``), for IDEs, type checkers and ``grep``;
* README.md, between ``<!-- times:start -->`` and ``<!-- times:end -->``: how long each README command takes,
  alone and beside two busy loops, read from the timing logs (``TIMED_COMMANDS``, ``docs/timing/measure.sh``).

A tool of the checkout, not of the package: the tables are written here from the mappings the library and
the trainer hold, the logs and the CI scripts; the package writes no markdown and reads no checkout path.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "docs") not in sys.path:  # headline.py beside this file, also when a test loads this one by path
    sys.path.insert(0, str(REPO / "docs"))

import headline  # noqa: E402


class Section(NamedTuple):
    page: str  # relative to the checkout
    start: str
    end: str
    body: Callable[[], str]


def method_files_markdown() -> str:
    """docs/design.md's table: where each method lives and what evaluates it."""
    from dgpo_ops.methods.table import METHODS

    lines = ["| method | file | Triton branch | evaluated |", "|---|---|---|---|"]
    for name, spec in METHODS.items():
        path = f"`dgpo_ops/methods/{spec.config.__module__.rpartition('.')[2]}.py`"
        if spec.token_local:
            branch, stage = f"`MethodId.{spec.config.method_id.name}`", "per token: the row kernels' epilogue"
        elif spec.sequence_statistic is not None:
            branch, stage = "-", f"the torch objective, at its sequence statistic `{spec.sequence_statistic.__name__}`"
        elif spec.token_selection is not None:
            branch, stage = "-", f"the torch objective, then its token selection `{spec.token_selection.__name__}`"
        else:
            branch, stage = "-", "the torch objective (it reads each response's score)"
        lines.append(f"| `{name}` | {path} | {branch} | {stage} |")
    return "\n".join(lines) + "\n"


# The package's parts in the order they build on each other; a folder not named here follows them.
PARTS = ("kernels", "dgpo_ops/methods", "dgpo_ops/corrections", "dgpo_ops/core", "dgpo_ops/layouts",
         "dgpo_ops/ops", "dgpo_ops/distributed", "dgpo_ops", "dgpo_ops/integrations", "trainer",
         "trainer/app")


def _summary(path: Path, whole: bool) -> str:
    """A module's docstring as markdown on one line: its first paragraph (``whole``) or first sentence."""
    import ast

    text = (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0]
    text = " ".join(text.split()).replace("``", "`").replace("|", "\\|")
    if not whole:
        sentence = re.match(r"(.+?)\.(?= [A-Z`(]|$)", text)
        text = sentence.group(1) if sentence else text
    text = text.rstrip(":")  # a paragraph that opens a list
    if not text:
        raise ValueError(f"{path.relative_to(REPO)} has no docstring: docs/design.md's layout is made of "
                         "them")
    return text


def package_folders() -> list[Path]:
    """The package's folders (``kernels/``, ``dgpo_ops/`` and ``trainer/`` and their packages), in ``PARTS``'
    order."""
    folders = {REPO / "kernels", REPO / "trainer", REPO / "dgpo_ops",
               *(path for root in ("dgpo_ops", "trainer") for path in (REPO / root).iterdir()
                 if (path / "__init__.py").is_file() and not path.is_symlink())}
    order = {REPO / part: index for index, part in enumerate(PARTS)}
    return sorted(folders, key=lambda path: (order.get(path, len(order)), str(path)))


def package_layout_markdown() -> str:
    """docs/design.md's layout of the package: each folder, its docstring (its ``__init__.py``'s first
    paragraph), and each of its modules with the first sentence of its docstring."""
    lines = []
    for folder in package_folders():
        lines += [f"**`{folder.relative_to(REPO)}/`**: {_summary(folder / '__init__.py', whole=True)}", ""]
        lines += [f"* `{path.name}`: {_summary(path, whole=False)}"
                  for path in sorted(folder.glob("*.py")) if path.name != "__init__.py"]
        lines.append("")
    return "\n".join(lines)


def framework_aggregations_markdown() -> str:
    """docs/normalization.md's table: each framework's aggregation row (``dgpo_ops.frameworks``), what one call
    divides by, what that count runs over in a step and the step count ``N`` (every call passes ``N / dp_size``),
    and the framework's source."""
    from dgpo_ops.frameworks import FRAMEWORK_AGGREGATIONS
    from dgpo_ops.kernels.interface import Denominator

    words = {Denominator.TOKENS: "scored tokens", Denominator.RESPONSES: "responses (every row)",
             Denominator.GRID: "responses x T", Denominator.ONE: "1",
             Denominator.SCORED_RESPONSES: "responses with a scored token", Denominator.HORIZON: "T"}
    lines = ["| aggregation | each token weighs | divided by (one call) | counted over | N, over a whole step | source |",
             "|---|---|---|---|---|---|"]
    for name, row in FRAMEWORK_AGGREGATIONS.items():
        weight = "1 / its response length" if row.per_response else "1"
        lines.append(f"| `{name}` | {weight} | {words[row.denominator]} | {row.scope.value} | {row.step_count} | "
                     f"{row.source} |")
    return "\n".join(lines) + "\n"


def format_value(value) -> str:
    """A parameter value as the tables write it."""
    return repr(value) if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


def method_names_markdown() -> str:
    """The README's line of method names (the table is docs/methods.md's)."""
    from dgpo_ops.methods.table import ALIASES, METHODS

    names = ", ".join(f"`{name}`" for name in METHODS)
    aliases = ", ".join(f"`{name}`" for name in ALIASES)
    return f"{len(METHODS)} methods, {names}, and the aliases {aliases}.\n"


def methods_markdown() -> str:
    """docs/methods.md's table of methods, parameters, accepted values and the ``DGPOConfig`` field each is read
    from (``dgpo_ops.trainer.method_fields``), with the presets of ``dgpo-ops train`` (its ``presets``)."""
    from dgpo_ops.methods.table import ALIASES, METHODS
    from dgpo_ops.trainer.app.presets import trainer_presets
    from dgpo_ops.trainer.method_fields import (ConfigParam, config_method_params, config_params,
                                                none_means_default)

    lines = ["| method | what it does | parameters: default, accepted values "
             "| `DGPOConfig` / `dgpo-ops train` field |", "|---|---|---|---|"]
    none_fields = {field for field, params in config_params().items() if none_means_default(params)}

    def source(p: ConfigParam) -> str:
        if p.field is None:
            return f"`{p.name}`: fixed at its default"
        text = f"`{p.name}` <- `{p.field.name}`"
        if p.field.offset:
            text += f" - {p.field.offset:g}"
        if p.field.fallback:
            text += f" (None: `{p.field.fallback}`)"
        elif p.field.name in none_fields and p.default is not None:
            text += " (None: the default)"
        return text

    for name, spec in METHODS.items():
        params = config_method_params(name)
        described = "<br>".join(f"`{p.name}={format_value(p.default)}`: {p.spec.describe()}"
                                for p in params) or "none"
        fields = "<br>".join(source(p) for p in params) or "-"
        presets = ", ".join(f"`{k}={format_value(v)}`" for k, v in trainer_presets(name).items())
        trainer = f"; `dgpo-ops train` presets {presets}" if presets else ""
        lines.append(f"| `{name}` | {spec.summary}{trainer} | {described} | {fields} |")
    for name, alias in ALIASES.items():
        params = ", ".join(f"`{k}={format_value(v)}`" for k, v in alias.params.items())
        lines.append(f"| `{name}` | {alias.summary}: `{alias.method}` with {params} where unset "
                     f"| as `{alias.method}` | as `{alias.method}` |")
    return "\n".join(lines) + "\n"


def framework_methods_markdown(framework: str, name_field: str, config_path: str, params_field: str,
                               loss_name: Callable[[str], str], field_text: Callable) -> str:
    """A framework's table of loss names (``loss_name(method)``), papers and where each parameter is read
    from: ``field_text(param)`` describes the field of the framework's config at ``config_path`` that means it
    (None: ``params_field``, the ``method_params`` mapping, with the table's default)."""
    from dgpo_ops.methods.catalog import method_params
    from dgpo_ops.methods.table import ALIASES, METHODS

    lines = [f"| `{name_field}` | paper | from `{config_path}` | from `{params_field}` (default) |",
             "|---|---|---|---|"]
    for method, spec in METHODS.items():
        params = method_params(method)
        fields = [text for p in params if (text := field_text(p)) is not None]
        own = [f"`{p.name}={format_value(p.default)}`" for p in params if field_text(p) is None]
        lines.append(f"| `{loss_name(method)}` | {spec.paper} | {'<br>'.join(fields) or '-'} | "
                     f"{', '.join(own) or '-'} |")
    for name, alias in ALIASES.items():
        presets = ", ".join(f"`{k}={format_value(v)}`" for k, v in alias.params.items())
        base = loss_name(alias.method)
        lines.append(f"| `{loss_name(name)}` | {alias.summary}: `{base}` with {presets} "
                     f"(over {framework}'s field) | as `{base}` | as `{base}` |")
    return "\n".join(lines) + "\n"


def verl_methods_markdown() -> str:
    """docs/integrations.md's table of verl loss names, papers and where each parameter is read from
    (``dgpo_ops.integrations.verl_params``)."""
    from dgpo_ops.frameworks.verl import SPEC
    from dgpo_ops.integrations.verl_params import loss_mode, verl_field

    def field_text(p):
        if (source := verl_field(p)) is None:
            return None
        return f"`{p.name}` <- `{source.path}`" + (f" (None: `{source.fallback}`)" if source.fallback else "")

    return framework_methods_markdown("verl", "loss_mode", SPEC.fields.root, SPEC.fields.params_field, loss_mode,
                                      field_text)


def skyrl_methods_markdown() -> str:
    """docs/integrations.md's table of SkyRL loss names, papers and where each parameter is read from
    (``dgpo_ops.integrations.skyrl_params``)."""
    from dgpo_ops.frameworks.skyrl import SPEC
    from dgpo_ops.integrations.skyrl_params import ALGORITHM, loss_type, skyrl_field

    def field_text(p):
        path = skyrl_field(p)
        return None if path is None else f"`{p.name}` <- `{path}`"

    return framework_methods_markdown("SkyRL", "policy_loss_type", ALGORITHM, SPEC.fields.params_field, loss_type,
                                      field_text)


def signature_markdown(name: str) -> Callable[[], str]:
    """The public function ``name``'s signature as Python shows it (``inspect.signature``), in a code span."""
    def body() -> str:
        import inspect

        import dgpo_ops

        signature = inspect.signature(getattr(dgpo_ops, name))

        def text(annotation) -> str:  # the annotations are strings (postponed evaluation): shown unquoted
            return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)

        parts, keyword_only = [], False
        for parameter in signature.parameters.values():
            if parameter.kind is parameter.KEYWORD_ONLY and not keyword_only:
                parts.append("*")
                keyword_only = True
            part = parameter.name
            if parameter.annotation is not parameter.empty:
                part += f": {text(parameter.annotation)}"
            if parameter.default is not parameter.empty:
                part += f" = {parameter.default!r}"
            parts.append(part)
        returns = "" if signature.return_annotation is signature.empty else f" -> {text(signature.return_annotation)}"
        return f"`{name}({', '.join(parts)}){returns}`\n"

    return body


# The README's table of how long its commands take: (what, command, log alone, log beside two busy loops), the logs
# written by docs/timing/measure.sh (and, for the main job, as docs/train/timing/README.md says).
TIMED_COMMANDS = (
    ("the main job", "`dgpo-ops train`", "docs/train/timing/idle.log", "docs/timing/mainjob_busy2.log"),
    ("the main job, shortened", "`dgpo-ops train --sft-steps 60 --max-steps 6 --eval-size 100`",
     "docs/train/timing/short_idle.log", "docs/train/timing/short_busy2.log"),
    ("the tests", "`python -m pytest`", "docs/timing/tests_idle.log", "docs/timing/tests_busy2.log"),
    ("the frameworks' suites", "`bash .ci/venvs.sh`", "docs/timing/venvs_idle.log", None),
)


class TimedRun(NamedTuple):
    seconds: float
    load_before: str
    load_after: str
    commit: str | None
    tests: str | None  # pytest's closing counts ("3138 passed, 160 skipped"; summed over several suites)


def timed_run(path: Path) -> TimedRun:
    """The wall time (``WALL 113.26 s``), the one-minute load before and after (``uptime``'s lines), the commit and
    pytest's closing counts of one timing log."""
    text = path.read_text()
    wall = re.search(r"^WALL ([0-9.]+) s$", text, re.MULTILINE)
    loads = re.findall(r"load average: ([0-9.]+),", text)
    if wall is None or len(loads) < 2:
        raise ValueError(f"{path}: no WALL line or no load before and after")
    commit = re.search(r"^# commit ([0-9a-f]+)", text, re.MULTILINE)
    summaries = re.findall(r"^=* ?(\d+ passed[^=\n]*?) in [0-9.]+s", text, re.MULTILINE)
    counts = [dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (passed|failed|skipped)", line))
              for line in summaries]
    tests = None
    if len(counts) == 1:
        tests = ", ".join(f"{n} {kind}" for kind, n in counts[0].items())
    elif counts:  # several suites in one command (the frameworks' venvs)
        tests = f"{len(counts)} suites, {sum(c.get('passed', 0) for c in counts)} passed, " \
                f"{sum(c.get('failed', 0) for c in counts)} failed"
    return TimedRun(float(wall.group(1)), loads[0], loads[-1], commit and commit.group(1), tests)


def times_markdown(root: Path = REPO) -> str:
    """The README's table: each command's wall time alone and beside two busy loops, with load and log."""
    def cell(log: str | None) -> str:
        if log is None:
            return "not measured"
        run = timed_run(root / log)
        minutes = f" ({run.seconds / 60:.1f} min)" if run.seconds >= 120 else ""
        at = f", at {run.commit}" if run.commit else ""
        tests = f"; {run.tests}" if run.tests else ""
        return (f"[{run.seconds:.0f} s]({log}){minutes}, load {run.load_before} -> {run.load_after}{at}{tests}")

    lines = ["| what | command | alone | beside two busy loops |", "|---|---|---|---|"]
    lines += [f"| {what} | {command} | {cell(alone)} | {cell(busy)} |" for what, command, alone, busy in TIMED_COMMANDS]
    return "\n".join(lines) + "\n"


DEFAULT_RUN_LOG = REPO / "docs" / "train" / "default_run.log"
# The same command timed on an idle machine (docs/train/timing/README.md): another outcome of its warm start.
TIMED_RUN_LOG = REPO / "docs" / "train" / "timing" / "idle.log"


class DefaultResult(NamedTuple):
    method: str
    seeds: str
    n: int
    before: str
    after: str


def default_result(log: Path = DEFAULT_RUN_LOG) -> DefaultResult:
    """The plain ``dgpo-ops train``'s result as its console log's summary states it: the method, the seeds,
    the held-out problems and the accuracy before -> after RL, as printed (three decimals)."""
    text = log.read_text()
    header = re.search(r"^dgpo-ops train: (\S+) x seeds (\[[0-9, ]+\])", text, re.MULTILINE)
    n = re.search(r"^held-out accuracy \(greedy, n=(\d+)\), before -> after RL:$", text, re.MULTILINE)
    rows = re.findall(r"^ +(\S+): ([0-9.]+) -> ([0-9.]+) \(mean over", text, re.MULTILINE)
    if not (header and n and len(rows) == 1 and rows[0][0] == header[1]):
        raise ValueError(f"{log.name} does not end on one method's summary of a dgpo-ops train run")
    return DefaultResult(header[1], header[2], int(n[1]), rows[0][1], rows[0][2])


def default_result_markdown(train_folder: str) -> str:
    """The sentences every page states the default run's result in, from its log and the timed run's;
    ``train_folder``: docs/train/, relative to the page."""
    result, timed = default_result(), default_result(TIMED_RUN_LOG)
    text = (f"The plain `dgpo-ops train` ({result.method}, seed {result.seeds.strip('[]')}) takes greedy "
            f"held-out accuracy on the {result.n} problems from **{result.before} -> {result.after}** "
            f"(before -> after RL; its console log: [default_run.log]({train_folder}default_run.log)).")
    if (timed.before, timed.after) != (result.before, result.after):
        text += (" Its warm start on a CPU is not bitwise reproducible from run to run (the SFT losses part "
                 "in the fourth decimal), so a run can end elsewhere: the timed idle run gave "
                 f"{timed.before} -> {timed.after} ([timing/idle.log]({train_folder}timing/idle.log)).")
    return textwrap.fill(text, width=110, break_long_words=False, break_on_hyphens=False) + "\n"


SKYRL_CPU_SCRIPT = REPO / ".ci" / "skyrl_cpu.sh"


def skyrl_cpu_packages(script: Path = SKYRL_CPU_SCRIPT) -> list[str]:
    """The pinned packages ``.ci/skyrl_cpu.sh`` installs without dependencies: its ``SKYRL_IMPORTS`` array."""
    body = re.search(r"^SKYRL_IMPORTS=\((.*?)^\)", script.read_text(), re.MULTILINE | re.DOTALL)
    if body is None:
        raise ValueError(f"{script.relative_to(REPO)} has no SKYRL_IMPORTS=( ... ) array")
    return body[1].split()


def skyrl_cpu_install_markdown() -> str:
    """docs/integrations.md's install lines of SkyRL's CPU environment: each ``pip_quiet install`` of
    ``.ci/skyrl_cpu.sh`` in its order, with its ``SKYRL_IMPORTS`` written out."""
    commands = re.findall(r"^ *pip_quiet (install .*)$", SKYRL_CPU_SCRIPT.read_text(), re.MULTILINE)
    lines = []
    for command in commands:
        words = command.replace('"${SKYRL_IMPORTS[@]}"', " ".join(skyrl_cpu_packages())).split()
        lines.append("pip")
        for word in words:
            if len(lines[-1]) + len(word) > 104:
                lines[-1] += " \\"
                lines.append("   ")
            lines[-1] += f" {word}"
    return "```bash\n" + "\n".join(lines) + "\n```\n"
LINE_LENGTH = 110  # pyproject.toml's [tool.ruff] line-length


def _wrapped(text: str, indent: str) -> list[str]:
    """``text`` re-wrapped within the line length at ``indent``: each paragraph, and each list item (a line
    opening with ``* ``, its later lines under its text), joined and filled again."""
    import textwrap

    blocks = []  # (first line's words, whether a list item); None: a blank line
    for line in text.splitlines():
        if not line.strip():
            blocks.append(None)
        elif line.startswith("* ") or not blocks or blocks[-1] is None or blocks[-1][0].endswith(":"):
            blocks.append([line, line.startswith("* ")])
        else:
            blocks[-1][0] += " " + line
    lines = []
    for block in blocks:
        if block is None:
            lines.append("")
            continue
        later = indent + ("  " if block[1] else "")
        lines += textwrap.wrap(block[0], width=LINE_LENGTH, initial_indent=indent, subsequent_indent=later,
                               break_long_words=False, break_on_hyphens=False)
    return lines


def _literal(value) -> str:
    """A default as source text, strings in double quotes (the package's style)."""
    return f'"{value}"' if isinstance(value, str) and '"' not in value and "\\" not in value else repr(value)


def public_functions_source(module: str) -> str:
    """``module``'s definitions of its public functions: one per entry of its ``PUBLIC_FUNCTIONS``, with its
    signature (``PublicFunction.signature``: the call object's fields, annotated and defaulted) and its
    docstring (the one ``PublicFunction.define`` composes, wrapped to the line length)."""
    import importlib
    import inspect

    from dgpo_ops.core.docstrings import documented

    functions = importlib.import_module(module).PUBLIC_FUNCTIONS
    lines = ["# Written by `python docs/generate.py` from PUBLIC_FUNCTIONS and the fields of LossInputs and",
             "# LossOptions: what an IDE, a type checker and grep see. Each call runs the function that",
             "# PublicFunction.define makes (the call's split, then its body), whose signature and docstring",
             "# are these."]
    for name, public in functions.items():
        lines += ["", "", f'@PUBLIC_FUNCTIONS["{name}"].define', f"def {name}("]
        keyword_only = False
        for parameter in public.signature.parameters.values():
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY and not keyword_only:
                lines.append("    *,")
                keyword_only = True
            prefix = "**" if parameter.kind is inspect.Parameter.VAR_KEYWORD else ""
            empty = parameter.default is inspect.Parameter.empty
            default = "" if empty else f" = {_literal(parameter.default)}"
            lines.append(f"    {prefix}{parameter.name}: {parameter.annotation}{default},")
        lines.append(f") -> {public.signature.return_annotation}:")

        def declared():
            pass

        declared.__signature__ = public.signature
        doc = documented(public.summary, public.returns)(declared).__doc__  # as PublicFunction.define does
        if '"""' in doc or "\\" in doc:
            raise ValueError(f"{name}'s docstring cannot be written between triple quotes as it is")
        body = _wrapped(doc, "    ")
        body[0] = '    """' + body[0].lstrip()
        lines += body
        lines.append('    """')
    return "\n".join(lines) + "\n"


SECTIONS = (
    Section("docs/methods.md", "<!-- methods:start -->", "<!-- methods:end -->", methods_markdown),
    Section("README.md", "<!-- method-names:start -->", "<!-- method-names:end -->", method_names_markdown),
    Section("README.md", "<!-- times:start -->", "<!-- times:end -->", times_markdown),
    Section("docs/integrations.md", "<!-- verl-methods:start -->", "<!-- verl-methods:end -->",
            verl_methods_markdown),
    Section("docs/integrations.md", "<!-- skyrl-methods:start -->", "<!-- skyrl-methods:end -->",
            skyrl_methods_markdown),
    Section("docs/design.md", "<!-- method-files:start -->", "<!-- method-files:end -->", method_files_markdown),
    Section("docs/design.md", "<!-- package-layout:start -->", "<!-- package-layout:end -->",
            package_layout_markdown),
    Section("docs/normalization.md", "<!-- framework-aggregations:start -->", "<!-- framework-aggregations:end -->",
            framework_aggregations_markdown),
    Section("docs/benchmarks.md", "<!-- headline:start -->", "<!-- headline:end -->", headline.headline_markdown),
    *(Section("docs/api.md", f"<!-- signature-{name}:start -->", f"<!-- signature-{name}:end -->",
              signature_markdown(name)) for name in ("fused_linear_logprobs", "linear_logprob_entropy")),
    Section("README.md", "<!-- default-result:start -->", "<!-- default-result:end -->",
            partial(default_result_markdown, "docs/train/")),
    Section("docs/training.md", "<!-- default-result:start -->", "<!-- default-result:end -->",
            partial(default_result_markdown, "train/")),
    Section("docs/train/README.md", "<!-- default-result:start -->", "<!-- default-result:end -->",
            partial(default_result_markdown, "")),
    Section("docs/integrations.md", "<!-- skyrl-cpu-install:start -->", "<!-- skyrl-cpu-install:end -->",
            skyrl_cpu_install_markdown),
    Section("dgpo_ops/api.py", "# public-functions:start", "# public-functions:end",
            lambda: public_functions_source("dgpo_ops.api")),
    Section("dgpo_ops/ops/linear_logprobs.py", "# public-functions:start", "# public-functions:end",
            lambda: public_functions_source("dgpo_ops.ops.linear_logprobs")),
)


def with_section(text: str, start: str, end: str, body: str) -> str:
    """``text`` with the part between the markers ``start`` and ``end`` replaced by ``body``."""
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"expected one {start} ... {end} section")
    return pattern.sub(lambda _: f"{start}\n{body}{end}", text)


def stale_sections(root: Path = REPO) -> list[str]:
    """The sections whose text is not what the code writes now (``page: start``)."""
    stale = []
    for section in SECTIONS:
        text = (root / section.page).read_text()
        if with_section(text, section.start, section.end, section.body()) != text:
            stale.append(f"{section.page}: {section.start}")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/generate.py", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_sections()
        for name in stale:
            print(f"stale: {name} (run python docs/generate.py)", file=sys.stderr)
        return 1 if stale else 0
    for section in SECTIONS:
        page = REPO / section.page
        page.write_text(with_section(page.read_text(), section.start, section.end, section.body()))
        print(f"wrote {section.page}: {section.start}")
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:  # `python docs/generate.py` from anywhere imports the checkout's package
        sys.path.insert(0, str(REPO))
    sys.exit(main())
