"""The Triton interpreter made faster for the suite, in five ways, its arithmetic untouched.

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
- **Types built once.** Each interpreted operation builds its result's types anew: a block type
  (its shape validated, its name formatted), a tensor's shape as a tuple of constexprs, and the
  numpy dtype, looked up in a dict built at every call. Here each is built once per distinct
  type and its values shared, the same values: about 20% of an interpreted launch. The shared
  builders are compared with Triton's own at install, and left out, saying so, where they differ
  (another Triton).

- **Operands shaped once.** Before each binary operation Triton's semantics broadcast both
  operands: blocks of one shape too (each to its own shape, a copy of the same values), and a
  scalar by filling a new block with it (about half of the operations add a constant). Here equal
  shapes are left as they are, and each scalar's block (by its bits, type and shape) is filled
  once and shared, read-only, so a write into it would raise rather than change a neighbour.

`install()` applies all five in this process (the suite's device module calls it where the Triton
kernels are interpreted). tests/test_interpreter.py checks that the outputs are the same with
and without, and that the language is as it was after a launch.
"""

from __future__ import annotations

import dataclasses
import warnings

__all__ = ["WIDE_FRAME_SLOTS", "install", "installed", "uninstall", "wide_frame_runner"]

_originals: list = []  # (Triton's interpreter module, its _patch_lang, its launch, the builder's
# options, the type builders replaced) once installed
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

    interpreter.GridExecutor.__call__ = launch_in_wide_frame
    _originals.append(_share_types(interpreter, tl.core) + _share_operands(interpreter, tl.core))
    return True


def _share_types(interpreter, core) -> list:
    """Triton's type builders replaced by ones that build each distinct type once (the module's
    doc): [(owner, name, Triton's own)] to put back, empty where the shared ones would differ."""
    import builtins
    import math

    block_type, tensor, ttuple, constexpr = core.block_type, core.tensor, core.tuple, core.constexpr
    own = [(interpreter, "_get_np_dtype", interpreter._get_np_dtype),
           (block_type, "__init__", block_type.__init__), (tensor, "__init__", tensor.__init__),
           (ttuple, "__eq__", ttuple.__eq__)]
    np_dtype, block_init, _, tuple_eq = (f for _, _, f in own)
    dtypes: dict = {}  # a scalar type -> its numpy dtype (a block's is its element's)
    blocks: dict = {}  # (class, element type, shape) -> a block type's attributes
    shapes: dict = {}  # id(a block's shape) -> (numel, constexpr dims, their tuple type, shape)

    def shared_np_dtype(ty):
        key = ty.element_ty if type(ty) is block_type else ty
        try:
            return dtypes[key]
        except KeyError:
            found = dtypes[key] = np_dtype(ty)
            return found
        except TypeError:  # an unhashable type
            return np_dtype(ty)

    def shared_block_init(self, element_ty, shape):
        try:
            key = (type(self), element_ty, builtins.tuple(
                d.value if type(d) is constexpr else d for d in shape))
            built = blocks.get(key)
        except TypeError:  # an unhashable element type or shape: built as Triton builds it
            key = built = None
        if built is None:
            block_init(self, element_ty, shape)  # validated there: a bad shape raises as before
            if key is not None:
                blocks[key] = dict(vars(self))
        else:
            vars(self).update(built)

    def shared_tensor_init(self, handle, type):
        self.handle, self.type, self.dtype = handle, type, type.scalar
        shape = type.shape if type.is_block() else ()
        built = shapes.get(id(shape))
        if built is None or built[3] is not shape:
            if len(shapes) > 4096:  # shapes of unshared block types: keep none of them alive
                shapes.clear()
            dims = [constexpr(d) for d in shape]
            built = shapes[id(shape)] = (constexpr(math.prod(shape)), dims,
                                         core._type_for_tuple_values(dims), shape)
        self.numel, self.shape = built[0], ttuple(built[1], built[2])

    def shared_tuple_eq(self, other):  # a shape against a list of ints: no normalising walk
        if type(other) is list and all(type(v) is int for v in other):
            return constexpr(self.values == other)
        return tuple_eq(self, other)

    def sample() -> list:
        """What the builders make of a few types, as comparable values."""
        made = []
        for element, shape in ((core.float32, [16, 2]), (core.int8, [constexpr(4)]),
                               (core.pointer_type(core.int32), [8])):
            block = block_type(element, shape)
            for ty in (block, element):
                t = tensor(None, ty)
                made.append((sorted(vars(t)), t.type, list(t.shape), t.numel.value,
                             [d.type for d in t.shape], t.shape.type.fields,
                             (t.shape == list(block.shape)).value,
                             (t.shape == [3]).value, interpreter._get_np_dtype(ty)))
            made.append((sorted(vars(block)), list(block.shape), block.numel, block.name))
        return made

    return _replaced_where_alike(
        own, (shared_np_dtype, shared_block_init, shared_tensor_init, shared_tuple_eq), sample,
        "builds its types")


