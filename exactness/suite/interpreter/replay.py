"""An interpreted launch on the same inputs as an earlier one replays its writes: the suite's
ninth speed-up of the Triton interpreter (speedups.py installs it), and, through store.py, its
tenth: the next process replays it too.

The suite launches the same kernel on the same bytes again and again: each forward derives its
weights' certificate anew (scales_kernel), two paths quantize the same activations, and the
derandomized examples repeat across tests. About a fifth of the interpreted time in the
equivalence stage was such a repeat.

A launch is a function of what it reads. So where an earlier launch of the same code, grid and
arguments read only argument buffers whose bytes are the same now, running it again would read
the same values, compute the same and write the same bytes; those bytes are written instead.

- **The same code**: the kernel's function and every @triton.jit helper and global it names, by
  identity (a mutant or a planted kernel is new code), and every attribute of the interpreter,
  the language it runs on and its options (a planted Triton is another interpreter).
- **The same arguments**: each scalar by type and value; each tensor by dtype, shape, strides,
  offset and which buffer it views (aliasing included); the grid a tuple of ints. A table of
  addresses (the grouped kernels' experts' weights: interpreter_tables) brings the buffers it points
  at, and its own bytes count by what they point at: each address by buffer and offset.
- **The same reads**: every load and atomic is watched while a launch runs for the first time.
  The bytes it read, as they were before the launch (a BLAKE2 digest a buffer), are the key; a
  buffer's bytes it never read (an output from torch.empty, read only where written) are not:
  a launch that reads the same bytes reads the same places next. A read outside every argument's
  buffer, an atomic other than read-modify-write, a print or an assert leaves the launch out.
- **The same writes**: the bytes each store and atomic wrote, as they stood after the launch,
  are kept and written back; the bytes it did not write keep what they hold.

A launch that raises, has pre-run hooks, a callable grid or a tensor off the CPU runs as before.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import json
import os
import re
import types

from . import store as interpreter_store
from . import tables as interpreter_tables

__all__ = ["BUDGET_BYTES", "install", "stats", "tally"]

BUDGET_BYTES = 256 << 20  # the written bytes (and masks) kept, a process: the oldest go first
_PER_KEY = 4  # launches kept a key (the same code and shapes, other bytes): the newest
_MEMORY = re.compile("load|store|atomic|descriptor|print|assert|poll")
stats = collections.Counter()  # launches: replayed, recalled (from the store), recorded, not
# replayable (for the tests)
_recording: list = [None]  # the running launch's _Reads, while one is watched


class _Reads:
    """What one watched launch reads and writes of its argument buffers."""

    def __init__(self, buffers: list):
        import numpy as np

        order = sorted(range(len(buffers)), key=lambda i: buffers[i][0])  # by address
        self.buffer_at = order  # a position in address order -> the buffer's index
        self.bases = np.array([buffers[i][0] for i in order], dtype=np.uint64)
        self.ends = np.array([buffers[i][0] + buffers[i][1] for i in order], dtype=np.uint64)
        self.read: dict = {}  # buffer -> a bool mask of the bytes read
        self.written: dict = {}  # buffer -> a bool mask of the bytes written
        self.replayable = True

    def note(self, addresses, mask, itemsize: int, read: bool, write: bool) -> None:
        import numpy as np

        if not self.replayable:
            return
        addresses = addresses[np.broadcast_to(mask, addresses.shape)] if mask is not None \
            else addresses.ravel()
        if addresses.size == 0:
            return
        addresses = addresses.astype(np.uint64, copy=False)
        which = np.searchsorted(self.bases, addresses, side="right").astype(np.int64) - 1
        if (which < 0).any() or (addresses + np.uint64(itemsize) >
                                 self.ends[np.maximum(which, 0)]).any():
            self.replayable = False  # a read or write outside every argument's buffer
            return
        for position in np.unique(which).tolist():
            index = self.buffer_at[position]
            offsets = (addresses[which == position] - self.bases[position]).astype(np.int64)
            size = int(self.ends[position] - self.bases[position])
            touched = (offsets[:, None] + np.arange(itemsize)).ravel()
            for noted, masks in ((read, self.read), (write, self.written)):
                if noted:
                    masks.setdefault(index, np.zeros(size, bool))[touched] = True


# where each watched operation's pointers and mask are among its arguments (after self), and
# whether it reads, writes
_WATCHED = {"create_masked_load": (0, 1, True, False), "create_masked_store": (0, 2, False, True),
            "create_atomic_rmw": (1, 3, True, True)}


def _watched(original, name: str):
    """A builder memory operation that notes its addresses while a launch is watched."""
    from triton.runtime import interpreter

    at_ptrs, at_mask, reads_memory, writes_memory = _WATCHED[name]

    def operation(self, *args):
        reads = _recording[0]
        if reads is not None:
            ptrs, mask = args[at_ptrs], args[at_mask]
            itemsize = interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize
            reads.note(ptrs.data, None if mask is None else mask.data, itemsize,
                       read=reads_memory, write=writes_memory)
        return original(self, *args)

    return operation


def _unreplayable(original):
    def operation(self, *args, **kwargs):
        if _recording[0] is not None:
            _recording[0].replayable = False
        return original(self, *args, **kwargs)

    return operation


def _code_of(fn, seen: dict) -> None:
    """Every global `fn` names, into `seen` (id -> object): through the @triton.jit helpers and
    functions it calls, and the attributes it reads of the modules and classes it names, and of
    theirs in turn (`a.b.c`), but not Triton's, numpy's or torch's: those are the interpreter's,
    compared whole."""
    names = _names(fn.__code__)
    found = [fn.__globals__[name] for name in names if name in fn.__globals__]
    walked: set = set()
    for value in found:  # (grows: a namespace's attributes are walked in turn)
        if _namespace(value) and id(value) not in walked:
            walked.add(id(value))
            attributes = vars(value)
            found += [attributes[name] for name in names if name in attributes]
    for value in found:
        # a @triton.jit helper keeps its function in .fn
        for each in (value, getattr(value, "fn", None)):
            if each is None or id(each) in seen:
                continue
            seen[id(each)] = each
            if isinstance(each, types.FunctionType):
                _code_of(each, seen)


def _names(code: types.CodeType) -> set:
    """The names a code object reads, its nested code's (a comprehension's) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if type(const) is types.CodeType:
            names |= _names(const)
    return names


