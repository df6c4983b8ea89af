"""Every cache keyed on all it depends on (issue 75): one row a cache, one change a row's input.
Each change alone must give another key: a miss, and so a fresh build, verdict, plan, view or
proof, never a stale one. A new cache is one row here and one in docs/VERIFY.md's register.
Each key function is the product's own (or the suite's); the mutants catalogue plants a key that
drops an input, and the row's test for that input kills it.

The interpreter's launch store is keyed by the code it reads: tests/test_interpreter_store.py
and tests/test_interpreter_replay.py change each of its inputs (a helper's body, a global, a
constexpr through modules, the interpreter, the bytes read)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from exactness import ops, stacked
from exactness.kernels import first_run, toolchain
from exactness.kernels.cpu import amx_library, vnni_library
from exactness.suite import triton_aot
from exactness.suite.gate import ci

pytestmark = pytest.mark.stage("reliability")  # make verify's stage


@dataclass
class Row:
    """A cache: its key as the product computes it from `state` (which the changes edit), and
    each input's change, made alone (a monkeypatch, a file, an environment variable)."""
    key: object  # (state, monkeypatch, tmp_path) -> the key
    changes: dict  # input -> (state, monkeypatch, tmp_path) -> None


def edited(path: Path):
    """A change: the file's text with a comment appended, in the state's `texts`."""
    def change(state, mp, tmp):
        state["texts"][path] = path.read_text() + "\n/* changed */\n"
    return change


def c_key(build):
    def key(state, mp, tmp):
        source, flags, _ = build.as_compiled(build.source(state["texts"]))
        return toolchain.cache_key(source, [*flags, *state["extra"]])
    return key


def compiler_named(name: str, version: str):
    """A change: a wrapper of the real compiler under another name (CC names it), or under the
    same name first on PATH with another version line (CC unset: the same name, cc)."""
    def change(state, mp, tmp):
        real = shutil.which(toolchain.compiler()) or "cc"
        wrapper = tmp / name
        wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "{version}" && exit 0\n'
                           f'exec {real} "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
        if name == toolchain.compiler():
            mp.setenv("PATH", f"{tmp}:{os.environ['PATH']}")
        else:
            mp.setenv("CC", str(wrapper))
        toolchain.compiler_identity.cache_clear()
    return change


def emulated(state, mp, tmp):
    mp.setenv("EXACTNESS_NATIVE", "emulate")


def file_copy(module, attribute: str):
    """A change: the module's file constant pointed at a changed copy (a header read whole)."""
    def change(state, mp, tmp):
        original = getattr(module, attribute)
        copy = tmp / original.name
        copy.write_text(original.read_text() + "\n/* changed */\n")
        mp.setattr(module, attribute, copy)
    return change


def simde_version(state, mp, tmp):
    mp.setattr(vnni_library.importlib.metadata, "version", lambda name: "0.0.0-changed")


def amx_key(state, mp, tmp):
    emulated_ = amx_library.mode() == "emulate"
    source = amx_library.source(emulated_, state.get("amx_source"))
    source, flags, _ = vnni_library.AVX512.as_compiled(source)
    return toolchain.cache_key(source, [*flags, *(amx_library.EMULATED_FLAGS if emulated_
                                                  else amx_library.FLAGS)])


def first_run_key(state, mp, tmp):
    first_run._code.cache_clear()
    return first_run._key(state["digest"], state["check"], state["machine"])


def checking_code_changed(state, mp, tmp):
    copy = tmp / "first_run.py"
    copy.write_text(Path(first_run.__file__).read_text() + "\n# changed\n")
    mp.setattr(first_run, "__file__", str(copy))


def plan_key(state, mp, tmp):
    w = SimpleNamespace(**state["weights"])
    return ops.plan_key(state["family"], state["device"], state["rows"], w, state["forced"])


def weights_changed(field, value):
    def change(state, mp, tmp):
        state["weights"][field] = value
    return change


def set_state(field, value):
    def change(state, mp, tmp):
        state[field] = value
    return change


