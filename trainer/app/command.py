"""The ``dgpo-ops`` command: ``train`` (``cli.py``; TRL is imported only then), ``table`` and ``plot`` (the psi
atlas of ``atlas.py``). The app is the top of the package, the one part that may import all the
others; ``DESCRIPTION`` is what ``dgpo-ops --help`` tells a user."""

from __future__ import annotations

import argparse
import sys

import dgpo_ops
from dgpo_ops.trainer.app.restart import wait_passively

DESCRIPTION = """\
Train a language model's policy by reinforcement learning on problems with checkable answers, with DGPO or
another policy loss of dgpo-ops, and compare the losses' gradient weights.

  dgpo-ops train   warm-start and RL-train a policy, then report its held-out accuracy; with no options, a
                   tiny model learns 1-2 digit addition on the CPU in a few minutes (dgpo-ops train --help)
  dgpo-ops table   print psi(r), the weight each method gives a token's gradient at probability ratio r
  dgpo-ops plot    draw those curves into a PNG
"""

# What `dgpo-ops train` needs beyond the library, and the import names of the extra's packages that it imports
# before it starts (TRL and what TRL imports): one of them missing means an install without the extra.
TRAIN_EXTRA = 'pip install "dgpo-ops[train]"'
TRAIN_EXTRA_IMPORTS = ("trl", "transformers", "accelerate", "datasets", "peft")


def missing_train_extra(error: ImportError) -> str | None:
    """The one-line error for an ``ImportError`` of a package of the "train" extra, None for any other."""
    if (error.name or "").partition(".")[0] not in TRAIN_EXTRA_IMPORTS:
        return None
    return (f"dgpo-ops train: error: training needs the packages of dgpo-ops' \"train\" extra, and {error.name} "
            f"is not installed: {TRAIN_EXTRA}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser (TRL's options pass through); TRL is imported only here
        wait_passively()
        try:
            from dgpo_ops.trainer.app import cli as train_cli
        except ImportError as error:
            message = missing_train_extra(error)
            if message is None:
                raise
            print(message, file=sys.stderr)
            return 2
        return train_cli.main(argv[1:])
    parser = argparse.ArgumentParser(prog="dgpo-ops", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dgpo-ops {dgpo_ops.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,table,plot}")
    sub.add_parser("train", add_help=False,
                   help="warm-start and RL-train a policy, report held-out accuracy (dgpo-ops train --help)")
    sub.add_parser("table", help="print psi(r) of every method")
    plot = sub.add_parser("plot", help="write the psi(r) atlas PNG (needs matplotlib)")
    plot.add_argument("--out", default="psi_atlas.png", help="output PNG path (default: %(default)s)")
    args = parser.parse_args(argv)

    from dgpo_ops.trainer.app import atlas

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
