"""The suite's pytest set-up: the Hypothesis profile (exactness.suite.gate.profiles), the device the
Triton kernels run on (EXACTNESS_DEVICE: exactness.suite.device), the C kernel emulated where the
CPU lacks AVX-512 VNNI, and a planted mutant where EXACTNESS_MUTANT names one."""

import functools
import os
import re
import sys

import pytest

# tests/vllm/ runs in vLLM's venv, with its own pytest set-up (make test-vllm), not here
collect_ignore = ["tests/vllm"]

# OpenMP's threads sleep when idle, not spin (set before torch loads libgomp; inherited by the
# xdist workers and every child). Two workers on two cores each run the C kernels and torch on
# two threads: spinning, a worker's idle threads took the core the other worker's kernel was
# waiting for, and the C kernels' tests ran 2x slower. The threads and their work are the same.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
if "torch" in sys.modules:  # too late to take effect: say so rather than run 2x slower unseen
    import warnings

    warnings.warn("torch was imported before conftest.py: OMP_WAIT_POLICY=passive not applied",
                  stacklevel=1)

# One device for the whole suite: EXACTNESS_DEVICE (exactness.suite.device); where it is unset
# and there is no GPU, the interpreter (set before triton is first imported: it is read then).
if "TRITON_INTERPRET" not in os.environ and "EXACTNESS_DEVICE" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from exactness.suite import device as _device  # noqa: E402

_device.require()
from exactness.suite import paths  # noqa: E402
from exactness.suite.gate import profiles  # noqa: E402

profiles.load()
# where the CPU lacks AVX-512 VNNI, the C kernel's checks run on its emulated build, never skip
paths.emulate_the_c_kernel_where_missing()


def pytest_configure(config):
    """EXACTNESS_MUTANT=name plants that catalogue mutant into the whole run."""
    from exactness.suite.mutants import applied, from_env

    mutant = from_env()
    if mutant is not None:
        config._exactness_mutant = applied(mutant)
        config._exactness_mutant.__enter__()


def pytest_addoption(parser):
    parser.addoption("--stage", action="append", default=[],
                     help="run only the test modules of this make verify stage (repeatable)")
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only shard I of N: every N-th test, by node id (make verify's "
                          "--shard, for a CI matrix)")


def shard_of(nodeids: list[str], shard: str) -> set[str]:
    """The node ids of shard "I/N": the I-th of every N in node-id order (every test in exactly
    one shard, each shard about 1/N of them)."""
    i, n = (int(v) for v in shard.split("/"))
    if not 1 <= i <= n:
        raise ValueError(f"--shard must be I/N with 1 <= I <= N, got {shard!r}")
    return {node for k, node in enumerate(sorted(nodeids)) if k % n == i - 1}


def stage_of(item) -> str | None:
    marker = item.get_closest_marker("stage")
    return marker.args[0] if marker else None


_STAGE_MARK = re.compile(r"""mark\.stage\(\s*["']([\w-]+)["']""")


@functools.cache
def stages_named_in(path) -> frozenset[str]:
    """The stages a test module's text names in a stage mark, read without importing it."""
    return frozenset(_STAGE_MARK.findall(path.read_text()))


def pytest_ignore_collect(collection_path, config):
    """--stage: a test module that names none of the chosen stages is not imported, since every
    test in it would be deselected (an import is seconds: transformers, compressed-tensors, in
    each worker). A full collection checks that the text names every stage a test carries."""
    chosen = config.getoption("stage")
    if chosen and collection_path.is_file() and collection_path.suffix == ".py" and \
            collection_path.name.startswith("test_") and \
            not stages_named_in(collection_path) & set(chosen):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """--stage keeps the chosen stages' tests, --shard one shard of them; every test records its
    stage for the JUnit XML make verify reads (a user property)."""
    chosen, shard = config.getoption("stage"), config.getoption("shard")
    if not chosen:
        unread = sorted({f"{item.path.name}: {stage_of(item)}" for item in items if stage_of(item)
                         and stage_of(item) not in stages_named_in(item.path)})
        if unread:  # --stage would skip these modules' tests unseen (pytest_ignore_collect)
            raise pytest.UsageError(f"a stage mark --stage cannot read in the module's text "
                                    f"(write it as pytest.mark.stage(\"name\")): {unread}")
    if chosen or shard:
        kept = [item for item in items if not chosen or stage_of(item) in chosen]
        if shard:
            mine = shard_of([item.nodeid for item in kept], shard)
            kept = [item for item in kept if item.nodeid in mine]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    for item in items:
        if stage_of(item):
            item.user_properties.append(("stage", stage_of(item)))


def pytest_runtest_setup(item):
    """The running test's stage, for the outputs-compared tally (counterexamples._count); in a
    repeating profile, the global generators seeded from its node id (profiles.seed_of_test)."""
    os.environ["EXACTNESS_STAGE"] = stage_of(item) or "-"
    seed = profiles.seed_of_test(item.nodeid)
    if seed is not None:
        import random

        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
