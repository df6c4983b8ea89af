"""The values the Triton interpreter builds at each operation, built once and shared: three of
the suite's speed-ups (speedups.py installs them), its arithmetic untouched.

- **Types built once.** Each interpreted operation builds its result's types anew: a block type
  (its shape validated, its name formatted), a tensor's shape as a tuple of constexprs, and the
  numpy dtype, looked up in a dict built at every call. Here each is built once per distinct
  type and its values shared, the same values: about 20% of an interpreted launch.
- **Operands shaped once.** Before each binary operation Triton's semantics broadcast both
  operands: blocks of one shape too (each to its own shape, a copy of the same values), and a
  scalar by filling a new block with it (about half of the operations add a constant). Here equal
  shapes are left as they are, and each scalar's block (by its bits, type and shape) is filled
  once and shared, read-only, so a write into it would raise rather than change a neighbour.
  Blocks of other shapes ([M, 1] with [1, N]) take their result's types from Triton's own
  answer once per pair of operand types, and are widened as Triton widens them.
- **Operand types checked once.** Before that, the semantics find the operation's type (the
  promotion rules), cast both operands to it and range-check a Python int (with the broadcast,
  30% of a launch under cProfile). Two tensors of one integer, float32 or float64 type need none
  of it and are returned as they are. A tensor and a Python int (`x + 1`) take Triton's own
  answer the first time, and its constant is shared, read-only, keyed by the tensor's type, the
  int, its side and the flags.

Each is compared with Triton's own at install, on sample operands, and left out, saying so,
where it differs (another Triton).
"""

from __future__ import annotations

import warnings

__all__ = ["replaced_where_alike", "share_checks", "share_operands", "share_types"]


def share_types(interpreter, core) -> list:
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

    return replaced_where_alike(
        own, (shared_np_dtype, shared_block_init, shared_tensor_init, shared_tuple_eq), sample,
        "builds its types")


def share_operands(interpreter, core) -> list:
    """The interpreter's broadcasting of a binary operation's operands, shortened (the module's
    doc): [(owner, name, Triton's own)] to put back, empty where the shortcut would differ."""
    semantic_class, block_type = interpreter.TritonSemantic, core.block_type
    broadcast = semantic_class.broadcast_impl_value
    own = [(semantic_class, "broadcast_impl_value", broadcast)]
    builder = interpreter.interpreter_builder
    splats: dict = {}  # (the scalar's type and bits, the block's shape) -> its block, read-only
    shapes: dict = {}  # two blocks' (element type, shape) -> each one's type after broadcasting,
    # None where Triton returns it as it is

    def shared_broadcast(self, lhs, rhs):
        left, right = type(lhs.type) is block_type, type(rhs.type) is block_type
        if self.builder is not builder:  # a compile, not the interpreter: Triton's own
            return broadcast(self, lhs, rhs)
        if left and right:
            if lhs.type.shape == rhs.type.shape:
                return lhs, rhs  # Triton broadcasts each to the shape it has: the same values
            return broadcast_blocks(self, lhs, rhs)
        if not left and not right:  # two scalars
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

    def type_key(ty):
        """An element type as a dict key: a pointer's (unhashable) by what its __eq__ compares."""
        if type(ty) is not core.pointer_type:
            return ty
        if type(ty.element_ty) is core.pointer_type:
            raise TypeError("a pointer to pointers")  # rare: Triton's own builds it
        return core.pointer_type, ty.element_ty, ty.address_space, ty.const

    def broadcast_blocks(self, lhs, rhs):
        """Blocks of other shapes: each widened as Triton widens it (new leading axes, then
        numpy's broadcast), the result's type found by Triton's own once per pair of types."""
        try:
            key = (type_key(lhs.type.element_ty), lhs.type.shape, type_key(rhs.type.element_ty),
                   rhs.type.shape)
            made = shapes.get(key)
        except TypeError:  # an unhashable type
            return broadcast(self, lhs, rhs)
        if made is None:
            out = broadcast(self, lhs, rhs)
            shapes[key] = tuple(None if o is i else o.type
                                for o, i in zip(out, (lhs, rhs), strict=True))
            return out
        return tuple(i if ty is None else core.tensor(interpreter.TensorHandle(
            widened(i.handle.data, ty.shape), i.handle.dtype.scalar), ty)
                     for i, ty in zip((lhs, rhs), made, strict=True))

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
                     (tensor(1, block_type(i32, [1, 2])), tensor(2, block_type(i32, [4, 1]))),
                     (tensor(4, block_type(i32, [2])), tensor(-2, block_type(i32, [8, 2]))),
                     (tensor(1.5, block_type(f32, [2, 2])), tensor(6, block_type(i32, [2, 1]))),
                     (tensor(5, block_type(i32, [1, 4, 1])), tensor(8, block_type(i32, [4, 2]))),
                     (tensor(64, block_type(core.pointer_type(i32), [4, 1])),
                      tensor(3, block_type(i32, [1, 2])))):
            for _ in range(2):  # the second time from the shared splats and types
                for t in semantic.broadcast_impl_value(a, b):
                    made.append((t.type, t.handle.dtype, t.handle.data.dtype.str,
                                 t.handle.data.shape, t.handle.data.tobytes()))
        return made

    return replaced_where_alike(own, (shared_broadcast,), sample, "broadcasts operands")


