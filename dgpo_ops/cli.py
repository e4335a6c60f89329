"""The ``dgpo-ops`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dgpo-ops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("table", help="print psi(r) of every method")
    plot = sub.add_parser("plot", help="write the psi(r) atlas PNG (needs matplotlib)")
    plot.add_argument("--out", default="psi_atlas.png", help="output PNG path (default: %(default)s)")
    args = parser.parse_args(argv)

    from . import atlas

    if args.command == "table":
        print(atlas.psi_table())
    elif args.command == "plot":
        try:
            path = atlas.plot_atlas(args.out)
        except ImportError:
            print("dgpo-ops plot needs matplotlib: pip install 'dgpo-ops[bench]'", file=sys.stderr)
            return 1
        print(atlas.psi_table())
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
