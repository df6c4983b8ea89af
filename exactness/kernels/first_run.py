"""A compiled C kernel's first run happens in a child process, never in the caller's.

A library compiled for instructions the CPU only claims to have (or one with a bug) can kill the
process that runs it: an illegal instruction (SIGILL), a wild pointer (SIGSEGV, SIGBUS), a
division by zero (SIGFPE), or a hang. So a fresh build's self-check runs in a child Python
process (`main`, below). The parent loads the library only to bind its
entry points, and never calls it before the child's verdict. A child that dies, or gives no
verdict within EXACTNESS_FIRST_RUN_SECONDS (default 120), refuses the library, naming the signal
and the build. The caller then runs its exact slower path.

Each child is forked from one fork server a process starts at its first first run
(fork_server.py: a Python that imported torch once, 2 s a run saved). Where that server cannot
start or fails, the child is a fresh Python, as before, and the process says why once.

A verdict is cached beside the library in the kernels' private cache. It is keyed by the
library's digest, the CPU's flags and the checking code (every module of the check's package,
and torch's version), so the child runs once per build and machine, not once per process, and
again after any change to what judges it. A timeout is not cached: a loaded
machine may pass next time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from .registry import Fit, no

SECONDS = "EXACTNESS_FIRST_RUN_SECONDS"
MARK = "exactness-first-run-verdict: "  # the line the child prints its verdict on
CHILD = "import sys; from exactness.kernels.first_run import main; sys.exit(main(sys.argv[1:]))"
SIGNALS = {signal.SIGILL: "an illegal instruction", signal.SIGSEGV: "a bad memory access",
           signal.SIGBUS: "a bad memory access", signal.SIGFPE: "an arithmetic fault",
           signal.SIGABRT: "an abort", signal.SIGKILL: "killed"}


@dataclass(frozen=True)
class FirstRun:
    verdict: Fit  # the check's verdict in the child, or why the child gave none
    died: bool  # the child died or hung: the library must not run in this process


def seconds() -> float:
    """EXACTNESS_FIRST_RUN_SECONDS: how long a child may take (a positive number, default 120)."""
    from ..contract import ContractValueError

    value = os.environ.get(SECONDS, "120")
    try:
        limit = float(value)
    except ValueError:
        limit = 0.0
    if not limit > 0:
        raise ContractValueError(f"{SECONDS} must be a positive number of seconds, got {value!r}")
    return limit


def run(file: Path, digest: str, check: str, build: str, machine: str) -> FirstRun:
    """The library at `file` (its sha256 `digest`) run first in a child process: `check` is
    "module:function", called there as function(file, digest) -> Fit. `build` names the build in
    a refusal; `machine` (the CPU's flags) keys the cached verdict. Never raises for anything the
    child does."""
    cached = file.with_name(f"{file.name}.{_key(digest, check, machine)}.verdict")
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(cached.read_text())
        return FirstRun(Fit(bool(saved["ok"]), str(saved["why"])), bool(saved["died"]))
    outcome, final = _child(file, digest, check, build)
    if final:
        _save(cached, outcome)
    return outcome


def _key(digest: str, check: str, machine: str) -> str:
    """What a verdict depends on: the library's bytes, the CPU, and the code that checks it."""
    return hashlib.sha256("\0".join((digest, check, machine, _code(check))).encode()
                          ).hexdigest()[:16]


@functools.cache
def _code(check: str) -> str:
    """The checking code: every Python file of the check's top-level package (exactness, for the
    kernels' checks), not its wing's alone, since a check leans on the contract, the formats and
    the quantization it compares with; and torch's version, whose operations it calls. Read once
    a process, not once a build."""
    spec = importlib.util.find_spec(check.partition(".")[0].partition(":")[0])
    files = {Path(__file__)}
    for folder in spec.submodule_search_locations or ():  # (a package; else its one file)
        files.update(Path(folder).rglob("*.py"))
    files.add(Path(spec.origin))
    torch = sys.modules.get("torch")
    return "".join(f"{path.name}\0{path.read_text()}\0" for path in sorted(files)) + \
        str(getattr(torch, "__version__", None))


def _child(file: Path, digest: str, check: str, build: str) -> tuple[FirstRun, bool]:
    """(the outcome, whether it is final): the child's verdict, or why it gave none."""
    if not sys.executable:
        return FirstRun(no("no Python interpreter to run its first run in a child process "
                           "(sys.executable is empty)"), True), False
    root = str(Path(__file__).resolve().parents[2])  # the child imports this very package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    limit = seconds()
    try:
        child = _SERVER.run([check, str(file), digest], env, limit) or subprocess.run(
            [sys.executable, "-c", CHILD, check, str(file), digest],
            capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return FirstRun(no(f"its first run, in a child process, did not end within {limit:g} s "
                           f"({build}, {file.name}; {SECONDS} sets the limit)"), True), False
    except OSError as e:
        return FirstRun(no(f"its first run could not start a child process: {e}"), True), False
    if child.returncode < 0:
        sig = signal.Signals(-child.returncode)
        what = SIGNALS.get(sig, "a signal")
        return FirstRun(no(f"its first run, in a child process, died of {sig.name} ({what}): "
                           f"{build}, {file.name}"), True), True
    for line in reversed(child.stdout.splitlines()):
        if line.startswith(MARK):
            saved = json.loads(line[len(MARK):])
            return FirstRun(Fit(bool(saved["ok"]), str(saved["why"])), False), True
    tail = (child.stderr.strip().splitlines() or ["no output"])[-1][-300:]
    return FirstRun(no(f"its first run's child process exited with status {child.returncode} "
                       f"and no verdict ({build}): {tail}"), True), False


class _ForkServer:
    """This process's fork server (fork_server.py), started at the first first run. run() gives
    the child's outcome as subprocess.run would, or None where the server failed: then every
    later child is a fresh Python, and a RuntimeWarning says why, once."""

    START_SECONDS = 120.0  # a reply's wait beyond the run's own limit: the server's start-up

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.owner = os.getpid()  # a forked copy of this process must not share its pipes
        self.failed: str | None = None if hasattr(os, "fork") else "os.fork is missing here"
        self.lock = threading.Lock()  # one run at a time on the server's pipes

    def run(self, argv: list[str], env: dict, limit: float) -> subprocess.CompletedProcess | None:
        with self.lock:
            if self.failed is not None:
                return None
            try:
                reply = self._ask({"argv": argv, "env": env, "cwd": os.getcwd(),
                                   "seconds": limit})
            except (OSError, ValueError, KeyError, TypeError) as e:
                self._fail(f"{type(e).__name__}: {e}")
                return None
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(argv, limit)
        return subprocess.CompletedProcess(argv, int(reply["returncode"]), str(reply["stdout"]),
                                           str(reply["stderr"]))

    def _ask(self, request: dict) -> dict:
        if self.owner != os.getpid():  # this is a fork: the server answers the parent
            self.process, self.owner = None, os.getpid()
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-P", str(Path(__file__).with_name("fork_server.py"))],
                env=request["env"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True)
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        wait = request["seconds"] + self.START_SECONDS
        line = _read_line(self.process.stdout, wait)
        if not line:
            raise OSError(f"the server gave no reply within {wait:g} s (exit status "
                          f"{self.process.poll()})")
        return json.loads(line)

    def _fail(self, why: str) -> None:
        self.failed = why
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        warnings.warn(f"first runs start a fresh Python each (2 s slower): their fork server "
                      f"failed ({why})", RuntimeWarning, stacklevel=4)


def _read_line(stream, seconds: float) -> str:
    """A line of the server's reply, or "" where none came within `seconds` (or it closed)."""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        if not selector.select(seconds):
            return ""
    return stream.readline()


_SERVER = _ForkServer()


def _save(cached: Path, outcome: FirstRun) -> None:
    """The verdict written whole or not at all (a rename), in the library's private cache."""
    with contextlib.suppress(OSError):
        fd, temporary = tempfile.mkstemp(dir=cached.parent, suffix=".verdict-tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"ok": outcome.verdict.ok, "why": outcome.verdict.why,
                       "died": outcome.died}, f)
        os.replace(temporary, cached)


def main(argv: list[str]) -> int:
    """The child: the check's verdict on the library, on one line of stdout."""
    check, file, digest = argv
    module, _, function = check.partition(":")
    verdict = getattr(importlib.import_module(module), function)(Path(file), digest)
    print(MARK + json.dumps({"ok": verdict.ok, "why": verdict.why}), flush=True)
    return 0

