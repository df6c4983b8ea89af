"""An interpreted launch on the same inputs replays its writes (exactness.suite.interpreter.replay):
the same bytes as a run where it was the same code on the same bytes, and a run everywhere else."""

import numpy as np
import pytest
import torch

from exactness.suite import device
from exactness.suite.interpreter import replay as interpreter_replay
from exactness.suite.interpreter import store as interpreter_store
from exactness.suite.interpreter import tables as interpreter_tables

pytestmark = pytest.mark.skipif(device.chosen() != "interpret",
                                reason="the Triton kernels are not interpreted here")


@pytest.fixture(autouse=True)
def _own_store(tmp_path, monkeypatch):
    """A store of each test's own (interpreter_store): a launch runs here, or replays from
    memory, and a planted digest never reaches the user's store."""
    own = interpreter_store.Store(tmp_path / "launches")
    monkeypatch.setattr(interpreter_store, "default_store", lambda: own)



def _define_kernels() -> None:
    """The kernels, made once, where the interpreter is chosen (TRITON_INTERPRET set by then);
    module globals, as the product's kernels and helpers are."""
    import triton
    import triton.language as tl

    if "even_kernel" in globals():
        return

    @triton.jit
    def scaled(v):
        return v * 3

    @triton.jit
    def even_kernel(a_ptr, b_ptr, sums_ptr, evens_ptr, N: tl.constexpr):
        """sums = scaled(a) + b, all of it; evens = a - b at the even places only."""
        offs = tl.arange(0, N)
        a, b = tl.load(a_ptr + offs), tl.load(b_ptr + offs)
        tl.store(sums_ptr + offs, scaled(a) + b)  # noqa: F821 - the module's global
        tl.store(evens_ptr + offs, a - b, mask=offs % 2 == 0)

    @triton.jit
    def table_kernel(table_ptr, out_ptr, N: tl.constexpr):
        """out = the int32 values at the address the table holds: a read past the arguments."""
        offs = tl.arange(0, N)
        values = tl.load(table_ptr).to(tl.pointer_type(tl.int32))
        tl.store(out_ptr + offs, tl.load(values + offs))

    @triton.jit
    def evens_kernel(a_ptr, out_ptr, N: tl.constexpr):
        """out = a at the even places, 0 at the odd: the odd places of a are never read."""
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, tl.load(a_ptr + offs, mask=offs % 2 == 0, other=0))

    globals().update(scaled=scaled, even_kernel=even_kernel, table_kernel=table_kernel,
                     evens_kernel=evens_kernel)


N = 8


def _launch(a, b, garbage: int):
    """even_kernel's outputs, from buffers filled with `garbage` (torch.empty's bytes stand-in)."""
    _define_kernels()
    sums, evens = torch.full((N,), garbage, dtype=torch.int32), torch.full((N,), garbage,
                                                                           dtype=torch.int32)
    even_kernel[(1,)](a, b, sums, evens, N=N)  # noqa: F821
    return sums.tolist(), evens.tolist()


def _truth(a, b, garbage: int, times: int = 3):
    a, b = a.tolist(), b.tolist()
    return ([times * x + y for x, y in zip(a, b, strict=True)],
            [x - y if i % 2 == 0 else garbage for i, (x, y) in enumerate(zip(a, b, strict=True))])


def _replayed(call):
    """(call's result, whether its launch was replayed)."""
    before = interpreter_replay.stats["replayed"]
    result = call()
    return result, interpreter_replay.stats["replayed"] == before + 1


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    return (torch.tensor(rng.integers(-1000, 1000, N), dtype=torch.int32),
            torch.tensor(rng.integers(-1000, 1000, N), dtype=torch.int32))


def test_a_launch_on_the_same_bytes_writes_what_it_wrote_and_leaves_the_rest():
    a, b = _inputs(1)
    for _ in range(2):  # (a process's first launch adds to Triton's classes: not recorded)
        assert _launch(a, b, 7) == _truth(a, b, 7)
    # new buffers, other garbage: the written bytes replayed, the odd places keep their own
    found, replayed = _replayed(lambda: _launch(a.clone(), b.clone(), -5))
    assert replayed and found == _truth(a, b, -5)


