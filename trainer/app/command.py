"""The ``dgpo-ops`` command: ``train`` (``cli.py``, TRL imported only then), ``table`` and ``plot`` (the psi
atlas of ``dgpo_ops.methods.atlas``). It lives in the trainer, the top part, the one that may import both."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser (TRL's options pass through); TRL is imported only here
        from dgpo_ops.trainer.app import cli as train_cli

        return train_cli.main(argv[1:])
    parser = argparse.ArgumentParser(prog="dgpo-ops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("table", help="print psi(r) of every method")
    plot = sub.add_parser("plot", help="write the psi(r) atlas PNG (needs matplotlib)")
    plot.add_argument("--out", default="psi_atlas.png", help="output PNG path (default: %(default)s)")
    sub.add_parser("train", add_help=False,
                   help="warm-start and RL-train a policy, report held-out accuracy (dgpo-ops train --help)")
    args = parser.parse_args(argv)

    from dgpo_ops.methods import atlas

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
