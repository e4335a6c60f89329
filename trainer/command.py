"""The ``dgpo-ops`` command: ``train`` (``cli.py``, TRL imported only then). It lives in the trainer, the top part,
the one that may import all the others. The psi(r) table and atlas of every method are ``python -m bench.atlas``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser (TRL's options pass through); TRL is imported only here
        from dgpo_ops.trainer import cli as train_cli

        return train_cli.main(argv[1:])
    parser = argparse.ArgumentParser(prog="dgpo-ops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", add_help=False,
                   help="warm-start and RL-train a policy, report held-out accuracy (dgpo-ops train --help)")
    parser.parse_args(argv)  # no command, or an unknown one: the usage and an error
    return 2


if __name__ == "__main__":
    sys.exit(main())
