"""Interpreted launches kept on disk (exactness.suite.interpreter.store): recalled by the next
process where the code, the interpreter and the bytes read are the same, and run everywhere
else. Each check that a launch ran again is shown to catch a name blind to what changed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exactness.suite import device
from exactness.suite.interpreter import replay as interpreter_replay
from exactness.suite.interpreter import store as interpreter_store

from . import test_interpreter_replay as kernels

pytestmark = pytest.mark.skipif(device.chosen() != "interpret",
                                reason="the Triton kernels are not interpreted here")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A store of this test's own: planted names never reach the user's."""
    own = interpreter_store.Store(tmp_path / "exactness" / "launches")
    monkeypatch.setattr(interpreter_store, "default_store", lambda: own)
    return own


_CHILD = """
import json, sys
from exactness.suite import device
from exactness.suite.interpreter import replay as interpreter_replay
import tests.test_interpreter_replay as kernels
a, b = kernels._inputs(11)
same = kernels._launch(a, b, 7) == kernels._truth(a, b, 7)
recalled = interpreter_replay.stats["recalled"]
a, b = kernels._inputs(12)
other = kernels._launch(a, b, 7) == kernels._truth(a, b, 7)
print(json.dumps([same, recalled, other, interpreter_replay.stats["recalled"]]))
"""


