"""Command line: `python -m exactness {verify,...}`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactness", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="every check, one verdict table, exit 0 iff exact")
    verify.add_argument("--thorough", action="store_true", help="nightly-scale Hypothesis profile")
    verify.add_argument("--stage", action="append", help="run only this stage (repeatable)")
    args = parser.parse_args(argv)
    if args.command == "verify":
        from .verify import main as verify_main

        return verify_main(args.thorough, args.stage)
    return 2


if __name__ == "__main__":
    sys.exit(main())
