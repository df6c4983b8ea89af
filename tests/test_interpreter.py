"""The suite's faster Triton interpreter (exactness.suite.interpreter) computes what Triton's
own does, leaves the language as it found it, and keeps a deep call chain from mapping a frame
chunk per call."""

import resource

import numpy as np
import pytest

from exactness.suite import device
from exactness.suite.cases import load_vectors
from exactness.suite.interpreter import speedups as interpreter
from exactness.suite.paths import available_paths, run

needs_interpreter = pytest.mark.skipif(device.chosen() != "interpret",
                                       reason="the Triton kernels are not interpreted here")
# slow rows (the multiword finish) and non-finite rows, at each activation width
VECTORS = ("v03-spread-a8-bfloat16", "v24-spread-a16-bfloat16", "v43-wide-a32-bfloat16",
           "v57-nonfinite-a8-bfloat16", "v63-nonfinite-a4-bfloat16")


def _leaf(a, b, c):
    return a


def _faults_at(depth: int, calls: int) -> int:
    """Page faults of `calls` calls of a small function `depth` frames further down."""
    if depth:
        return _faults_at(depth - 1, calls)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        _leaf(1, 2, 3)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _worst_faults(calls: int = 2000) -> int:
    """The most page faults at any depth over two frame chunks' worth (16 KiB each)."""
    return max(_faults_at(depth, calls) for depth in range(400))


def test_a_wide_frame_keeps_every_depth_from_mapping_a_chunk_per_call():
    wide = interpreter.wide_frame_runner(interpreter.WIDE_FRAME_SLOTS)
    assert wide(_worst_faults) < 100
    # a frame of ordinary width (a planted bug: the runner without its slots) does not: at the
    # depth where a call needs a new chunk, CPython maps and unmaps one each call
    assert interpreter.wide_frame_runner(10)(_worst_faults) >= 1000


def _language():
    """Every attribute of the modules and class the interpreter patches, by identity."""
    import triton.language as tl

    owners = (tl, tl.core, tl.math, tl.standard, tl.tensor)
    return {(owner.__name__, name): id(value) for owner in owners
            for name, value in vars(owner).items()}


@needs_interpreter
def test_interpreted_launches_give_the_vectors_bits_with_and_without_the_speed_ups():
    cases = [case for case in load_vectors() if case.name in VECTORS]
    assert len(cases) == len(VECTORS)
    paths = {case.name: [p for p in available_paths(case) if p.startswith("triton")]
             for case in cases}
    assert all(len(held) >= 3 for held in paths.values()), paths
    assert interpreter.installed() and _types_shared()
    run(cases[0], paths[cases[0].name][0])  # Triton's first launch adds names to its modules
    before = _language()
    try:
        for speed_ups in (True, False):
            if not speed_ups:
                # Triton's own leaves tl.core patched after a launch: not compared
                assert _language() == before, "a launch left the language patched"
                interpreter.uninstall()
            for case in cases:
                for path in paths[case.name]:
                    assert np.array_equal(run(case, path), case.expected), (path, case.name,
                                                                            speed_ups)
    finally:
        interpreter.install()


def _wrapping_add():
    """An interpreted int32 add past the type's range, and the wrapped bits it stores."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_kernel(a_ptr, b_ptr, out_ptr):
        offs = tl.arange(0, 4)
        tl.store(out_ptr + offs, tl.load(a_ptr + offs) + tl.load(b_ptr + offs))

    a = torch.tensor([2**31 - 1, 1, -2**31, 5], dtype=torch.int32)
    b = torch.tensor([1, 1, -1, 5], dtype=torch.int32)
    out = torch.empty_like(a)
    add_kernel[(1,)](a, b, out)
    return out.tolist()


@needs_interpreter
def test_the_overflow_check_runs_only_where_its_verdict_counts():
    """Triton's interpreter redoes each int32 add in int64 and hands the verdict to
    device_assert, which drops it unless the options' debug is set: an overflow passes unseen
    with the check (as Triton ships) and without it (the speed-up), the same bits wrapped. With
    debug set the check is kept, and catches it."""
    import dataclasses

    from triton.runtime import interpreter as triton_interpreter

    wrapped = [-2**31, 2, 2**31 - 1, 10]
    builder = triton_interpreter.interpreter_builder
    interpreter.uninstall()
    shipped = builder.options
    try:
        assert shipped.sanitize_overflow and not shipped.debug  # what the speed-up rests on
        assert _wrapping_add() == wrapped
        interpreter.install()
        assert not builder.options.sanitize_overflow and _wrapping_add() == wrapped
        interpreter.uninstall()
        builder.options = dataclasses.replace(shipped, debug=True)
        interpreter.install()
        assert builder.options.sanitize_overflow
        with pytest.raises(Exception, match="int32 overflow detected for operation add"):
            _wrapping_add()
    finally:
        interpreter.uninstall()
        builder.options = shipped
        interpreter.install()


def _types_shared() -> bool:
    import triton.language as tl

    return tl.core.block_type.__init__.__name__ == "shared_block_init"


@needs_interpreter
def test_the_shared_types_are_left_out_where_triton_builds_other_values(monkeypatch):
    """Another Triton, planted: its tensors carry one more attribute, which the shared builder
    would drop. install() compares, keeps Triton's own builders, and says so."""
    import triton.language as tl

    interpreter.uninstall()
    shipped = tl.core.tensor.__init__

    def init(self, handle, type):
        shipped(self, handle, type)
        self.origin = "another Triton"

    monkeypatch.setattr(tl.core.tensor, "__init__", init)
    try:
        with pytest.warns(RuntimeWarning, match="builds its types as it ships"):
            assert interpreter.install()
        assert tl.core.tensor.__init__ is init and not _types_shared()
    finally:
        interpreter.uninstall()
        monkeypatch.undo()
        interpreter.install()
    assert _types_shared()