def _changes_seen(a, b) -> bool:
    """Whether a launch after one byte of b changed, and after the helper was replaced, gives
    the bits a run gives: each must run again."""
    _launch(a, b, 0)
    changed = b.clone()
    changed.view(torch.uint8)[5] ^= 1
    new_bytes = _launch(a, changed, 0) == _truth(a, changed, 0)
    import triton

    original = globals()["scaled"]

    @triton.jit
    def scaled_by_five(v):
        return v * 5

    globals()["scaled"] = scaled_by_five  # as a mutant is bound: the module's name for it
    try:
        new_code = _launch(a, b, 0) == _truth(a, b, 0, times=5)
    finally:
        globals()["scaled"] = original
    return new_bytes and new_code and _launch(a, b, 0) == _truth(a, b, 0)


def test_other_bytes_or_other_code_run_again(monkeypatch):
    a, b = _inputs(2)
    assert _changes_seen(a, b)
    # planted: bytes not told apart, or the helper not part of the code: a stale replay
    a, b = _inputs(3)
    monkeypatch.setattr(interpreter_replay, "_digest", lambda storage: b"")
    assert not _changes_seen(a, b)
    monkeypatch.undo()
    a, b = _inputs(4)
    monkeypatch.setattr(interpreter_replay, "_code_of", lambda fn, seen: None)
    assert not _changes_seen(a, b)


def test_a_read_past_the_arguments_is_never_replayed():
    """The table holds the address of a buffer the launch is not given: its bytes cannot be
    keyed, so the launch runs each time and sees them change."""
    _define_kernels()
    target = torch.arange(N, dtype=torch.int32)
    table = torch.tensor([target.data_ptr()], dtype=torch.int64)
    refused = interpreter_replay.stats["not replayable"]
    for shift in (0, 100):
        target += shift
        out = torch.zeros(N, dtype=torch.int32)
        table_kernel[(1,)](table, out, N=N)  # noqa: F821
        assert out.tolist() == target.tolist()
    assert interpreter_replay.stats["not replayable"] == refused + 2


def _evens_seen(first: int) -> bool:
    """Whether launches on bytes that differ only where the kernel does not read replay, and
    one that differs where it reads gives the bits of a run."""
    _launch(*_inputs(1), 0)  # (a process's first launch adds to Triton's classes: not kept)
    a = torch.arange(first, first + N, dtype=torch.int32)

    def evens(a):
        out = torch.full((N,), 9, dtype=torch.int32)
        evens_kernel[(1,)](a, out, N=N)  # noqa: F821
        return out.tolist() == [int(v) if i % 2 == 0 else 0 for i, v in enumerate(a)]

    assert evens(a)
    odd = a.clone()
    odd[1::2] = -7  # unread
    right, replayed = _replayed(lambda: evens(odd))
    even = a.clone()
    even[2] += 1
    return right and replayed and evens(even)


def test_only_the_bytes_a_launch_read_are_its_key(monkeypatch):
    assert _evens_seen(100)
    # planted: the reads not noted: every launch of the code replays the first one's writes
    note = interpreter_replay._Reads.note
    monkeypatch.setattr(interpreter_replay._Reads, "note",
                        lambda self, *args, read, write: note(self, *args, read=False,
                                                              write=write))
    assert not _evens_seen(200)


def _through_a_table() -> bool:
    """Whether a launch through a table told what it points at replays for the same bytes at
    another address, and runs again once those bytes change."""
    _launch(*_inputs(1), 0)  # (a process's first launch adds to Triton's classes: not kept)
    _define_kernels()

    def through(target):
        table = torch.tensor([target.data_ptr()], dtype=torch.int64)
        interpreter_tables.points_at(table, [target])
        out = torch.zeros(N, dtype=torch.int32)
        table_kernel[(1,)](table, out, N=N)  # noqa: F821
        return out.tolist() == target.tolist()

    target = torch.arange(300, 300 + N, dtype=torch.int32)
    assert through(target)
    moved = target.clone()  # the same bytes elsewhere
    right, replayed = _replayed(lambda: through(moved))
    moved += 1
    return right and replayed and through(moved)


def test_a_table_of_addresses_counts_by_what_it_points_at(monkeypatch):
    assert _through_a_table()
    # planted: the table keyed by its raw addresses, or told nothing: never replayed
    monkeypatch.setattr(interpreter_tables, "digest", lambda view, buffers: bytes(view))
    assert not _through_a_table()
    monkeypatch.setattr(interpreter_tables, "pointed_by", lambda tensor: None)
    assert not _through_a_table()
