"""The Triton interpreter made faster for the suite, in ten ways, its arithmetic untouched.

- **One language patch a launch.** Triton patches triton.language for the interpreter at each
  launch and restores it after, but also again at every call of a @triton.jit helper inside the
  launch. That inner patch changes nothing once the helper's modules are patched (a patched
  builtin is not patched twice), yet walks them with inspect.getmembers each time: about 15% of
  an interpreted forward. Here a launch patches each module it meets once.
- **A launch in one wide frame chunk.** CPython 3.11+ keeps Python frames in 16 KiB chunks,
  mapped when a call needs a new one and unmapped when it returns. A deep call chain that
  crosses a chunk's end at the interpreter's hot depth maps and unmaps it on nearly every
  operation: in the suite a quarter of the equivalence stage's CPU time was the kernel's page
  faults, and how much depended on the depth pytest happened to call from. Here each launch
  runs in a frame so wide that its chunk (512 KiB) keeps room for every frame above it.
- **No overflow check whose verdict is dropped.** The interpreter's options ask for an int32
  overflow check at every integer add, subtract and multiply: each is redone in int64 and
  compared with the type's range, and the result goes to `device_assert`, which does nothing
  unless the options' `debug` is set (it never is here). That dead work was about 30% of an
  interpreted launch. Here the check is asked for only where `debug` is set, so where it would
  decide something, it still runs.
- **Each module's patch walked once.** To patch a module Triton walks it (inspect.getmembers)
  and wraps each builtin in a new function, at every launch: 13% of an interpreted forward.
  Here the walk's wrappers are kept and set again at the next launch, while the module still
  holds the builtins they wrap; a module changed since (a builtin replaced or added) is walked
  again, and one patched already in this launch is left to Triton's own walk.
- **Integer dots on BLAS.** Triton's interpreter multiplies integer blocks with numpy's integer
  matmul, a plain loop without SIMD: 14% of a full Kimi-size launch. Here a dot whose every
  partial sum stays below 2**53 (int8 operands up to K = 2**39) runs as a float64 matmul,
  exact, then wraps into the accumulator's type as the integer loop does (modulo 2**bits).
- **Types built once, operands shaped once, operand types checked once**: the values each
  operation builds, shared (exactness.suite.interpreter.values).
- **A launch on the same inputs replays its writes**: the same code on the same bytes it read
  writes the same bytes (exactness.suite.interpreter.replay).
- **And so does one in the next process**: launches are kept on disk, named by content
  (exactness.suite.interpreter.store), so a warm `make verify` interprets what changed.

`install()` applies all ten in this process (the suite's device module calls it where the Triton
kernels are interpreted). tests/test_interpreter.py checks that the outputs are the same with
and without, and that the language is as it was after a launch.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

from . import replay as interpreter_replay
from .values import share_checks, share_operands, share_types

__all__ = ["WIDE_FRAME_SLOTS", "float64_dot_is_exact", "install", "installed", "uninstall",
           "wide_frame_runner"]

_originals: list = []  # (Triton's interpreter module, its _patch_lang, its launch, the builder's
# options, the other functions replaced) once installed
WIDE_FRAME_SLOTS = 33_000  # > 256 KiB of slots: the next power-of-two chunk, 512 KiB, keeps
# ~250 KiB (thousands of frames) free above the frame
_launch: dict = {"langs": None, "inner": []}  # the running launch's patched modules and scopes


class _AlreadyPatched:
    """The scope of a helper's call inside a launch that patched its modules: nothing to undo."""

    def restore(self) -> None:
        pass


def wide_frame_runner(slots: int):
    """A function run(call) -> call() whose own frame holds `slots` locals: a frame that big
    starts a frame chunk of its own, and the calls under it stay in that chunk."""
    names = " = ".join(f"_{i}" for i in range(slots))
    source = f"def run(call):\n    if call is None:\n        {names} = None\n    return call()\n"
    scope: dict = {}
    exec(compile(source, "<wide frame>", "exec"), scope)
    return scope["run"]


def installed() -> bool:
    return bool(_originals)


def install() -> bool:
    """From now on in this process: each launch patches a language module once, runs in a wide
    frame, and computes no overflow check whose verdict would be dropped (the module's doc).
    True where it took; a Triton whose interpreter lacks the hooks runs as it is, slower, and
    says so."""
    if _originals:
        return True
    try:
        import inspect

        from triton import language as tl
        from triton.runtime import interpreter
        real = interpreter._patch_lang
        interpreter._LangPatchScope.restore, interpreter.GridExecutor.__call__  # noqa: B018
    except (ImportError, AttributeError) as e:
        warnings.warn(f"the Triton interpreter runs unpatched (slower): its _patch_lang hook "
                      f"is not there ({e})", RuntimeWarning, stacklevel=2)
        return False
    langs_of: dict = {}  # fn -> the language modules its globals see (what real patches)

    def langs(fn) -> frozenset:
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[fn]

    def patch_lang_once(fn):
        patched = _launch["langs"]
        if patched is not None and langs(fn) <= patched:
            return _AlreadyPatched()
        scope = real(fn)
        if patched is not None:  # a helper seeing another module (tl.core): undone at the end
            _launch["langs"] = patched | langs(fn)
            _launch["inner"].append(scope)
            return _AlreadyPatched()
        _launch["langs"], _launch["inner"] = langs(fn), []
        restore = scope.restore

        def restore_all() -> None:
            inner, _launch["langs"], _launch["inner"] = _launch["inner"], None, []
            for each in reversed(inner):
                each.restore()
            restore()

        scope.restore = restore_all
        return scope

    launch = interpreter.GridExecutor.__call__
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    _originals[:] = (interpreter, real, launch, options)
    interpreter._patch_lang = patch_lang_once
    if dataclasses.is_dataclass(options) and \
            {"sanitize_overflow", "debug"} <= {f.name for f in dataclasses.fields(options)}:
        # the check's only consumer, device_assert, returns at once unless debug is set
        builder.options = dataclasses.replace(
            options, sanitize_overflow=options.sanitize_overflow and options.debug)
    in_wide_frame = wide_frame_runner(WIDE_FRAME_SLOTS)

    def launch_in_wide_frame(self, *args, **kwargs):
        return in_wide_frame(lambda: launch(self, *args, **kwargs))

    replayed, watched = interpreter_replay.install(interpreter, tl.core, launch_in_wide_frame)
    interpreter.GridExecutor.__call__ = replayed
    _originals.append(share_types(interpreter, tl.core) + share_operands(interpreter, tl.core)
                      + share_checks(interpreter, tl.core) + _share_patches(interpreter, tl.core)
                      + _blas_integer_dots(interpreter) + watched)
    return True