def _child(tmp_path, seed: str) -> list:
    """[right on the bytes seen, launches recalled, right on others, recalled after] of _CHILD,
    a fresh process (one of this session has been through other tests: another interpreter's
    state) with its store in tmp_path and its own hash seed: no name hangs on set order."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "EXACTNESS_DEVICE": "interpret",
           "PYTHONHASHSEED": seed}
    child = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.splitlines()[-1])


def test_the_next_process_recalls_a_launch_on_its_bytes_and_runs_it_on_others(tmp_path):
    assert _child(tmp_path, "1") == [True, 0, True, 0]  # the first: every launch runs
    assert list((tmp_path / "exactness" / "launches").iterdir())  # and is stored
    assert _child(tmp_path, "12345") == [True, 1, True, 2]  # the next: every one recalled


def _runs_again(a, b) -> bool:
    """Whether, after a launch is stored, the same launch with another helper and then under
    another interpreter gives the bits of a run (the in-memory replay cannot answer either: the
    code is new to it)."""
    from triton.runtime import interpreter

    assert kernels._launch(a, b, 0) == kernels._truth(a, b, 0)
    original = vars(kernels)["scaled"]

    # the same name, the same arguments, another body: as a mutant is planted
    exec(compile("import triton\n@triton.jit\ndef scaled(v):\n    return v * 5\n",
                 "<planted helper>", "exec"), planted := {"__name__": kernels.__name__})
    vars(kernels)["scaled"] = planted["scaled"]
    try:
        new_code = kernels._launch(a, b, 0) == kernels._truth(a, b, 0, times=5)
    finally:
        vars(kernels)["scaled"] = original
    builder = interpreter.InterpreterBuilder
    add = builder.create_add

    def add_one_more(self, x, y):  # another interpreter: every add gives one more
        total = add(self, x, y)
        return interpreter.TensorHandle(total.data + 1, total.dtype.scalar)

    builder.create_add = add_one_more
    try:
        sums, _ = kernels._launch(a, b, 0)
    finally:
        builder.create_add = add
    new_interpreter = sums == [s + 1 for s in kernels._truth(a, b, 0)[0]]
    return new_code and new_interpreter


def test_other_code_or_another_interpreter_runs_again(store, monkeypatch):
    assert _runs_again(*kernels._inputs(21))
    # planted: a function named by its arguments alone, or the interpreter not named at all
    monkeypatch.setattr(interpreter_store, "_code", lambda code: repr(code.co_varnames))
    monkeypatch.setattr(interpreter_store, "_source", lambda module, path: "")
    blind = interpreter_store.Store(store.directory.parent / "blind-code")
    monkeypatch.setattr(interpreter_store, "default_store", lambda: blind)
    assert not _runs_again(*kernels._inputs(22))
    monkeypatch.undo()
    monkeypatch.setattr(interpreter_store, "_owners_name", lambda owners: "")
    blind = interpreter_store.Store(store.directory.parent / "blind-interpreter")
    monkeypatch.setattr(interpreter_store, "default_store", lambda: blind)
    assert not _runs_again(*kernels._inputs(23))


def _entry() -> tuple:
    values = np.arange(-4, 4, dtype=np.int32).view(np.uint8)
    mask = np.packbits(np.arange(32) % 2 == 0)
    writes = ((1, None, values), (2, mask, values[::2].copy()))
    reads = ((0, None, bytes(range(16))), (3, mask, bytes(16)))
    return reads, writes, sum(w[2].nbytes for w in writes) + 2 * mask.nbytes


def _found(store, name):
    return store.find(name, lambda index, mask, digest: index == 3 or
                      (index, mask, digest) == (0, None, bytes(range(16))))


def test_an_entry_reads_back_whole_and_a_torn_or_altered_one_is_a_miss_and_removed(store):
    store.save("a" * 32, _entry())
    found = _found(store, "a" * 32)
    assert found is not None and found[2] == _entry()[2]
    assert [(i, None if m is None else m.tobytes(), d) for i, m, d in found[0]] == \
        [(i, None if m is None else m.tobytes(), d) for i, m, d in _entry()[0]]
    for (i, m, v), (j, n, w) in zip(found[1], _entry()[1], strict=True):
        assert i == j and (m is None) == (n is None) and (m is None or m.tobytes() == n.tobytes())
        assert v.dtype == w.dtype and v.tobytes() == w.tobytes()
    assert store.find("a" * 32, lambda index, mask, digest: False) is None  # other bytes read
    (file,) = (store.directory / ("a" * 32)).iterdir()
    for spoil in (lambda d: d[:-40], lambda d: d[:60] + bytes([d[60] ^ 1]) + d[61:]):
        store.save("a" * 32, _entry())
        file.write_bytes(spoil(file.read_bytes()))
        assert _found(store, "a" * 32) is None and not file.exists()
    part = store.directory / ("a" * 32) / ".being-written.part"
    part.write_bytes(b"half")
    assert _found(store, "a" * 32) is None and part.exists()  # another process's, left alone


def test_the_least_recently_used_entries_go_first_past_the_budget(store):
    for i in range(8):
        store.save(f"{i:032x}", _entry())
        os.utime(next((store.directory / f"{i:032x}").iterdir()), (i, i))
    size = next((store.directory / f"{0:032x}").iterdir()).stat().st_size
    assert _found(store, f"{0:032x}") is not None  # used now: the newest
    store.prune(budget=5 * size)  # over: kept down to 3/4 of it, 3 entries
    kept = sorted(p.name for p in store.directory.iterdir() if p.is_dir())  # none left empty
    assert kept == [f"{i:032x}" for i in (0, 6, 7)]


def test_a_global_without_a_name_by_content_keeps_its_launch_in_its_process():
    with pytest.raises(interpreter_store.Unnamed):
        interpreter_store.content({"a": 1}, strict=True)
    assert interpreter_store.content({"a": 1}, strict=False) == "object:builtins.dict"
    assert interpreter_store.content(frozenset("abc"), strict=True) == \
        interpreter_store.content(frozenset("cba"), strict=True)


def test_off_asks_for_no_store(monkeypatch):
    monkeypatch.setenv("EXACTNESS_LAUNCH_STORE", "off")
    assert interpreter_store.default_store.__wrapped__().directory is None
    assert interpreter_replay.tally().keys() == {"run", "replayed", "recalled"}


def test_a_method_planted_in_an_interpreter_class_is_another_interpreter(monkeypatch):
    """Every class of the interpreter and the language is named by its methods' code: one
    planted (a test's) leaves the launches in their process."""
    from triton.runtime import interpreter

    owners = (interpreter, interpreter.TensorHandle)
    shipped = interpreter_store._owners_name(owners)
    monkeypatch.setattr(interpreter.TensorHandle, "clone", lambda self: self)
    with pytest.raises(interpreter_store.Unnamed):
        interpreter_store._owners_name(owners)
    monkeypatch.undo()
    assert interpreter_store._owners_name(owners) == shipped


def _probe_kernels(root: Path, times: int, step: int, bias: int) -> None:
    """A package of kernels whose helpers' constants are reached three ways: a literal in a
    helper, a module's constant through a chain of modules (probe.helpers.steps.STEP, the kernel's
    module naming only `probe`), and a class's attribute."""
    (root / "probe" / "helpers").mkdir(parents=True, exist_ok=True)
    (root / "probe" / "__init__.py").write_text("")
    (root / "probe" / "helpers" / "__init__.py").write_text("")
    (root / "probe" / "helpers" / "steps.py").write_text(
        "import triton\nimport triton.language as tl\n"
        f"STEP = tl.constexpr({step})\n"
        f"class Bias:\n    VALUE = {bias}\n"
        "@triton.jit\ndef shifted(v):\n    return v + STEP\n"
        f"@triton.jit\ndef scaled(v):\n    return v * {times}\n")
    (root / "probe" / "kernels.py").write_text(
        "import triton\nimport triton.language as tl\nimport probe.helpers.steps\n"
        "from probe.helpers.steps import Bias, scaled\n"
        "@triton.jit\ndef kernel(x_ptr, y_ptr, N: tl.constexpr):\n"
        "    offs = tl.arange(0, N)\n"
        "    x = tl.load(x_ptr + offs)\n"
        "    tl.store(y_ptr + offs, scaled(x))\n"
        "    tl.store(y_ptr + N + offs, probe.helpers.steps.shifted(x))\n"
        "    tl.store(y_ptr + 2 * N + offs, x + Bias.VALUE)\n")


_PROBE_CHILD = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
import torch
from exactness.suite import device
from exactness.suite.interpreter import replay as interpreter_replay
from exactness.suite.interpreter import store as interpreter_store
package, plant, outputs = sys.argv[2], sys.argv[3], int(sys.argv[4])
if plant == "blind":  # planted: code named without its files, no namespace walked
    interpreter_store._source = lambda module, path: ""
    interpreter_replay._namespace = lambda value: False
if plant == "blind-constexpr":  # planted: a constexpr named without its value
    named = interpreter_store.content
    interpreter_store.content = lambda value, strict, depth=0: (
        "constexpr" if type(value).__name__ == "constexpr" else named(value, strict, depth))
kernels = importlib.import_module(package + ".kernels")
x, y = torch.arange(1, 5, dtype=torch.int32), torch.zeros(4 * outputs, dtype=torch.int32)
kernels.kernel[(1,)](x, y, N=4)
print(json.dumps([y.tolist()[::4], interpreter_replay.stats["recalled"]]))
"""


def _probe(tmp_path, plant: str, package: str = "probe", outputs: int = 3,
           env: dict | None = None) -> list:
    """[the outputs at x=1, launches recalled] of `package`'s kernel, from a fresh process on
    the store in tmp_path (_probe_kernels: [x*times, x+step, x+bias])."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "EXACTNESS_DEVICE": "interpret",
           "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}  # (a .pyc of the same second: stale)
    child = subprocess.run([sys.executable, "-c", _PROBE_CHILD, str(tmp_path / "src"), package,
                            plant, str(outputs)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.splitlines()[-1])


@pytest.mark.parametrize("plant", ["none", "blind"])
def test_a_constant_changed_in_a_helper_gives_the_next_process_new_bits(tmp_path, plant):
    """The same store, warm, and one constant changed between two processes, whichever way the
    kernel reaches it: the next process computes the new bits. Planted: a name blind to them."""
    _probe_kernels(tmp_path / "src", times=3, step=10, bias=100)
    assert _probe(tmp_path, plant) == [[3, 11, 101], 0]
    for times, step, bias in ((5, 10, 100), (5, 20, 100), (5, 20, 200)):
        _probe_kernels(tmp_path / "src", times, step, bias)
        got = _probe(tmp_path, plant)
        if plant == "blind" and (step, bias) != (10, 100):
            assert got[0] != [5, 1 + step, 1 + bias]  # the last bits, recalled
            return
        assert got == [[times, 1 + step, 1 + bias], 0]
    assert _probe(tmp_path, plant) == [[5, 21, 201], 1]  # unchanged: recalled
    assert plant == "none", "the planted blind name was not caught"


def _env_probe_kernels(root: Path) -> None:
    """Kernels reading a module-level tl.constexpr set from the environment, the file unchanged
    between processes: through a module (envprobe.limits.LIMIT) and as a global imported from
    another module (SHIFT)."""
    (root / "envprobe").mkdir(parents=True, exist_ok=True)
    (root / "envprobe" / "__init__.py").write_text("")
    (root / "envprobe" / "limits.py").write_text(
        "import os\nimport triton.language as tl\n"
        "LIMIT = tl.constexpr(int(os.environ['PROBE_LIMIT']))\n"
        "SHIFT = tl.constexpr(int(os.environ['PROBE_LIMIT']) // 10)\n")
    (root / "envprobe" / "kernels.py").write_text(
        "import triton\nimport triton.language as tl\nimport envprobe.limits\n"
        "from envprobe.limits import SHIFT\n"
        "@triton.jit\ndef kernel(x_ptr, y_ptr, N: tl.constexpr):\n"
        "    offs = tl.arange(0, N)\n"
        "    x = tl.load(x_ptr + offs)\n"
        "    tl.store(y_ptr + offs, x + envprobe.limits.LIMIT)\n"
        "    tl.store(y_ptr + N + offs, x + SHIFT)\n")


@pytest.mark.parametrize("plant", ["none", "blind-constexpr"])
def test_a_constexpr_set_from_the_environment_gives_the_next_process_new_bits(tmp_path, plant):
    """Issue 75: a module-level tl.constexpr whose value comes from the environment, its file
    unchanged, is named by its value: the next process with another value computes the new
    bits, never the last process's. Planted: a constexpr named without its value, caught."""
    _env_probe_kernels(tmp_path / "src")

    def probe(limit: int) -> list:
        return _probe(tmp_path, plant, "envprobe", 2, {"PROBE_LIMIT": str(limit)})

    assert probe(1000) == [[1001, 101], 0]
    assert probe(1000) == [[1001, 101], 1]  # the same value: recalled
    got = probe(2000)
    if plant == "blind-constexpr":
        assert got != [[2001, 201], 0], "the planted blind constexpr was not caught"
        return
    assert got == [[2001, 201], 0]