def _namespace(value) -> bool:
    """A module or class whose attributes a kernel may read (a constant, a helper), not one of
    the interpreter's libraries."""
    if isinstance(value, types.ModuleType):
        owner = value.__name__
    elif isinstance(value, type):
        owner = value.__module__ or ""
    else:
        return False
    return owner.partition(".")[0] not in interpreter_store.LIBRARIES


def _same_code(fn, owners: tuple) -> tuple:
    """(the identities the launch's code and interpreter are made of, those objects)."""
    seen: dict = {id(fn): fn}
    _code_of(fn, seen)
    objects = (tuple(seen.values()),) + tuple(tuple(vars(o).values()) for o in owners)
    return tuple(tuple(map(id, made)) for made in objects), objects


def tally() -> dict:
    """This process's interpreted launches: run, replayed (from memory), recalled (the store)."""
    return {"run": stats["recorded"] + stats["not replayable"], "replayed": stats["replayed"],
            "recalled": stats["recalled"]}


def _write_tally(path: str) -> None:
    if any(tally().values()):
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.write(json.dumps(tally()) + "\n")


def install(interpreter, core, run_launch) -> tuple:
    """A launch function (self, *args, **kwargs) that replays where it may and else calls
    run_launch(self, *args, **kwargs), and [(owner, name, Triton's own)] to put back. Where
    EXACTNESS_LAUNCH_TALLY names a file, the process adds its tally() to it as it exits (make
    verify's report)."""
    import numpy as np
    import torch

    if os.environ.get("EXACTNESS_LAUNCH_TALLY"):  # once, however often installed
        atexit.unregister(_write_tally)
        atexit.register(_write_tally, os.environ["EXACTNESS_LAUNCH_TALLY"])

    builder_class = interpreter.InterpreterBuilder
    own = []
    for name in dir(builder_class):
        original = getattr(builder_class, name)
        if not name.startswith("create_") or not _MEMORY.search(name) or \
                name in ("create_load", "create_store"):  # these two call the masked ones
            continue
        own.append((builder_class, name, original))
        setattr(builder_class, name, _watched(original, name) if name in _WATCHED
                else _unreplayable(original))
    own += interpreter_tables.install()
    import triton.language as tl

    semantics = [c for c in type(interpreter.interpreter_semantic).__mro__ if c is not object]
    # the interpreter's and the language's modules and every class they define (a method
    # planted in one is another interpreter)
    classes = [v for module in (interpreter, core) for v in vars(module).values()
               if isinstance(v, type) and v.__module__ == module.__name__]
    owners = tuple(dict.fromkeys((interpreter, *semantics, tl, core, tl.math, tl.standard,
                                  builder_class, *classes)))
    launches: collections.OrderedDict = collections.OrderedDict()  # key -> [entry]
    pinned: dict = {}  # the code's identities -> (that tuple, its objects, kept alive: ids stay
    # unique); every key holds the one tuple (thousands of ids) of its code
    held = [0]

    def owners_now() -> tuple:
        return owners + (interpreter.interpreter_builder.options,)

    def code_of(self) -> tuple:
        """The launch's code and interpreter as one tuple of identities, the same tuple for the
        same code (every key holds it); the builder's options by their values, being replaced
        (debug) between launches."""
        code, objects = _same_code(self.fn, owners_now())
        return pinned.setdefault(code, (code, objects))[0]

    def key_of(self, args: tuple, kwargs: dict):
        """(key, buffers) of a launch, None where it runs as before."""
        grid = self.grid
        if self.pre_run_hooks or not isinstance(grid, tuple) or \
                not all(type(g) is int for g in grid):
            return None
        values, buffers, where, tables = [], [], {}, set()

        def buffer_of(tensor) -> int:
            storage = tensor.untyped_storage()
            at = where.setdefault(storage.data_ptr(), len(buffers))
            if at == len(buffers):
                buffers.append((storage.data_ptr(), storage.nbytes(), storage))
            return at

        for name, value in [(None, a) for a in args] + sorted(kwargs.items()):
            if type(value) in (torch.Tensor, torch.nn.Parameter):
                if value.device.type != "cpu":
                    return None
                at = buffer_of(value)
                values.append((name, at, value.dtype, tuple(value.shape), value.stride(),
                               value.storage_offset()))
                tensors = interpreter_tables.pointed_by(value)
                if tensors is not None:  # a table of addresses: the tensors it points at too
                    if any(t is None or t.device.type != "cpu" for t in tensors):
                        return None
                    tables.add(at)
                    values.append(("points at", tuple(buffer_of(t) for t in tensors)))
            elif value is None or type(value) in (int, float, bool, str) or \
                    isinstance(value, (core.dtype, torch.dtype)):
                values.append((name, type(value).__name__, repr(value)))
            elif type(value) is core.constexpr:
                values.append((name, "constexpr", repr(value.value)))
            else:
                return None
        sizes = tuple(b[1] for b in buffers)
        return (code_of(self), grid, tuple(values), sizes), (buffers, tables)

    def replay(entry, buffers) -> None:
        for index, mask, values in entry[1]:
            view = _bytes_of(buffers[index][2])
            if mask is None:
                view[:] = values
            else:
                view[np.unpackbits(mask, count=view.size).view(bool)] = values

    def launch(self, *args, **kwargs):
        found = key_of(self, args, kwargs)
        if found is None:
            stats["not replayable"] += 1
            return run_launch(self, *args, **kwargs)
        key, (buffers, tables) = found
        digests: dict = {}

        def digest(index: int) -> bytes:
            if index not in digests:
                digests[index] = _digest(buffers[index][2]) if index not in tables else \
                    interpreter_tables.digest(_bytes_of(buffers[index][2]), buffers)
            return digests[index]

        def same(index: int, mask, wanted: bytes) -> bool:
            """Whether the bytes of buffer `index` that `mask` (packed; None: all) selects are
            the ones a digest `wanted` was taken of."""
            if mask is None:
                return digest(index) == wanted
            view = _bytes_of(buffers[index][2])
            return _digest(view[np.unpackbits(mask, count=view.size).view(bool)]) == wanted

        for entry in launches.get(key, ()):
            if all(same(*read) for read in entry[0]):
                launches.move_to_end(key)
                replay(entry, buffers)
                stats["replayed"] += 1
                return None
        store = interpreter_store.default_store()
        name = store.name(key[0], pinned[key[0]][1], owners_now(), key[1:])
        entry = None if name is None else store.find(name, same)
        if entry is not None:
            keep(key, entry)
            replay(entry, buffers)
            stats["recalled"] += 1
            return None
        # the bytes as they were: a launch may write what it read
        before = [None if i in tables else _bytes_of(b[2]).copy() for i, b in enumerate(buffers)]
        reads = _Reads([(b[0], b[1]) for b in buffers])
        _recording[0] = reads
        try:
            result = run_launch(self, *args, **kwargs)
        finally:
            _recording[0] = None
        if not reads.replayable:
            stats["not replayable"] += 1
            return result
        writes = []
        for index, mask in sorted(reads.written.items()):
            view = _bytes_of(buffers[index][2])
            whole = bool(mask.all())
            writes.append((index, None if whole else np.packbits(mask),
                           view.copy() if whole else view[mask]))
        read = []
        for index, mask in sorted(reads.read.items()):
            if index in tables:  # a table by what it points at, whole
                read.append((index, None, digest(index)))
            elif mask.all():
                read.append((index, None, digests.get(index) or _digest(before[index])))
            else:  # these bytes only (an output of torch.empty, read where it was written)
                read.append((index, np.packbits(mask), _digest(before[index][mask])))
        entry = (tuple(read), tuple(writes), interpreter_store.held_bytes(read, writes))
        # Triton's first launch adds to its classes: a launch that changed its code is not kept
        # here (its key is gone), but stored (the next process starts from the same code)
        if code_of(self) is key[0]:
            keep(key, entry)
        if name is not None:
            store.save(name, entry)
        stats["recorded"] += 1
        return result

    def keep(key, entry) -> None:
        kept = launches.setdefault(key, [])
        kept.insert(0, entry)
        held[0] += entry[2]
        for dropped in kept[_PER_KEY:]:
            held[0] -= dropped[2]
        del kept[_PER_KEY:]
        while held[0] > BUDGET_BYTES and launches:
            _, oldest = launches.popitem(last=False)
            held[0] -= sum(e[2] for e in oldest)

    return launch, own


def _digest(storage) -> bytes:
    """A storage's bytes (or a numpy array's), as a 128-bit BLAKE2 digest."""
    data = storage if hasattr(storage, "__array_interface__") else _bytes_of(storage)
    return hashlib.blake2b(data, digest_size=16).digest()


def _bytes_of(storage):
    """A writable uint8 numpy view of a torch storage's bytes, by its address (no tensor method:
    to the suite's spies a launch reads nothing back)."""
    import ctypes

    import numpy as np

    size = storage.nbytes()
    if size == 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(storage.data_ptr()))
