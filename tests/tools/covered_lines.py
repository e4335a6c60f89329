"""Which package lines a set of tests covers, and which lines one run covered that another does not.

Used to check that thinning a test grid leaves nothing uncovered: measure the original test files, then the new
ones (or the whole suite), each with ``tests/tools/coverage.ini``, and compare::

    COVERAGE_FILE=/tmp/before/.coverage coverage run --rcfile=tests/tools/coverage.ini -m pytest FILES -n 0
    COVERAGE_FILE=/tmp/before/.coverage coverage combine --rcfile=tests/tools/coverage.ini
    COVERAGE_FILE=/tmp/before/.coverage coverage json --rcfile=tests/tools/coverage.ini -o /tmp/before.json
    (the same for the new files, to /tmp/after.json)
    python tests/tools/covered_lines.py --before /tmp/before.json --after /tmp/after.json [/tmp/more.json ...]

Several files on either side are merged (a union of their lines). It prints the lines covered before and after
over the files the "before" runs touched, and every line covered before but not after; it exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import json
import sys


def executed_lines(paths: list[str]) -> dict[str, set[int]]:
    """file (relative to the checkout: coverage.ini's relative_files) -> the lines executed in any of the
    coverage JSON reports ``paths``."""
    lines: dict[str, set[int]] = {}
    for path in paths:
        with open(path) as report:
            files = json.load(report)["files"]
        for name, data in files.items():
            lines.setdefault(name, set()).update(data["executed_lines"])
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", nargs="+", required=True, help="coverage JSON reports of the original tests")
    parser.add_argument("--after", nargs="+", required=True, help="coverage JSON reports of the new tests")
    args = parser.parse_args(argv)
    before, after = executed_lines(args.before), executed_lines(args.after)
    lost = {name: sorted(lines - after.get(name, set())) for name, lines in before.items()}
    lost = {name: lines for name, lines in lost.items() if lines}
    covered_before = sum(len(lines) for lines in before.values())
    covered_after = sum(len(after.get(name, set())) for name in before)
    print(f"lines covered before: {covered_before} in {len(before)} files")
    print(f"lines covered after:  {covered_after} in the same files "
          f"({sum(len(lines) for lines in after.values())} in all {len(after)} files measured after)")
    print(f"covered before, not after: {sum(map(len, lost.values()))}")
    for name, lines in sorted(lost.items()):
        print(f"  {name}: {', '.join(map(str, lines))}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
