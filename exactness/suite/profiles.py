"""Hypothesis profiles; HYPOTHESIS_PROFILE selects one (default: dev).

- ci: derandomized (the same examples on every run), no deadline, no example database, prints
  the reproduction blob of a failure; no explain phase (it traces every line the Triton
  interpreter runs while a failure shrinks: the kernel mutants' kills took 6x as long);
- dev: random, with the local database, so a failure found once is replayed first next time;
- thorough: nightly scale;
- ci-kill: ci without shrinking (make verify's mutation stage).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

_SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]

settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True,
                          max_examples=60, suppress_health_check=_SLOW_DATA,
                          phases=[p for p in Phase if p != Phase.explain])
# make verify's mutation stage only needs to see each mutant die: no shrinking
settings.register_profile("ci-kill", parent=settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
settings.register_profile("dev", deadline=None, max_examples=100, suppress_health_check=_SLOW_DATA)
settings.register_profile("thorough", deadline=None, max_examples=2000, print_blob=True,
                          suppress_health_check=_SLOW_DATA)


def load() -> None:
    """The profile HYPOTHESIS_PROFILE names (default: dev)."""
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
