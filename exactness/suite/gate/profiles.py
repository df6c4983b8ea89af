"""Hypothesis profiles; HYPOTHESIS_PROFILE selects one (default: dev).

- ci: derandomized (the same examples on every run), no deadline, no example database, prints
  the reproduction blob of a failure; no explain phase (it traces every line the Triton
  interpreter runs while a failure shrinks: the kernel mutants' kills took 6x as long);
- dev: random, with the example database, so a failure found once is replayed first next time;
- thorough: nightly scale (THOROUGH_EXAMPLES per property, or EXACTNESS_THOROUGH_EXAMPLES where
  CI's time holds fewer: gate.thorough_examples), with the example database;
- ci-kill: ci without shrinking (make verify's mutation stage);
- smoke: ci at SMOKE_EXAMPLES a property (bench/gpu_check.sh's own test in make test).

The example database (`example_database`) is a directory, EXACTNESS_HYPOTHESIS_DB (default
.hypothesis/examples), which CI keeps between runs and uploads as an artifact. With
EXACTNESS_HYPOTHESIS_GITHUB="OWNER/REPO:ARTIFACT[,ARTIFACT...]" the dev and thorough profiles
also read those artifacts of the repository's CI runs (Hypothesis's GitHubArtifactDatabase), so
a failure found in CI replays here first. The counterexample files stay the format of record.
"""

from __future__ import annotations

import os
import zlib

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    GitHubArtifactDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

_SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
CI_EXAMPLES, THOROUGH_EXAMPLES, SMOKE_EXAMPLES = 60, 2000, 3


def thorough_examples() -> int:
    """The thorough profile's examples per property: EXACTNESS_THOROUGH_EXAMPLES (a positive
    integer, at most THOROUGH_EXAMPLES) where set."""
    text = os.environ.get("EXACTNESS_THOROUGH_EXAMPLES", str(THOROUGH_EXAMPLES))
    if not text.isdigit() or not 1 <= int(text) <= THOROUGH_EXAMPLES:
        raise ValueError(f"EXACTNESS_THOROUGH_EXAMPLES must be an integer in 1 .. "
                         f"{THOROUGH_EXAMPLES}, got {text!r}")
    return int(text)


def example_database() -> ExampleDatabase:
    """The local directory database, and CI's artifacts read-only where named (module doc)."""
    local = DirectoryBasedExampleDatabase(os.environ.get("EXACTNESS_HYPOTHESIS_DB",
                                                         ".hypothesis/examples"))
    shared = os.environ.get("EXACTNESS_HYPOTHESIS_GITHUB")
    if not shared:
        return local
    repository, _, artifacts = shared.partition(":")
    owner, _, repo = repository.partition("/")
    if not owner or not repo:
        raise ValueError(f"EXACTNESS_HYPOTHESIS_GITHUB must be OWNER/REPO[:ARTIFACT,...], got "
                         f"{shared!r}")
    names = artifacts.split(",") if artifacts else ["hypothesis-example-db"]
    return MultiplexedDatabase(local, *(ReadOnlyDatabase(GitHubArtifactDatabase(
        owner, repo, artifact_name=name)) for name in names))


settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True,
                          max_examples=CI_EXAMPLES, suppress_health_check=_SLOW_DATA,
                          phases=[p for p in Phase if p != Phase.explain])
# make verify's mutation stage only needs to see each mutant die: no shrinking
settings.register_profile("ci-kill", parent=settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
# bench/gpu_check.sh's own test: a few examples a property, to run the script end to end quickly
settings.register_profile("smoke", parent=settings.get_profile("ci"), max_examples=SMOKE_EXAMPLES)
settings.register_profile("dev", deadline=None, max_examples=100, suppress_health_check=_SLOW_DATA,
                          database=example_database())
settings.register_profile("thorough", deadline=None, max_examples=thorough_examples(),
                          print_blob=True, suppress_health_check=_SLOW_DATA,
                          database=example_database())


# the profiles whose runs repeat: each test's generators are seeded from its node id too
SEEDED = frozenset({"ci", "ci-kill", "smoke"})


def chosen() -> str:
    """The profile HYPOTHESIS_PROFILE names (default: dev)."""
    return os.environ.get("HYPOTHESIS_PROFILE", "dev")


def load() -> None:
    """The chosen profile, loaded."""
    settings.load_profile(chosen())


def seed_of_test(nodeid: str) -> int | None:
    """The seed of Python's, numpy's and torch's global generators for the test `nodeid` in a
    SEEDED profile (None in the others, whose data differs run to run). Hypothesis repeats its
    own draws there; a test's own torch.randn then repeats too, whatever ran before it in its
    worker, so a failure replays by its node id, and a warm run's interpreted launches are the
    last run's (the launch store recalls them)."""
    if chosen() not in SEEDED:
        return None
    return zlib.crc32(nodeid.encode())
