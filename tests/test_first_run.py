"""No native kernel can kill the process (issue 39): a compiled C kernel's first run happens in a
child process (kernels/first_run.py). Planted kernels that die there (an illegal instruction, a
wild pointer, a division by zero, a hang) are refused by name: in the verdict, in `plan(x)` and
in the one fallback warning. The test process survives, and the forward's bits stay exact."""

import functools
import os
import secrets
import subprocess
import warnings

import pytest
import torch

from exactness import ExactLinear, ops
from exactness.kernels import KernelUnavailableError, first_run, registry, toolchain
from exactness.kernels.cpu import amx_library, vnni, vnni_library
from tests.crashing_kernels import CRASHES, HANG, planted, stub

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

CACHES = (vnni_library.AVX512.status, vnni_library.AVX2.status, amx_library.status,
          registry.warn_fallback)


@pytest.fixture
def fresh(tmp_path):
    """Every kernel judged again, and again after the test (a planted library's verdict stays in
    the cache, under its own digest)."""
    for cache in CACHES:
        cache.cache_clear()
    ops.PLANS.clear()  # the forwards' plans, made with the kernels judged afresh
    yield tmp_path
    for cache in CACHES:
        cache.cache_clear()
    ops.PLANS.clear()


def with_c_source(monkeypatch, text: str) -> None:
    """Every build of the C kernel compiles `text`, as if cpu_kernel.c and its ISA files said
    that."""
    for build in vnni_library.BUILDS:
        monkeypatch.setattr(build, "source", lambda texts=None: text)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("signal", sorted(CRASHES))
def test_a_c_kernel_that_dies_on_its_first_run_is_refused_and_the_forward_stays_exact(
        signal, fresh, monkeypatch):
    with_c_source(monkeypatch, stub(CRASHES[signal]))
    for build in vnni_library.BUILDS:
        lib, why = build.status()
        assert lib is None, why
        assert f"died of {signal}" in why.why and "the C kernel" in why.why, why
    w, x = torch.randn(40, 96), torch.randn(5, 96).bfloat16()
    layer = ExactLinear.from_weight(w)
    with pytest.warns(registry.FallbackWarning, match=f"died of {signal}"):
        y = layer(x)
    plan = str(layer.plan(x))
    first = next(k.name for k in (vnni.LIMBS, vnni.AVX2_LIMBS) if k.auto)  # emulated: unasked
    assert f"not {first}: its first run, in a child process, died of {signal}" in plan, plan
    assert same_bits(y, ExactLinear.from_weight(w, kernel="wide")(x))
    with pytest.raises(KernelUnavailableError, match=f"died of {signal}"):
        ExactLinear.from_weight(w, kernel="vnni-limbs")(x)


def test_a_planted_library_that_dies_is_never_loaded_even_unchecked(fresh):
    """vnni_library.load(check=False), the mutants' door, still refuses a library whose first run
    died: only a failed self-check is let through there."""
    build = vnni_library.AVX512
    assert build.load(stub(CRASHES["SIGSEGV"]), check=False) is None
    # runs, fails its check: let through
    assert build.load(stub(""), check=False) is not None
    assert build.load(stub(""), check=True) is None


def test_a_first_run_that_hangs_is_refused_and_not_cached(fresh, monkeypatch):
    monkeypatch.setenv(first_run.SECONDS, "2")
    lib, _ = vnni_library.AVX2.build(stub(HANG))
    outcome = vnni_library.AVX2.judged(lib)
    assert outcome.died and "did not end within 2 s" in outcome.verdict.why, outcome
    assert "EXACTNESS_FIRST_RUN_SECONDS" in outcome.verdict.why
    so = lib.exactness_file
    assert not list(so.parent.glob(f"{so.name}.*.verdict"))  # a slow machine may pass later


def test_the_verdict_is_cached_by_build_and_cpu_so_the_child_runs_once(fresh, monkeypatch):
    build = vnni_library.AVX512
    lib, _ = build.build(stub(CRASHES["SIGILL"]))
    first = build.judged(lib)
    assert first.died and "SIGILL" in first.verdict.why

    def no_child(*args, **kwargs):
        raise AssertionError("a second child ran")

    monkeypatch.setattr(first_run, "_child", no_child)  # a fork of the server or a new Python
    assert build.judged(lib) == first  # the same build on the same CPU: from the cache
    another = f"another cpu {secrets.token_hex(8)}"  # never judged: the cache is the machine's
    monkeypatch.setattr(toolchain, "machine", lambda: another)
    with pytest.raises(AssertionError, match="a second child ran"):
        build.judged(lib)  # another CPU's flags: judged afresh