def float64_dot_is_exact(a, b, acc) -> bool:
    """Whether a float64 matmul of integer arrays a [.., M, K] and b [.., K, N] is exact (every
    partial sum below 2**53) and the accumulator `acc` a signed integer array it can wrap into."""
    largest = _largest_product(a.dtype, b.dtype, acc.dtype)
    return largest is not None and largest * max(1, a.shape[-1]) < 2**53


@functools.cache
def _largest_product(a, b, acc) -> int | None:
    """The largest |x * y| of integer dtypes a and b; None where a dot of these dtypes into
    `acc` is no integer dot a signed accumulator wraps."""
    import numpy as np

    if a.kind not in "iu" or b.kind not in "iu" or acc.kind != "i":
        return None
    magnitudes = [max(-int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in (a, b)]
    return magnitudes[0] * magnitudes[1]


def _blas_integer_dots(interpreter) -> list:
    """Triton's integer dot as a float64 matmul where that is exact (the module's doc):
    [(owner, name, Triton's own)] to put back, empty where this Triton lacks the hook."""
    import numpy as np

    builder = getattr(interpreter, "InterpreterBuilder", None)
    integer_dot = getattr(builder, "create_dot", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if integer_dot is None or handle is None:
        warnings.warn("the Triton interpreter's dots run as it ships (slower): its create_dot "
                      "hook is not there", RuntimeWarning, stacklevel=3)
        return []

    def blas_dot(self, a, b, d, *rest):
        if not float64_dot_is_exact(a.data, b.data, d.data):
            return integer_dot(self, a, b, d, *rest)
        total = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        # int64 holds every sum exactly; the cast to a narrower type wraps, as its loop does
        return handle(total.astype(np.int64).astype(d.data.dtype) + d.data, d.dtype.scalar)

    builder.create_dot = blas_dot
    return [(builder, "create_dot", integer_dot)]


def _share_patches(interpreter, core) -> list:
    """Triton's patch of a language module, its walk and wrappers made once (the module's doc):
    [(owner, name, Triton's own)] to put back, empty where this Triton lacks the hooks."""
    patch_builtin = getattr(interpreter, "_patch_builtin", None)
    is_builtin = getattr(core, "is_builtin", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if patch_builtin is None or is_builtin is None or scope_class is None or \
            not isinstance(getattr(scope_class(), "_changes", None), list):
        warnings.warn("the Triton interpreter walks each module at each launch, as it ships "
                      "(slower): its _patch_builtin hooks are not there", RuntimeWarning,
                      stacklevel=3)
        return []
    own = [(interpreter, "_patch_builtin", patch_builtin)]
    made: dict = {}  # id(module) -> (module, its names, [(name, original, wrapper)])
    codes: set = set()  # the wrappers' code: a module holding one of another walk is patched

    def unpatched(entry, pkg) -> list | None:
        """[(name, wrapper)] of the builtins `pkg` holds unwrapped, as Triton's walk would find
        them: None where `pkg` changed since the entry's walk (or has none)."""
        if entry is None or entry[0] is not pkg:
            return None
        if len(vars(pkg)) != len(entry[1]) and any(  # (Triton adds dunders to tl.tensor)
                is_builtin(v) for k, v in vars(pkg).items() if k not in entry[1]):
            return None
        found = []
        for name, original, wrapper in entry[2]:
            value = getattr(pkg, name, None)
            if value is original:
                found.append((name, wrapper))
            elif value is not wrapper and is_builtin(value):  # a builtin the walk did not see
                return None
        return found

    def shared_patch_builtin(pkg, builder, scope):
        found = unpatched(made.get(id(pkg)), pkg)
        if found is None:
            if any(getattr(v, "__code__", None) in codes for v in vars(pkg).values()):
                return patch_builtin(pkg, builder, scope)  # patched in this launch already
            walk = scope_class()
            patch_builtin(pkg, builder, walk)
            found = [(name, getattr(obj, name)) for obj, name, _ in walk._changes]
            walk.restore()
            codes.update(wrapper.__code__ for _, wrapper in found)
            made[id(pkg)] = (pkg, frozenset(vars(pkg)), [(name, getattr(pkg, name), wrapper)
                                                   for name, wrapper in found])
        for name, wrapper in found:
            scope.set_attr(pkg, name, wrapper)

    interpreter._patch_builtin = shared_patch_builtin
    return own


def uninstall() -> None:
    """The interpreter as Triton ships it again (for the tests that compare)."""
    if _originals:
        interpreter, patch_lang, launch, options, replaced = _originals
        interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, launch
        if options is not None:
            interpreter.interpreter_builder.options = options
        for owner, name, original in replaced:
            setattr(owner, name, original)
        _originals.clear()
