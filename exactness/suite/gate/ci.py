"""The CI gate on kernel changes: which Hypothesis profile `.ci/run` verifies in.

Thorough when the watched files (the kernels and the arithmetic they are proved against) changed
since the base commit (`EXACTNESS_BASE`, default the previous commit), or differ from the files
the last exact `verify --thorough` ran on, whose digest it records in THOROUGH_STAMP. The base
sees one commit; the stamp sees every commit since a thorough verdict, so a push of several whose
last leaves the kernel alone is still verified thoroughly. Either rule only adds thorough runs.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository
# the kernels and every product file whose arithmetic they are proved against or that decides a
# forward's bits (the contract's constants, the op and its slow-row splice, the MoE glue);
# not the suite's tests and strategies, which the ci profile runs on every change
WATCHED = ("exactness/kernels", "exactness/contract.py", "exactness/dataflow.py",
           "exactness/formats.py", "exactness/quantize.py", "exactness/modules.py",
           "exactness/ops.py", "exactness/glue.py", "exactness/moe.py", "exactness/stacked.py",
           "exactness/suite/reference.py", "proofs")
THOROUGH_STAMP = Path(".ci/thorough-verified")


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True)


def watched_digest(root: Path = ROOT) -> str | None:
    """sha256 of the watched files git tracks, as they are in the working tree (None outside a
    git checkout)."""
    try:
        listed = _git(root, "ls-files", "-z", "--", *WATCHED)
    except OSError:
        return None
    if listed.returncode != 0:
        return None
    digest = hashlib.sha256()
    for name in sorted(n for n in listed.stdout.split(b"\0") if n):
        path = root / name.decode()
        digest.update(name + b"\0" + (path.read_bytes() if path.exists() else b"(deleted)") + b"\0")
    return digest.hexdigest()


def stamped_digest(root: Path = ROOT) -> str | None:
    stamp = root / THOROUGH_STAMP
    words = stamp.read_text().split() if stamp.exists() else []
    return words[0] if words else None


def record_thorough_verdict(verified: str | None, seconds: float, root: Path = ROOT) -> bool:
    """After an exact `verify --thorough` of every stage: records `verified`, the watched files'
    digest when it began, if they still have it (not if they were edited while it ran)."""
    if verified is None or watched_digest(root) != verified:
        return False
    (root / THOROUGH_STAMP).parent.mkdir(exist_ok=True)
    (root / THOROUGH_STAMP).write_text(
        f"{verified}  verify --thorough exact on {datetime.date.today()}, {seconds:.0f} s\n")
    return True


def profile(base: str, root: Path = ROOT) -> tuple[str, str]:
    """("thorough" | "ci", why)."""
    digest = watched_digest(root)
    if digest is None:
        return "thorough", "not a git checkout: nothing to compare with"
    reasons = []
    if stamped_digest(root) != digest:
        reasons.append(f"the watched files differ from the last thorough verdict's "
                       f"({THOROUGH_STAMP})")
    known = _git(root, "rev-parse", "-q", "--verify", f"{base}^{{commit}}").returncode == 0
    if known and _git(root, "diff", "--quiet", base, "HEAD", "--", *WATCHED).returncode != 0:
        reasons.append(f"the watched files changed since {base}")
    if reasons:
        return "thorough", "; ".join(reasons)
    return "ci", f"the watched files unchanged since {base} and since the last thorough verdict"


def thorough_examples(seconds_left: float, ci_seconds: float, safety: float = 1.5) -> int:
    """The thorough profile's examples per property that fit in `seconds_left`, scaled from a
    ci-profile verify of `ci_seconds` (its 60 examples; its fixed costs count as if they scaled
    too, and `safety` more): at most the full profile's. 0 where not even twice the ci
    profile's examples fit: no run there would be more thorough than the ci verdict."""
    from .profiles import CI_EXAMPLES, THOROUGH_EXAMPLES

    fit = int(CI_EXAMPLES * seconds_left / (max(ci_seconds, 1.0) * safety))
    return min(fit, THOROUGH_EXAMPLES) if fit >= 2 * CI_EXAMPLES else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactness gate", description=__doc__)
    parser.add_argument("--base", default=os.environ.get("EXACTNESS_BASE", "HEAD~1"),
                        help="the commit to compare with (default $EXACTNESS_BASE or HEAD~1)")
    parser.add_argument("--examples-for", type=float, metavar="SECONDS",
                        help="print the thorough examples per property that fit in SECONDS "
                             "(with --ci-seconds); exit 1 where too few fit")
    parser.add_argument("--ci-seconds", type=float, help="the ci-profile verify's seconds")
    args = parser.parse_args(argv)
    if args.examples_for is not None:
        if args.ci_seconds is None:
            parser.error("--examples-for needs --ci-seconds")
        examples = thorough_examples(args.examples_for, args.ci_seconds)
        if not examples:
            print(f"CI gate: {args.examples_for:.0f} s left hold no thorough run (a ci verify "
                  f"took {args.ci_seconds:.0f} s): verify --thorough on a faster machine and "
                  f"commit {THOROUGH_STAMP}", file=sys.stderr)
            return 1
        print(f"CI gate: {examples} examples per property fit in {args.examples_for:.0f} s",
              file=sys.stderr)
        print(examples)
        return 0
    chosen, why = profile(args.base)
    print(f"CI gate: verify in the {chosen} profile: {why}", file=sys.stderr)
    print(chosen)
    return 0