def set_env(name, value):
    def change(state, mp, tmp):
        mp.setenv(name, value)
    return change


def stacked_tensors():
    shapes = stacked.stacked_shapes(2, 64, 32)
    return {k: torch.zeros(s, dtype=torch.int32 if k.endswith("packed") else torch.bfloat16)
            for k, s in shapes.items()}


def view_key(state, mp, tmp):
    return stacked.view_key(state["tensors"], state["act_bits"], state["block"])


def tensor_changed(how):
    def change(state, mp, tmp):
        state["tensors"]["w13_scale"] = how(state["tensors"]["w13_scale"])
    return change


def proof_key(state, mp, tmp):
    import z3

    from proofs import prover

    x = z3.BitVec("x", 16)
    return prover.query_key(z3.And(x > 0, x < state["bound"]))


def z3_version(state, mp, tmp):
    import z3

    mp.setattr(z3, "get_version_string", lambda: "0.0.0-changed")


def aot_key(state, mp, tmp):
    return triton_aot.record_key(state["tool"], state["arch"], state["data"])


def stamp_key(state, mp, tmp):
    """The thorough stamp's digest over a copy of the watched files in a git repository."""
    return ci.watched_digest(state["repo"])


def watched_changed(path: str):
    def change(state, mp, tmp):
        file = state["repo"] / path
        file.write_text(file.read_text() + "\n# changed\n")
    return change


STAMPED = ("exactness/kernels/cpu/vnni.py", "exactness/contract.py", "exactness/dataflow.py",
           "exactness/formats.py", "exactness/quantize.py", "exactness/modules.py",
           "exactness/ops.py", "exactness/glue.py", "exactness/moe.py", "exactness/stacked.py",
           "exactness/suite/reference.py", "proofs/prover.py")

