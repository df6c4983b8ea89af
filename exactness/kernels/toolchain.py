"""The C toolchain of the CPU kernels, which knows no kernel: the CPU's flags, the environment
switches, a cache of this user alone, one compile at a time, and a library loaded only from the
bytes it was built as, with the entry points' signatures its kernel module passes. A library's
first run, its self-check in a child process, is first_run.py's.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

from ..contract import ContractValueError
from .registry import Fit, no, yes


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags, its first `flags` line in /proc/cpuinfo, read once (None:
    unreadable)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    flags = next((line.partition(":")[2] for line in lines if line.startswith("flags")), "")
    return frozenset(flags.split())


def machine() -> str:
    """The CPU's flags, sorted: what a first run's cached verdict holds for (first_run.run)."""
    return " ".join(sorted(cpu_flags() or ()))


def cpu_lacks(needs) -> list[str]:
    """The features of `needs` the CPU does not list (the C kernels' and the AMX kernel's)."""
    flags = cpu_flags()
    if flags is None:
        return ["/proc/cpuinfo (unreadable)"]
    return [f for f in needs if f not in flags]


def switch(variable: str, modes: dict) -> str:
    """The environment `variable`'s mode, one of `modes` ("1" where unset); ContractValueError
    for anything else (EXACTNESS_NATIVE's and EXACTNESS_AMX's)."""
    value = os.environ.get(variable, "1")
    if value not in modes:
        raise ContractValueError(f"{variable} must be one of {', '.join(modes)}, got {value!r}")
    return value


def build(source: str, flags: list[str], name: str,
          signatures: dict) -> tuple[ctypes.CDLL | None, Fit]:
    """`source` (the file `name`) compiled with the system compiler and `flags` (cached by both),
    and loaded with `signatures` set, or None and why not. Never raises: every refusal says why
    in the Fit.

    The cache promises: a directory of this user alone (cache_dir), temporary files of
    unpredictable names, one compile at a time (_locked), and a library loaded only when its
    bytes match the digest recorded when it was built (_verified); a cached library that fails
    the digest or does not load is rebuilt once, then refused."""
    key = cache_key(source, flags)
    cache, why = cache_dir()
    if cache is None:
        return None, why
    so = cache / f"{Path(name).stem}-{key}.so"
    try:
        with _locked(so.with_suffix(".lock")):
            data = _verified(so)
            lib = None
            if data is not None:
                lib, why = load_bytes(data, cache, signatures)
            if lib is None:  # none cached, a mismatch, or it does not load
                data, why = compile_library(source, so, flags, name)
                lib, why = (load_bytes(data, cache, signatures) if data is not None
                            else (None, why))
    except OSError as e:  # the lock file or the private copy: the cache cannot be written
        return None, no(f"no writable cache ({cache}): {e}")
    if lib is not None:  # what first_run's child loads: this file, these bytes
        lib.exactness_file, lib.exactness_digest = so, hashlib.sha256(data).hexdigest()
    return lib, why


def compiler() -> str:
    """The C compiler: $CC, else cc."""
    return os.environ.get("CC", "cc")


@functools.cache
def compiler_identity(cc: str) -> str:
    """Which compiler `cc` is: its path and the first line of `cc --version` (another GCC at the
    same name builds other bytes). Asked once a process per name; "" where it does not answer
    (the build then fails and says so)."""
    path = shutil.which(cc) or cc
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{os.path.realpath(path)} {done.stdout.partition(chr(10))[0]}"


def cache_key(source: str, flags: list[str]) -> str:
    """The cached library's name: the hash of what was compiled (the source, every project
    header inlined: vnni_library, amx_library), and how: the compiler (its name, path and
    version) and every flag (SIMDe's version among them where emulated). The register of the
    caches: docs/VERIFY.md."""
    cc = compiler()
    how = "\0".join([cc, compiler_identity(cc), *flags])
    return hashlib.sha256((source + "\0" + how).encode()).hexdigest()[:16]


def cache_dir() -> tuple[Path | None, Fit]:
    """The compiled kernels' directory, $XDG_CACHE_HOME/exactness (or ~/.cache/exactness),
    created 0700; refused if another user owns it or group or others may write to it (they could
    plant a library there that this process would run)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "exactness"
    try:
        cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        cache.mkdir(mode=0o700, exist_ok=True)
        st = cache.stat()
    except OSError as e:
        return None, no(f"no writable cache ({cache}): {e}")
    if st.st_uid != os.getuid():
        return None, no(f"an unsafe cache: {cache} is owned by uid {st.st_uid}, not this user "
                        f"(uid {os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None, no(f"an unsafe cache: {cache} is writable by group or others (mode "
                        f"{stat.S_IMODE(st.st_mode):o}; chmod 700 it)")
    return cache, yes("a private cache")


_BUILDING = threading.Lock()  # flock orders processes; this, the threads of one (and _LOADED)


@contextlib.contextmanager
def _locked(path: Path):
    """One build of a library at a time: a lock within the process, a file lock (`path`, beside
    the library, never followed if a link) across processes."""
    with _BUILDING:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and the file lock with it


def _digest_of(so: Path) -> Path:
    return so.with_name(so.name + ".sha256")


def _verified(so: Path) -> bytes | None:
    """The cached library's bytes if they match the digest recorded when it was built; None if
    there is none, or no digest, or they differ (a killed compile, a full disk, a foreign file)."""
    try:
        data, want = so.read_bytes(), _digest_of(so).read_text().strip()
    except OSError:
        return None
    return data if hashlib.sha256(data).hexdigest() == want else None


def compile_library(source: str, so: Path, flags: list[str],
                    name: str) -> tuple[bytes | None, Fit]:
    """`source` compiled in a fresh private directory (mkdtemp: no name to plant a link at), then
    renamed to `so` and its digest beside it (renames are atomic; a crash between them leaves a
    mismatch, so a rebuild); the library's bytes, or None and why."""
    cc = compiler()
    try:
        with tempfile.TemporaryDirectory(dir=so.parent) as work:
            src, out, digest = (Path(work, part) for part in (name, "lib.so", "sha256"))
            src.write_text(source)
            subprocess.run([cc, *flags, str(src), "-o", str(out)],
                           check=True, capture_output=True, timeout=120)
            data = out.read_bytes()
            digest.write_text(hashlib.sha256(data).hexdigest())
            os.replace(out, so)
            os.replace(digest, _digest_of(so))
    except subprocess.CalledProcessError as e:
        return None, no(f"{cc} failed on {name}: "
                        f"{e.stderr.decode(errors='replace').strip()[-300:]}")
    except (OSError, subprocess.SubprocessError) as e:
        return None, no(f"no C compiler or no writable cache ({cc}, {so.parent}): {e}")
    return data, yes("compiled")


_LOADED: dict[str, ctypes.CDLL] = {}  # by the sha256 of the bytes: each library loaded once


def load_bytes(data: bytes, cache: Path, signatures: dict) -> tuple[ctypes.CDLL | None, Fit]:
    """The verified bytes `data` loaded, with the entry points' `signatures` set ({name:
    (argument types, result type)}); None and why if they do not load. They load from a private
    copy (mkstemp in the cache), so the file loaded is the bytes checked, not whatever is at the
    cache's name by then; the copy is removed once loaded (the mapping keeps it)."""
    digest = hashlib.sha256(data).hexdigest()
    if digest in _LOADED:
        return _LOADED[digest], yes("compiled")
    fd, copy = tempfile.mkstemp(suffix=".so", dir=cache)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        lib = ctypes.CDLL(copy)
    except OSError as e:
        return None, no(f"the compiled library does not load: {e}")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(copy)
    try:
        for name, (argtypes, restype) in signatures.items():
            getattr(lib, name).restype = restype
            getattr(lib, name).argtypes = argtypes
    except AttributeError as e:
        return None, no(f"the compiled library lacks an entry point: {e}")
    _LOADED[digest] = lib
    return lib, yes("compiled")


def load_file(file: Path, digest: str, signatures: dict) -> tuple[ctypes.CDLL | None, Fit]:
    """The compiled library at `file`, loaded if its bytes match `digest` (a child's view of a
    build; build() binds it the same way)."""
    try:
        data = file.read_bytes()
    except OSError as e:
        return None, no(f"the compiled library cannot be read: {e}")
    if hashlib.sha256(data).hexdigest() != digest:
        return None, no(f"{file.name} changed after its build (its digest differs)")
    return load_bytes(data, file.parent, signatures)
