"""`make mutmut`'s report: the mutation score mutmut's run reached, and every survivor, checked
against the committed triage (docs/mutmut_triage.csv, each row answered by an argument of
docs/MUTMUT.md): a survivor the triage does not answer, by a test that now kills it or an
argument that it is equivalent, fails the command.

    python -m exactness.suite.mutants.mutmut_score   (after `mutmut run`)
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TRIAGE = ROOT / "docs" / "mutmut_triage.csv"  # mutant, change, verdict
ARGUMENTS = ROOT / "docs" / "MUTMUT.md"  # a verdict is one of its "- **name**" arguments
REPORT = ROOT / "reports" / "mutmut.txt"
RESULT = re.compile(r"^\s+(\S+): (\S.*)$")


def results() -> dict[str, str]:
    """mutant -> status, as `mutmut results --all true` lists them."""
    done = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    return {m[1]: m[2] for m in map(RESULT.match, done.stdout.splitlines()) if m}


def triage() -> list[dict[str, str]]:
    """The triage's rows: mutant, change, verdict."""
    if not TRIAGE.exists():
        return []
    with TRIAGE.open(newline="") as f:
        return list(csv.DictReader(f))


def arguments() -> set[str]:
    """The names of MUTMUT.md's arguments of equivalence (its "- **name**" bullets)."""
    return set(re.findall(r"^- \*\*(.+?)\*\*", ARGUMENTS.read_text(), re.MULTILINE))


def triaged() -> set[str]:
    """The mutants the triage answers."""
    return {row["mutant"] for row in triage()}


def unanswered(rows: list[dict[str, str]], names: set[str]) -> list[str]:
    """The triage's rows whose verdict names no argument of MUTMUT.md."""
    return [f"{row['mutant']}: {row['verdict']!r}" for row in rows if row["verdict"] not in names]


def main(argv: list[str] | None = None) -> int:
    status = results()
    counts = Counter(status.values())
    tested = sum(n for s, n in counts.items() if s not in ("not checked", "skipped"))
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    survivors = sorted(m for m, s in status.items() if s == "survived")
    open_ = [m for m in survivors if m not in triaged()]
    open_ += unanswered(triage(), arguments())
    lines = [f"mutmut: {len(status)} mutants, {tested} tested, {killed} killed or timed out "
             f"({100 * killed / max(tested, 1):.1f}%): {dict(counts)}",
             f"survivors: {len(survivors)}; not in {TRIAGE.name}, or answered by no argument of "
             f"{ARGUMENTS.name}: {len(open_)}",
             *(f"  {m}" for m in open_)]
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if open_ else 0


if __name__ == "__main__":
    sys.exit(main())
