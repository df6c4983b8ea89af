"""The compiled C kernel's cache (Build.build): a private directory of this user,
unpredictable temporary files, one compile at a time, a digest checked before a cached library
loads, and a corrupt library rebuilt or refused, never raised. Each test builds in its own tmp
cache."""

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import threading

import pytest

from exactness.kernels import toolchain
from exactness.kernels.cpu import vnni_library

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

BUILD = vnni_library.AVX2  # a build as any other: the cache knows no kernel
ENTRY_POINTS = tuple(BUILD.signatures)
# builds and loads in a fraction of a second (build only binds the entry points, never calls them)
STUB = "".join(f"void {name}(void) {{}}\n" for name in ENTRY_POINTS)
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache under tmp_path (the directory build creates), and the system compiler."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CC", raising=False)
    return tmp_path / "xdg" / "exactness"


def cached_name(cache, source: str):
    """Where build keeps `source`'s library: named by the hash of the source and the flags."""
    compiled, flags, _ = BUILD.as_compiled(source)
    return cache / f"cpu_kernel_{BUILD.name}-{toolchain.cache_key(compiled, flags)}.so"


def compile_to(path, source: str) -> None:
    c = path.with_name(path.name + ".c")
    c.write_text(source)
    subprocess.run(["cc", *BUILD.flags, str(c), "-o", str(path)], check=True, timeout=120)
    c.unlink()


def test_the_cache_is_a_private_directory_of_this_user(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))  # the directory is what counts
    BUILD.build(STUB)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700  # created 0700
    cache.chmod(0o777)
    lib, why = BUILD.build(STUB)
    assert lib is None and "writable by group or others" in why.why, why
    cache.chmod(0o700)
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # as if another user owned it
    lib, why = BUILD.build(STUB)
    assert lib is None and f"owned by uid {uid}" in why.why, why


@needs_cc
def test_no_file_is_written_through_a_planted_symlink(cache, monkeypatch, tmp_path):
    """Links planted at every name the cache uses (the old per-process temporary names, the
    library, its digest, its lock) point at a file outside it: the file stays as it was."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    so = cached_name(cache, STUB)
    cache.mkdir(parents=True, mode=0o700)
    for planted in (so.with_suffix(f".{os.getpid()}.c"), so.with_suffix(f".{os.getpid()}.tmp")):
        planted.symlink_to(victim)
    BUILD.build(STUB)  # no library there yet: a compile
    assert victim.read_text() == "precious"
    for planted in (so, so.with_name(so.name + ".sha256"), so.with_suffix(".lock")):
        planted.unlink(missing_ok=True)
        planted.symlink_to(victim)
    BUILD.build(STUB)  # a rebuild, or a refusal: either way not through the links
    assert victim.read_text() == "precious"


@needs_cc
def test_concurrent_first_builds_all_get_the_library(cache):
    """Threads that build at once on an empty cache (status() is functools.cache'd, so its
    concurrent first calls all build): every thread gets the loaded library, none an error."""
    for round_ in range(3):  # each round a source of its own: an empty cache entry
        source = STUB + f"int round_{round_};\n"
        start, results = threading.Barrier(8), []

        def build(source=source, start=start, results=results):
            start.wait()
            try:
                results.append(BUILD.build(source))
            except Exception as e:  # noqa: BLE001 - the failure under test
                results.append((None, e))

        threads = [threading.Thread(target=build) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [why for lib, why in results if lib is None] == []
        assert all(why == vnni_library.yes("compiled") for _, why in results)
        assert len({id(lib) for lib, _ in results}) == 1  # one library, loaded once


@needs_cc
def test_a_planted_library_is_not_loaded(cache, tmp_path):
    """A library at the cache's name that this build did not record is rebuilt, not loaded: its
    code (a constructor that leaves a marker) never runs."""
    marker = tmp_path / "planted-code-ran"
    planted = (f'#include <stdio.h>\n{STUB}__attribute__((constructor)) static void ran(void) '
               f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    so = cached_name(cache, STUB)
    digest = so.with_name(so.name + ".sha256")
    cache.mkdir(parents=True, mode=0o700)
    compile_to(so, planted)  # no digest beside it
    lib, why = BUILD.build(STUB)
    assert not marker.exists()
    assert lib is not None and why.ok, why
    genuine = so.read_bytes()
    assert digest.read_text().strip() == hashlib.sha256(genuine).hexdigest()
    compile_to(so, planted)  # a stale digest beside it: the genuine library's
    lib, why = BUILD.build(STUB)
    assert not marker.exists()
    assert lib is not None and why.ok and so.read_bytes() != b"", why


@needs_cc
def test_a_corrupt_cached_library_is_rebuilt_or_refused_never_raised(cache, monkeypatch):
    source = STUB + "int corrupt_cache_test;\n"  # bytes of its own: never loaded before
    so = cached_name(cache, source)
    cache.mkdir(parents=True, mode=0o700)
    so.write_bytes(b"")  # an empty library, as a full disk or a killed compile leaves one
    lib, why = BUILD.build(source)
    assert lib is not None and why.ok, why
    assert so.stat().st_size > 0
    so.write_bytes(b"")  # and with its own digest beside it: verified, but does not load
    so.with_name(so.name + ".sha256").write_text(hashlib.sha256(b"").hexdigest())
    lib, why = BUILD.build(source)
    assert lib is not None and why.ok, why

    def no_load(*args, **kwargs):
        raise OSError("cannot load it")

    source = STUB + "int corrupt_cache_test_2;\n"
    monkeypatch.setattr(ctypes, "CDLL", no_load)  # a library that never loads, rebuilt or not
    lib, why = BUILD.build(source)
    assert lib is None and "does not load" in why.why and "cannot load it" in why.why, why


@needs_cc
def test_a_library_without_the_entry_points_is_refused_not_raised(cache):
    lib, why = BUILD.build("int x;")
    assert lib is None and "lacks an entry point" in why.why and "row_exponents" in why.why, why
