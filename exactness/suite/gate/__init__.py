"""`make verify` and the CI gate.

- `verify`: every stage, one verdict table, exit 0 only when everything is exact;
- `ci`: which Hypothesis profile `.ci/run` verifies in, and the thorough verdict's stamp;
- `profiles`: the Hypothesis profiles (smoke, ci, thorough) and their example database;
- `repro`: counterexample files replayed on every path, or on a named kernel.
"""

from .profiles import load as load_profiles
from .repro import replay

__all__ = ["load_profiles", "replay"]