def widened(data, shape: tuple):
    """`data` as Triton's interpreter broadcasts it to `shape`: leading axes of 1 added (a view,
    as np.expand_dims makes), then np.broadcast_to where a size still differs."""
    import numpy as np

    if data.ndim < len(shape):
        data = data.reshape((1,) * (len(shape) - data.ndim) + data.shape)
    return data if data.shape == shape else np.broadcast_to(data, shape)


def share_checks(interpreter, core) -> list:
    """The type checks of a binary operation's operands, shortened (the module's doc): [(owner,
    name, Triton's own)] to put back, empty where the shortcut would differ."""
    semantic_class, tensor = interpreter.TritonSemantic, core.tensor
    check = semantic_class.binary_op_type_checking_impl
    own = [(semantic_class, "binary_op_type_checking_impl", check)]
    builder = interpreter.interpreter_builder
    constants: dict = {}  # (the tensor's type, the int, its side, the flags) -> Triton's constant

    def shared_check(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                     arithmetic_check=True, div_or_mod=False):
        flags = (allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        if self.builder is not builder:  # a compile, not the interpreter: Triton's own
            return check(self, lhs, rhs, *flags)
        left, right = type(lhs), type(rhs)
        if left is tensor and right is tensor:
            ty = lhs.dtype
            if (ty.is_int() or ty.is_fp32() or ty.is_fp64()) and lhs.type == rhs.type:
                return lhs, rhs  # one type: no promotion, no cast, no broadcast
            return check(self, lhs, rhs, *flags)
        if not (left is tensor and right is int or left is int and right is tensor):
            return check(self, lhs, rhs, *flags)
        value, ty = (rhs, lhs.type) if left is tensor else (lhs, rhs.type)
        if ty.scalar.is_ptr():
            return check(self, lhs, rhs, *flags)
        key = (ty.scalar.name, ty.shape if ty.is_block() else None, value, left is tensor, flags)
        made = constants.get(key)
        if made is None:
            made = check(self, lhs, rhs, *flags)  # raises as Triton does (a value out of range)
            side = 1 if left is tensor else 0
            if made[1 - side] is not (lhs, rhs)[1 - side]:  # the tensor changed: not shared
                return made
            made[side].handle.data.flags.writeable = False
            if len(constants) > 4096:
                constants.clear()
            constants[key] = made[side]
            return made
        return (lhs, made) if left is tensor else (made, rhs)

    def sample() -> list:
        """What the checks make of a few operand pairs, as comparable values."""
        import numpy as np

        made = []
        for ty in (core.int1, core.int8, core.int32, core.int64, core.uint32, core.float32,
                   core.float64, core.float16):
            for shape in ([4, 2], None):
                block = core.block_type(ty, shape) if shape else ty
                data = np.ones(shape or (1,), dtype=interpreter._get_np_dtype(ty))
                a, b = (core.tensor(interpreter.TensorHandle(data, ty), block) for _ in "ab")
                for flags in ((False, False, True, False), (False, False, True, True),
                              (False, False, False, False)):
                    ints = (0, 5, -7, 300) + ((2**31 - 1, -2**63) if ty.is_int() else ())
                    pairs = [(a, b), (3, a)] + [(a, v) for v in ints]
                    for lhs, rhs in pairs:
                        for _ in range(2):  # the second time from the shared constants
                            try:
                                out = interpreter.interpreter_semantic.\
                                    binary_op_type_checking_impl(lhs, rhs, *flags)
                            except (TypeError, ValueError) as e:
                                made.append(repr(e))
                                continue
                            made.append([(t is lhs, t is rhs, str(t.type), t.handle.data.dtype.str,
                                          t.handle.data.shape, t.handle.data.tobytes())
                                         for t in out])
        return made

    return replaced_where_alike(own, (shared_check,), sample, "checks operand types")


def replaced_where_alike(own: list, replacements: tuple, sample, ships: str) -> list:
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