def _operands_shared() -> bool:
    from triton.language.semantic import TritonSemantic

    return TritonSemantic.broadcast_impl_value.__name__ == "shared_broadcast"


@needs_interpreter
@pytest.mark.parametrize("builder", ["create_splat", "create_broadcast"])
def test_the_shared_operands_are_left_out_where_triton_broadcasts_otherwise(monkeypatch, builder):
    """Another Triton, planted: its splat of a scalar, or its broadcast of a block, widens the
    values' type, which a shared splat or widened block would not do. install() compares, keeps
    Triton's own broadcasting, and says so."""
    import numpy as np
    from triton.runtime import interpreter as triton_interpreter

    interpreter.uninstall()
    shipped = getattr(triton_interpreter.InterpreterBuilder, builder)

    def widening(self, *args):
        made = shipped(self, *args)
        return triton_interpreter.TensorHandle(made.data.astype(np.int64), made.dtype)

    monkeypatch.setattr(triton_interpreter.InterpreterBuilder, builder, widening)
    try:
        with pytest.warns(RuntimeWarning, match="broadcasts operands as it ships"):
            assert interpreter.install()
        assert not _operands_shared()
    finally:
        interpreter.uninstall()
        monkeypatch.undo()
        interpreter.install()
    assert _operands_shared()


@needs_interpreter
def test_a_shared_splat_is_read_only_and_keyed_by_its_bits():
    """+0.0 and -0.0 compare equal but are two splats; a write into a shared one raises."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as triton_interpreter

    semantic = triton_interpreter.interpreter_semantic
    block = tl.core.block_type(tl.float32, [2])

    def tensor(value, ty):
        data = np.full(ty.shape if ty.is_block() else (1,), value, dtype=np.float32)
        return tl.core.tensor(triton_interpreter.TensorHandle(data, tl.float32), ty)

    ones = tensor(1.0, block)
    plus = semantic.broadcast_impl_value(ones, tensor(0.0, tl.float32))[1].handle.data
    minus = semantic.broadcast_impl_value(ones, tensor(-0.0, tl.float32))[1].handle.data
    assert _operands_shared() and np.signbit(minus).all() and not np.signbit(plus).any()
    assert semantic.broadcast_impl_value(ones, tensor(-0.0, tl.float32))[1].handle.data is minus
    with pytest.raises(ValueError, match="read-only"):
        minus[0] = 1.0


def _checks_shared() -> bool:
    from triton.language.semantic import TritonSemantic

    return TritonSemantic.binary_op_type_checking_impl.__name__ == "shared_check"


@needs_interpreter
def test_the_shared_checks_are_left_out_where_triton_promotes_otherwise(monkeypatch):
    """Another Triton, planted: it widens two int32 operands to int64, which the shortcut for
    one type would not do. install() compares, keeps Triton's own checks, and says so."""
    import triton.language as tl
    from triton.language.semantic import TritonSemantic

    interpreter.uninstall()
    shipped = TritonSemantic.binary_op_type_checking_impl

    def widening(self, lhs, rhs, *flags):
        lhs, rhs = shipped(self, lhs, rhs, *flags)
        if isinstance(lhs, tl.core.tensor) and lhs.dtype == tl.int32:
            return self.cast(lhs, tl.int64), self.cast(rhs, tl.int64)
        return lhs, rhs

    monkeypatch.setattr(TritonSemantic, "binary_op_type_checking_impl", widening)
    try:
        with pytest.warns(RuntimeWarning, match="checks operand types as it ships"):
            assert interpreter.install()
        assert not _checks_shared() and _operands_shared()
    finally:
        interpreter.uninstall()
        monkeypatch.undo()
        interpreter.install()
    assert _checks_shared()


