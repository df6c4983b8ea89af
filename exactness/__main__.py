"""Command line: `python -m exactness {verify,prove,repro,mutants,gate,precision,kimi,check}`.

Every command but `kimi` is the suite's (exactness.suite, proofs): this file is the one place
where the product and the suite meet, and it imports each command only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, what it does); each module's main(argv) parses its own options
COMMANDS = {
    "verify": ("exactness.suite.gate.verify", "every check, one verdict table, exit 0 iff exact"),
    "prove": ("proofs.prover", "Z3 proofs of every accumulator bound"),
    "repro": ("exactness.suite.gate.repro", "replay counterexample files"),
    "mutants": ("exactness.suite.mutants.run", "the mutation catalogue against the suite"),
    "gate": ("exactness.suite.gate.ci", "the CI gate: which profile .ci/run verifies in, and why"),
    "precision": ("exactness.suite.precision", "the precision report (reports/precision.md)"),
    "kimi": ("exactness.suite.peers.kimi_check", "check a Kimi checkpoint directory on disk"),
    "check": ("exactness.suite.peers.command", "the suite on a kernel this project did not write"),
}
# the commands that check the project's kernels: on a CPU without AVX-512 VNNI they check the C
# kernel emulated, as the tests do (conftest.py)
SUITE_OF_KERNELS = ("verify", "repro", "mutants", "check")


def main(argv: list[str] | None = None) -> int:
    """Every command runs with the mutant EXACTNESS_MUTANT names planted, if any; the suite's
    checks of the kernels with the C kernel emulated where the CPU lacks it."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="python -m exactness", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        sub = parser.add_subparsers(dest="command", required=True)
        for name, (_, what) in COMMANDS.items():
            sub.add_parser(name, help=what)
        parser.parse_args(argv)  # prints the usage and exits
        return 2
    from contextlib import nullcontext

    from exactness.suite.mutants import applied, from_env

    if argv[0] in SUITE_OF_KERNELS:
        from exactness.suite.paths import emulate_the_c_kernel_where_missing

        emulate_the_c_kernel_where_missing()
    mutant = from_env()
    command = importlib.import_module(COMMANDS[argv[0]][0])
    with applied(mutant) if mutant else nullcontext():
        return command.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