def _share_operands(interpreter, core) -> list:
    """The interpreter's broadcasting of a binary operation's operands, shortened (the module's
    doc): [(owner, name, Triton's own)] to put back, empty where the shortcut would differ."""
    semantic_class, block_type = interpreter.TritonSemantic, core.block_type
    broadcast = semantic_class.broadcast_impl_value
    own = [(semantic_class, "broadcast_impl_value", broadcast)]
    builder = interpreter.interpreter_builder
    splats: dict = {}  # (the scalar's type and bits, the block's shape) -> its block, read-only

    def shared_broadcast(self, lhs, rhs):
        left, right = type(lhs.type) is block_type, type(rhs.type) is block_type
        if self.builder is not builder:  # a compile, not the interpreter: Triton's own
            return broadcast(self, lhs, rhs)
        if left and right and lhs.type.shape == rhs.type.shape:
            return lhs, rhs  # Triton broadcasts each to the shape it has: the same values
        if left == right:  # two scalars, or blocks of other shapes
            return broadcast(self, lhs, rhs)
        scalar, block = (rhs, lhs) if left else (lhs, rhs)
        data = scalar.handle.data
        try:
            key = (scalar.type, data.dtype.str, data.shape, data.tobytes(), block.type.shape)
            splat = splats.get(key)
        except TypeError:  # an unhashable type: built as Triton builds it
            return broadcast(self, lhs, rhs)
        if splat is None:
            splat = broadcast(self, lhs, rhs)[1 if left else 0]
            splat.handle.data.flags.writeable = False
            if len(splats) > 4096:  # scalars read at run time (pointers, indices): keep few
                splats.clear()
            splats[key] = splat
        return (lhs, splat) if left else (splat, rhs)

    def sample() -> list:
        """What broadcasting makes of a few operand pairs, as comparable values."""
        import numpy as np

        def tensor(value, ty):
            shape = ty.shape if type(ty) is block_type else (1,)
            scalar = ty.element_ty if type(ty) is block_type else ty
            data = np.full(shape, value, dtype=interpreter._get_np_dtype(scalar))
            return core.tensor(interpreter.TensorHandle(data, scalar), ty)

        semantic, made = interpreter.interpreter_semantic, []
        i32, f32 = core.int32, core.float32
        for a, b in ((tensor(3, block_type(i32, [4, 2])), tensor(-5, block_type(i32, [4, 2]))),
                     (tensor(7, block_type(i32, [4, 2])), tensor(-1, i32)),
                     (tensor(-0.0, f32), tensor(2.5, block_type(f32, [2]))),
                     (tensor(0.0, f32), tensor(2.5, block_type(f32, [2]))),
                     (tensor(1, block_type(i32, [1, 2])), tensor(2, block_type(i32, [4, 1])))):
            for _ in range(2):  # the second time from the shared splats
                for t in semantic.broadcast_impl_value(a, b):
                    made.append((t.type, t.handle.dtype, t.handle.data.dtype.str,
                                 t.handle.data.shape, t.handle.data.tobytes()))
        return made

    return _replaced_where_alike(own, (shared_broadcast,), sample, "broadcasts operands")


def _replaced_where_alike(own: list, replacements: tuple, sample, ships: str) -> list:
    """Triton's `own` [(owner, name, original)] replaced by `replacements` where `sample()` makes
    the same values with both: `own`, to put back. Else Triton's kept, a warning saying the
    interpreter `ships` as it ships and why, and []."""
    try:
        expected = sample()
        for (owner, name, _), replacement in zip(own, replacements, strict=True):
            setattr(owner, name, replacement)
        if sample() == expected:
            return own
        why = "they make other values than this Triton's own"
    except Exception as e:  # noqa: BLE001 - any fault of the replacements leaves Triton's own
        why = f"they fail on this Triton ({type(e).__name__}: {e})"
    for owner, name, original in own:
        setattr(owner, name, original)
    warnings.warn(f"the Triton interpreter {ships} as it ships (slower): {why}", RuntimeWarning,
                  stacklevel=4)
    return []


def uninstall() -> None:
    """The interpreter as Triton ships it again (for the tests that compare)."""
    if _originals:
        interpreter, patch_lang, launch, options, types = _originals
        interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, launch
        if options is not None:
            interpreter.interpreter_builder.options = options
        for owner, name, original in types:
            setattr(owner, name, original)
        _originals.clear()