ROWS = {
    "C build (toolchain.cache_key), AVX2": Row(c_key(vnni_library.AVX2), {
        "cpu_kernel.c": edited(vnni_library.SOURCE),
        "its ISA header": edited(vnni_library.AVX2.isa),
        "a flag added": set_state("extra", ["-O0"]),
        "a define": set_state("extra", ["-DEXACTNESS_PLANTED=1"]),
        "the compiler's name": compiler_named("cc-other", "gcc (same) 12.2.0"),
        "the compiler's version": compiler_named("cc", "gcc (another) 99.1.0"),
    }),
    "C build (toolchain.cache_key), AVX-512 emulated": Row(c_key(vnni_library.AVX512), {
        "its ISA header": edited(vnni_library.AVX512.isa),
        "the emulation switch": emulated,
        "avx512_emulated.h": lambda s, mp, t: (emulated(s, mp, t),
                                               file_copy(vnni_library, "EMULATION")(s, mp, t)),
        "SIMDe's version": lambda s, mp, t: (emulated(s, mp, t), simde_version(s, mp, t)),
    }),
    "C build (toolchain.cache_key), AMX": Row(amx_key, {
        "cpu_amx.c": set_state("amx_source", "/* another cpu_amx.c */"),
        "the AMX emulation switch": set_env("EXACTNESS_AMX", "emulate"),
        "amx_emulated.h": lambda s, mp, t: (set_env("EXACTNESS_AMX", "emulate")(s, mp, t),
                                            file_copy(amx_library, "EMULATION")(s, mp, t)),
    }),
    "first-run verdicts (first_run._key)": Row(first_run_key, {
        "the library's bytes": set_state("digest", "f" * 64),
        "the check": set_state("check", "exactness.kernels.cpu.vnni_check:check_avx2_file"),
        "the CPU's flags": set_state("machine", "avx2 fma"),
        "the checking code": checking_code_changed,
        "torch's version": lambda s, mp, t: mp.setattr(torch, "__version__", "0.0.0-changed"),
    }),
    "plans (ops.plan_key)": Row(plan_key, {
        "the family": set_state("family", "triton"),
        "the device": set_state("device", torch.device("meta")),
        "the rows": set_state("rows", 17),
        "a kernel forced on the layer": set_state("forced", "wide"),
        "EXACTNESS_KERNEL": set_env("EXACTNESS_KERNEL", "wide"),
        "N": weights_changed("n", 48),
        "K": weights_changed("k", 128),
        "the weights' bits": weights_changed("bits", 8),
        "act_bits": weights_changed("act_bits", 32),
        "EXACTNESS_NATIVE": set_env("EXACTNESS_NATIVE", "0"),
        "EXACTNESS_AMX": set_env("EXACTNESS_AMX", "0"),
    }),
    "stacked views (stacked.view_key)": Row(view_key, {
        "the storage": tensor_changed(lambda t: t.clone()),
        "the shape": tensor_changed(lambda t: t[:1]),
        "the strides": tensor_changed(lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        "the dtype": tensor_changed(lambda t: t.half()),
        "the device": tensor_changed(lambda t: torch.empty(t.shape, dtype=t.dtype,
                                                           device="meta")),
        "act_bits": set_state("act_bits", 32),
        "the block": set_state("block", "transformers"),
    }),
    "proofs (prover.query_key)": Row(proof_key, {
        "the query": set_state("bound", 1000),
        "z3's version": z3_version,
    }),
    "AOT records (triton_aot.record_key)": Row(aot_key, {
        "the tool and its version": set_state("tool", "ptxas 12.9"),
        "the architecture": set_state("arch", 100),
        "the PTX or cubin": set_state("data", b".version 8.8"),
    }),
    "the thorough stamp (gate.ci.watched_digest)": Row(stamp_key, {
        path: watched_changed(path) for path in STAMPED}),
}


def base_state(tmp_path: Path) -> dict:
    state = {"texts": {}, "extra": [], "digest": "0" * 64,
             "check": "exactness.kernels.cpu.vnni_check:check_avx512_file",
             "machine": "avx2 avx512f fma", "family": "cpu", "device": torch.device("cpu"),
             "rows": 16, "forced": None, "weights": dict(n=40, k=64, bits=4, act_bits=16),
             "tensors": stacked_tensors(), "act_bits": 16, "block": "exact", "bound": 100,
             "tool": "ptxas 12.8", "arch": 90, "data": b".version 8.7"}
    return state


def stamp_repo(state: dict, tmp_path: Path) -> None:
    """A git repository holding a copy of the stamped files, for the stamp's rows."""
    repo = tmp_path / "repo"
    for path in STAMPED:
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text((ci.ROOT / path).read_text())
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    state["repo"] = repo


CASES = [(row, change) for row, r in ROWS.items() for change in r.changes]


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@pytest.mark.parametrize("row, change", CASES, ids=[f"{slug(r)}--{slug(c)}" for r, c in CASES])
def test_each_input_of_each_cache_changes_its_key(row, change, monkeypatch, tmp_path):
    for name in ("CC", "EXACTNESS_NATIVE", "EXACTNESS_AMX", "EXACTNESS_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    toolchain.compiler_identity.cache_clear()
    state = base_state(tmp_path)
    if row.startswith("the thorough stamp"):
        stamp_repo(state, tmp_path)
    key = ROWS[row].key
    before = key(state, monkeypatch, tmp_path)
    assert key(state, monkeypatch, tmp_path) == before  # the same inputs: a hit
    ROWS[row].changes[change](state, monkeypatch, tmp_path)
    assert key(state, monkeypatch, tmp_path) != before, f"{row}: {change} left the key as it was"
    toolchain.compiler_identity.cache_clear()
    first_run._code.cache_clear()


def test_every_cache_of_the_register_has_a_row():
    """docs/VERIFY.md's register and this table name the same caches."""
    register = (Path(__file__).resolve().parent.parent / "docs" / "VERIFY.md").read_text()
    table = register.split("## The caches and their keys")[1].split("\n## ")[0]
    for row in ROWS:
        function = row.split("(")[1].split(")")[0]
        assert f"`{function}`" in table, f"{row}: not in docs/VERIFY.md's register"