@needs_interpreter
def test_a_shared_constant_is_read_only_and_keyed_by_its_int_and_type():
    """A tensor and a Python int: Triton's constant the first time, the same read-only one after;
    another int or type gets its own; an int out of the type's range raises every time."""
    import triton.language as tl
    from triton.runtime import interpreter as triton_interpreter

    semantic = triton_interpreter.interpreter_semantic

    def ones(ty):
        data = np.ones(2, dtype=triton_interpreter._get_np_dtype(ty))
        return tl.core.tensor(triton_interpreter.TensorHandle(data, ty),
                              tl.core.block_type(ty, [2]))

    check = semantic.binary_op_type_checking_impl
    a, wide = ones(tl.int32), ones(tl.int64)
    seven = check(a, 7)[1]
    assert _checks_shared() and check(a, 7)[0] is a and check(a, 7)[1] is seven
    assert seven.handle.data.tolist() == [7, 7] and seven.dtype == tl.int32
    assert check(a, 8)[1].handle.data.tolist() == [8, 8]
    assert check(wide, 7)[1].dtype == tl.int64 and check(7, a)[0].handle.data.tolist() == [7, 7]
    with pytest.raises(ValueError, match="read-only"):
        seven.handle.data[0] = 1
    for _ in range(2):
        with pytest.raises(ValueError, match="out of range"):
            check(ones(tl.int8), 300)


def _maximum_of_zero(values):
    """An interpreted launch of tl.maximum(x, 0) over four int32 values."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def maximum_kernel(a_ptr, out_ptr):
        offs = tl.arange(0, 4)
        tl.store(out_ptr + offs, tl.maximum(tl.load(a_ptr + offs), 0))

    a = torch.tensor(values, dtype=torch.int32)
    out = torch.empty_like(a)
    maximum_kernel[(1,)](a, out)
    return out.tolist()


@needs_interpreter
def test_a_builtin_replaced_between_launches_is_patched_not_its_old_wrapper(monkeypatch):
    """The kept wrappers of a module's walk are set again only while it holds the builtins they
    wrap: a builtin replaced between two launches (planted: a counting tl.maximum) is walked
    and patched at the next, and the shipped one is back after it is undone."""
    import triton.language as tl

    values, want = [-3, 5, 0, -1], [0, 5, 0, 0]
    assert _maximum_of_zero(values) == want  # the walk's wrappers kept
    calls, shipped = [], tl.maximum

    @tl.core.builtin
    def counted_maximum(*args, _semantic=None, **kwargs):
        calls.append(args)
        return shipped(*args, _semantic=_semantic, **kwargs)

    monkeypatch.setattr(tl, "maximum", counted_maximum)
    assert _maximum_of_zero(values) == want and len(calls) == 1
    monkeypatch.undo()
    assert _maximum_of_zero(values) == want and len(calls) == 1
    assert tl.maximum is shipped


def _dots(a, b, d):
    """Triton's interpreted dot of integer blocks a @ b + d: (the suite's, Triton's own)."""
    import triton.language as tl
    from triton.runtime import interpreter as triton_interpreter

    types = {np.dtype(np.int8): tl.int8, np.dtype(np.int16): tl.int16,
             np.dtype(np.int32): tl.int32, np.dtype(np.int64): tl.int64}
    handles = [triton_interpreter.TensorHandle(v, types[v.dtype]) for v in (a, b, d)]
    builder = triton_interpreter.interpreter_builder
    found = []
    for speed_ups in (True, False):
        if not speed_ups:
            interpreter.uninstall()
        try:
            found.append(builder.create_dot(*handles, "ieee", 0).data)
        finally:
            interpreter.install()
    return found


@needs_interpreter
def test_an_integer_dot_on_blas_gives_the_integer_loops_bits():
    """A float64 matmul stands in for numpy's integer loop where every partial sum is below 2**53:
    the same bits for random blocks, for sums that wrap the int32 or int16 accumulator, and for
    an accumulator that wraps when d is added. int32 operands (sums past 2**53) keep the loop."""
    rng = np.random.default_rng(5)
    a, b = rng.integers(-128, 128, (16, 96)).astype(np.int8), rng.integers(-128, 128, (96, 64))
    d = rng.integers(-2**31, 2**31, (16, 64)).astype(np.int32)
    k = 2**18  # 2**18 products of (-128)**2 sum to 2**32 (+2**14 + 127): past int32 and float32
    big_a, big_b = np.full((2, k), -128, np.int8), np.full((k, 3), -128, np.int8)
    big_a[0, 0], big_b[1, 2] = 127, 127
    cases = [(a, b.astype(np.int8), d), (a, b.astype(np.int8).T.copy().T, d),  # b a transpose
             (big_a, big_b, np.array([[2**31 - 1] * 3] * 2, np.int32)),
             (big_a, big_b, np.zeros((2, 3), np.int16)),
             (a.astype(np.int16), b.astype(np.int16), np.ones((16, 64), np.int64))]
    for x, w, acc in cases:
        assert interpreter.float64_dot_is_exact(x, w, acc)
        ours, theirs = _dots(x, w, acc)
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), (x.shape, acc.dtype)
    # the case can tell: a float32 matmul (a planted bug) rounds the big sums
    float32 = (big_a.astype(np.float32) @ big_b.astype(np.float32)).astype(np.int64)
    assert not np.array_equal(float32, big_a.astype(np.int64) @ big_b.astype(np.int64))
    assert not interpreter.float64_dot_is_exact(a.astype(np.int32), b.astype(np.int32), d)
    assert not interpreter.float64_dot_is_exact(a, b.astype(np.float32), d)