def test_a_bad_limit_is_a_typed_error(monkeypatch):
    from exactness.contract import ContractValueError

    for value in ("0", "-1", "soon"):
        monkeypatch.setenv(first_run.SECONDS, value)
        with pytest.raises(ContractValueError, match="EXACTNESS_FIRST_RUN_SECONDS must be"):
            first_run.seconds()


def emulated_tiles(monkeypatch) -> None:
    monkeypatch.setenv("EXACTNESS_AMX", "emulate")
    if vnni_library.AVX512.missing_features():
        monkeypatch.setenv("EXACTNESS_NATIVE", "emulate")


def test_an_amx_kernel_that_dies_on_its_first_run_is_refused_by_name(fresh, monkeypatch):
    """The AMX build too: a wild pointer in exact_linear_amx, its emulated tiles' self-check the
    first to run it. Forced, the layer raises naming the signal; unforced, its bits are exact."""
    emulated_tiles(monkeypatch)
    source = fresh / "cpu_amx.c"
    source.write_text(planted(amx_library.SOURCE.read_text(), "exact_linear_amx",
                              CRASHES["SIGSEGV"]))
    monkeypatch.setattr(amx_library, "SOURCE", source)
    lib, why = amx_library.status()
    assert lib is None and "died of SIGSEGV" in why.why and "the AMX kernel" in why.why, why
    w, x = torch.randn(40, 96), torch.randn(17, 96).bfloat16()
    with pytest.raises(KernelUnavailableError, match="died of SIGSEGV"):
        ExactLinear.from_weight(w, kernel="amx")(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", registry.FallbackWarning)
        y = ExactLinear.from_weight(w)(x)
    assert same_bits(y, ExactLinear.from_weight(w, kernel="wide")(x))


def test_real_tiles_run_without_the_tile_state_die_in_the_child_not_here(monkeypatch):
    """What issue 39's users saw, on any CPU: the real AMX library's self-check run with no tile
    state asked for. On a CPU without AMX its first tile instruction raises SIGILL; in the child,
    that is a refusal naming it. On a CPU with AMX, Linux raises SIGILL there too (the state is
    granted only on request), unless the machine grants it unasked; then the check passes.
    (test_amx.py builds the same library.)"""
    monkeypatch.setenv("EXACTNESS_AMX", "1")
    monkeypatch.setenv("EXACTNESS_NATIVE", "1")
    lib, why = amx_library.build()
    assert lib is not None, why.why
    outcome = first_run.run(lib.exactness_file, lib.exactness_digest,
                            "tests.crashing_kernels:tiles_without_the_tile_state",
                            "the AMX kernel (real tiles)", toolchain.machine())
    if outcome.died or amx_library.missing_features() or vnni_library.AVX512.missing_features():
        assert outcome.died and "died of SIGILL (an illegal instruction)" in outcome.verdict.why
        assert "the AMX kernel (real tiles)" in outcome.verdict.why
    else:
        assert outcome.verdict.ok, outcome.verdict.why


def probe(tmp_path, value: str) -> first_run.FirstRun:
    """A first run of tests.crashing_kernels:environment_seen with EXACTNESS_PROBE=value (a file
    of its own: verdicts are cached beside it)."""
    os.environ["EXACTNESS_PROBE"] = value
    file = tmp_path / f"probe-{value}.so"
    file.write_bytes(b"")
    return first_run.run(file, value, "tests.crashing_kernels:environment_seen", "a probe",
                         toolchain.machine())


def test_each_first_run_is_a_fork_that_sees_its_callers_environment(tmp_path, monkeypatch):
    """After the first, a first run starts no Python: it is a fork of the fork server, which
    imported torch once. Each still sees the environment and folder of its call, not those the
    server started with."""
    monkeypatch.setenv("EXACTNESS_PROBE", "")
    assert probe(tmp_path, "first").verdict.why == f"first in {os.getcwd()}"

    def no_python(*args, **kwargs):
        raise AssertionError("a new Python started")

    monkeypatch.setattr(subprocess, "run", no_python)
    monkeypatch.setattr(subprocess, "Popen", no_python)
    monkeypatch.chdir(tmp_path)
    assert probe(tmp_path, "second").verdict.why == f"second in {tmp_path}"


def test_a_failed_fork_server_gives_way_to_a_fresh_python_saying_so_once(tmp_path, monkeypatch):
    server = first_run._ForkServer()
    monkeypatch.setattr(first_run, "_SERVER", server)
    monkeypatch.setenv("EXACTNESS_PROBE", "")

    def broken(*args):
        raise OSError("a planted fault")

    monkeypatch.setattr(server, "_ask", broken)
    with pytest.warns(RuntimeWarning, match=r"fresh Python each .* \(OSError: a planted fault\)"):
        assert probe(tmp_path, "first").verdict.why.startswith("first in ")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe(tmp_path, "second").verdict.why.startswith("second in ")


def test_the_fork_server_refuses_a_child_that_dies_and_serves_the_next(tmp_path):
    """A child killed by a signal is reported as such, and the server lives on. The library is
    new to the machine (a nonce in its source), so its verdict is no cached one: it really runs
    in a fork of this process's server, whatever ran before in this worker."""
    assert probe(tmp_path, "before").verdict.why.startswith("before in ")
    process = first_run._SERVER.process
    assert process is not None and process.poll() is None
    nonce = f"/* {secrets.token_hex(8)} */\n"
    lib, _ = vnni_library.AVX2.build(nonce + stub(CRASHES["SIGSEGV"]))
    outcome = vnni_library.AVX2.judged(lib)
    assert outcome.died and "died of SIGSEGV" in outcome.verdict.why, outcome
    assert process.poll() is None
    assert probe(tmp_path, "after").verdict.why.startswith("after in ")
    assert first_run._SERVER.process is process


def test_a_forked_process_starts_its_own_fork_server(tmp_path, monkeypatch):
    """A process forked from one with a server (a serving stack's workers) must not write to
    its parent's pipes: two processes' requests and replies would cross."""
    server = first_run._ForkServer()
    monkeypatch.setattr(first_run, "_SERVER", server)
    monkeypatch.setenv("EXACTNESS_PROBE", "")
    assert probe(tmp_path, "parent").verdict.why.startswith("parent in ")
    parents = server.process
    monkeypatch.setattr(server, "owner", -1)  # as a fork sees it: another process started it
    assert probe(tmp_path, "child").verdict.why.startswith("child in ")
    assert server.process is not parents and parents.poll() is None
    parents.stdin.close()
    assert parents.wait(timeout=30) == 0


@pytest.fixture
def own_server(monkeypatch):
    """A fork server of the test's own, started with the test's environment (its PYTHONPATH)."""
    server = first_run._ForkServer()
    monkeypatch.setattr(first_run, "_SERVER", server)
    yield server
    if server.process is not None:
        server.process.stdin.close()
        server.process.wait(timeout=30)


def test_a_change_anywhere_in_the_checking_code_gives_a_fresh_verdict(tmp_path, monkeypatch,
                                                                      own_server):
    """A cached verdict is keyed on every module of the check's package: a change to a rule the
    check imports from outside its own folder (probe_rules/rules.py beside probe_rules/check/, as
    the C kernels' checks import the contract and the formats) is judged afresh. Planted: a key
    on the check's own folder."""
    package = tmp_path / "probe_rules"
    (package / "check").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "check" / "__init__.py").write_text("")
    (package / "check" / "judge.py").write_text(
        "from exactness.kernels.registry import yes\nfrom probe_rules import rules\n"
        "def judge(file, digest):\n    return yes(f'answer {rules.ANSWER}')\n")
    rules = package / "rules.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # (a .pyc of the same second: stale)
    library = tmp_path / "probe.so"
    library.write_bytes(b"")

    def verdict(answer: int) -> str:
        rules.write_text(f"ANSWER = {answer}\n")
        first_run._code.cache_clear()  # as the next process reads it
        return first_run.run(library, "a digest", "probe_rules.check.judge:judge", "a probe",
                             toolchain.machine()).verdict.why

    assert verdict(1) == "answer 1"
    assert verdict(1) == "answer 1"
    assert verdict(2) == "answer 2"
    # planted: the key of the check's folder alone
    monkeypatch.setattr(first_run, "_code", functools.cache(lambda check: "".join(
        path.read_text() for path in sorted((package / "check").glob("*.py")))))
    assert verdict(3) == "answer 3"
    assert verdict(4) == "answer 3"  # the stale verdict: what the key above refuses
