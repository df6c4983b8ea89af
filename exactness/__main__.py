"""Command line: `python -m exactness {verify,...}`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Every command runs with the mutant EXACTNESS_MUTANT names planted, if any."""
    from contextlib import nullcontext

    from .mutants import applied, from_env

    mutant = from_env()
    with applied(mutant) if mutant else nullcontext():
        return _dispatch(argv)


def _dispatch(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactness", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="every check, one verdict table, exit 0 iff exact")
    verify.add_argument("--thorough", action="store_true", help="nightly-scale Hypothesis profile")
    verify.add_argument("--stage", action="append", help="run only this stage (repeatable)")
    sub.add_parser("prove", help="Z3 proofs of every accumulator bound (--help for options)",
                   add_help=False)
    if argv is None:
        argv = sys.argv[1:]
    sub.add_parser("repro", help="replay counterexample files (--help for options)",
                   add_help=False)
    if argv[:1] == ["prove"]:
        from proofs.prover import main as prove_main

        return prove_main(argv[1:])
    kimi = sub.add_parser("kimi", help="check a Kimi checkpoint directory on disk")
    kimi.add_argument("checkpoint_dir")
    kimi.add_argument("--layers", type=int, nargs="+")
    kimi.add_argument("--experts", type=int, nargs="+")
    kimi.add_argument("--tokens", type=int, default=4, help="sampled tokens per projection")
    sub.add_parser("mutants", help="the mutation catalogue against the suite", add_help=False)
    sub.add_parser("precision", help="the precision report (reports/precision.md)",
                   add_help=False)
    if argv[:1] == ["precision"]:
        from .precision import main as precision_main

        return precision_main(argv[1:])
    if argv[:1] == ["mutants"]:
        from .mutants import main as mutants_main

        return mutants_main(argv[1:])
    sub.add_parser("gate", help="the CI gate: which profile .ci/run verifies in, and why",
                   add_help=False)
    if argv[:1] == ["gate"]:
        from .gate import main as gate_main

        return gate_main(argv[1:])
    if argv[:1] == ["repro"]:
        from .repro import main as repro_main

        return repro_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "kimi":
        from .kimi import check_checkpoint

        return check_checkpoint(args.checkpoint_dir, args.layers, args.experts, args.tokens)
    if args.command == "verify":
        from .verify import main as verify_main

        return verify_main(args.thorough, args.stage)
    return 2


if __name__ == "__main__":
    sys.exit(main())
