"""Interpreted launches kept on disk, so that the next process replays them too: the suite's tenth
speed-up of the Triton interpreter (exactness.suite.interpreter.replay consults it).

A replayed launch (interpreter_replay) is a function of its code, its arguments and the bytes it
read. In one process its code is named by identity. Here it is named by content, so that another
process, or the next `make verify`, finds it: the derandomized examples, the seeded data and
every mutant's code are the same from one run to the next, and a warm run interprets only what
changed.

- **The code by content**: the kernel and each helper and global it names, as _code_of finds
  them: a function by its bytecode, constants, names, defaults and closure (never its line
  numbers, never marshal's bytes, which vary with reference counts), a constexpr or a number by
  its value. A global of another kind leaves the launch to this process alone. And each
  function, module and class by the source file it came from, whole: a constant the walk
  above missed (a class's attribute, a module's) still names another launch.
- **The interpreter by content**: every attribute of the interpreter, the language and the
  builder's options, described the same way (a planted operation is another interpreter); the
  source files of Triton and of the suite's interpreter speed-ups; numpy's, torch's and
  Python's versions and numpy's CPU features.
- **The rest as in memory**: the grid, the arguments' types and shapes, the digests of the
  buffers read before the launch, the bytes written.

An entry is one file, written whole (a temporary file renamed) and checked by its own digest on
reading: a torn or altered file is a miss, and is removed. The store lives in the kernels' private
cache ($XDG_CACHE_HOME/exactness/launches, exactness.kernels.toolchain.cache_dir), up to
BUDGET_BYTES, the least recently used going first. EXACTNESS_LAUNCH_STORE=off keeps every launch
in its process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import struct
import sys
import time
import types
from pathlib import Path

__all__ = ["BUDGET_BYTES", "LIBRARIES", "Store", "content", "default_store", "held_bytes"]

BUDGET_BYTES = 2 << 30  # the store's files, all together: pruned to 3/4 of it when over
_MAGIC = b"exactness-launch-2\n"
_PRUNE_EVERY_S = 3600  # how often a process looks at the store's size
LIBRARIES = ("triton", "numpy", "torch")  # the interpreter's: named by version and _environment
_SUITE_FILES = ("__init__.py", "speedups.py", "values.py", "replay.py", "store.py", "tables.py")


class Unnamed(Exception):
    """A value this module cannot name by content: its launch stays in its process."""


def content(value, strict: bool, depth: int = 0) -> str:
    """`value` as text that is the same in every process where it would compute the same: the
    module's doc. strict: a value of an unknown kind raises Unnamed (a kernel's global); else it
    is named by its type (an interpreter's instance: its class is described where it matters)."""
    kind = type(value)
    if value is None or kind in (int, float, bool, str, bytes, complex):
        return f"{kind.__name__}:{value!r}"
    if depth > 6:
        if strict:
            raise Unnamed(f"too deep: {kind.__qualname__}")
        return f"deep:{kind.__qualname__}"
    more = functools.partial(content, strict=strict, depth=depth + 1)
    if kind is types.FunctionType:
        closure = [more(c.cell_contents) if _filled(c) else "empty"
                   for c in value.__closure__ or ()]
        defaults = [more(d) for d in value.__defaults__ or ()]
        keywords = [f"{k}={more(v)}" for k, v in sorted((value.__kwdefaults__ or {}).items())]
        return (f"fn:{value.__module__}:{_source(value.__module__, value.__code__.co_filename)}:"
                f"{_code(value.__code__)}:{defaults}{keywords}{closure}")
    if kind is types.CodeType:
        return _code(value)
    if kind in (list, set) and not strict:  # (the interpreter's state: a cache, a count)
        return f"object:{kind.__name__}"
    if kind in (tuple, list):
        return f"{kind.__name__}:[{','.join(more(v) for v in value)}]"
    if kind in (frozenset, set):
        return f"{kind.__name__}:[{','.join(sorted(more(v) for v in value))}]"
    if kind is types.ModuleType:
        file = getattr(value, "__file__", None)
        return f"module:{value.__name__}:{_source(value.__name__, file)}"
    if isinstance(value, type):
        module = sys.modules.get(value.__module__)
        return (f"class:{value.__module__}.{value.__qualname__}:"
                f"{_source(value.__module__, getattr(module, '__file__', None))}")
    if kind in (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
                types.MethodDescriptorType, types.GetSetDescriptorType):
        return f"builtin:{getattr(value, '__module__', None)}.{value.__qualname__}"
    if kind in (staticmethod, classmethod):
        return f"{kind.__name__}:{more(value.__func__)}"
    if kind is types.MethodType:
        return f"method:{more(value.__func__)}:{content(value.__self__, strict, depth + 1)}"
    if kind is property:
        return f"property:{more(value.fget)}:{more(value.fset)}"
    if kind is functools.partial:
        keywords = tuple(sorted(value.keywords.items()))
        return f"partial:{more(value.func)}:{more(value.args)}:{more(keywords)}"
    name = f"{kind.__module__}.{kind.__qualname__}"
    if type(getattr(value, "fn", None)) is types.FunctionType and name.startswith("triton."):
        # @triton.jit (interpreted: rewritten from its source, as its function was compiled)
        options = tuple(sorted(getattr(value, "kwargs", {}).items()))
        return f"jit:{name}:{more(value.fn)}:{more(options)}"
    if name == "triton.language.core.constexpr":
        return f"constexpr:{more(value.value)}"
    if name.startswith("triton.language.core.") and "dtype" in kind.__qualname__:
        return f"dtype:{name}:{value!r}"
    if name in ("torch.dtype", "numpy.dtype"):
        return f"{name}:{value}"
    if dataclasses.is_dataclass(value):
        return f"data:{name}:" + more(tuple((f.name, getattr(value, f.name))
                                            for f in dataclasses.fields(value)))
    if strict and not name.startswith("triton."):  # (Triton's: the interpreter's, named whole)
        raise Unnamed(f"a global of type {name}")
    return f"object:{name}"


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _source(module: str | None, path: str | None) -> str:
    """The Python source file of something of `module` by content ("" for none: code compiled
    from a string, an extension module, or a library's file, which _environment and the versions
    name)."""
    if (module or "").partition(".")[0] in LIBRARIES or not path or not path.endswith(".py"):
        return ""
    return _file_digest(path)


@functools.cache
def _file_digest(path: str) -> str:
    try:
        return hashlib.blake2b(Path(path).read_bytes(), digest_size=8).hexdigest()
    except OSError:
        return ""


@functools.lru_cache(maxsize=4096)
def _code(code: types.CodeType) -> str:
    """A code object's meaning: its bytecode (unspecialized), constants and names; not its lines."""
    consts = [_code(c) if type(c) is types.CodeType else content(c, strict=False)
              for c in code.co_consts]
    return repr((code.co_qualname, code.co_code, consts, code.co_names, code.co_varnames,
                 code.co_freevars, code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
                 code.co_kwonlyargcount, code.co_flags, code.co_exceptiontable))


@functools.cache
def _environment() -> str:
    """The interpreter's own making: its source files and the suite's, and the versions below."""
    import numpy as np
    import torch
    import triton

    digest = hashlib.blake2b(digest_size=16)
    roots = [Path(triton.__file__).parent]
    files = sorted(p for root in roots for p in root.rglob("*.py"))
    here = Path(__file__).parent
    for path in files + [here / name for name in _SUITE_FILES]:
        digest.update(str(path.name).encode() + b"\0" + path.read_bytes() + b"\0")
    features = getattr(np, "_core", getattr(np, "core", None))
    cpu = sorted(getattr(getattr(features, "_multiarray_umath", None), "__cpu_features__",
                         {}).items())
    return repr((digest.hexdigest(), triton.__version__, np.__version__, torch.__version__,
                 sys.version, sys.platform, cpu))


class Store:
    """Launches on disk, one file an entry, in `directory`/<key>/<reads>. Every method is quiet:
    a store that cannot be read or written is a miss, never an error of the launch."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self._names: dict = {}  # id(code tuple) -> (it, its content's digest or None: unnamed)

    def name(self, code: tuple, objects: tuple, owners: tuple, rest) -> str | None:
        """The file name of a launch's key (code identities, their objects, the interpreter's
        owners, and the rest of the key by value); None where its code has no name by content."""
        if self.directory is None:
            return None
        if id(code) not in self._names:  # (held with its name: its id is no other's)
            self._names[id(code)] = code, _code_name(objects[0], owners)
        named = self._names[id(code)][1]
        if named is None:
            return None
        return hashlib.blake2b(f"{named}|{rest!r}".encode(), digest_size=16).hexdigest()

    def find(self, name: str, same) -> tuple | None:
        """The entry (reads, writes, nbytes) under `name` whose every read (index, packed mask
        or None, digest) is same(*read), or None."""
        folder = self.directory / name
        try:
            files = list(os.scandir(folder))
        except OSError:
            return None
        for file in files:
            if file.name.startswith("."):  # a file being written
                continue
            entry = self._read(Path(file.path))
            if entry is not None and all(same(*read) for read in entry[0]):
                with contextlib.suppress(OSError):
                    os.utime(file.path)  # used: the last to be pruned
                return entry
        return None

    def save(self, name: str, entry: tuple) -> None:
        """`entry` (reads, writes, nbytes) under `name`, written whole or not at all."""
        reads, writes, _ = entry
        header = json.dumps({"reads": [[i, None if m is None else m.nbytes, d.hex()]
                                       for i, m, d in reads],
                             "writes": [[i, None if m is None else m.nbytes, str(v.dtype),
                                         v.nbytes] for i, m, v in writes]}).encode()
        parts = [_MAGIC, struct.pack("<Q", len(header)), header]
        parts += [m.tobytes() for _, m, _ in reads if m is not None]
        for _, mask, values in writes:
            parts += ([] if mask is None else [mask.tobytes()]) + [values.tobytes()]
        body = b"".join(parts)
        data = body + hashlib.blake2b(body, digest_size=16).digest()
        folder = self.directory / name
        file = folder / hashlib.blake2b(repr([(i, None if m is None else m.tobytes(), d)
                                              for i, m, d in reads]).encode(),
                                        digest_size=16).hexdigest()
        with contextlib.suppress(OSError):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            part = folder / f".{file.name}.{os.getpid()}.part"
            part.write_bytes(data)
            os.replace(part, file)
        self._prune_now_and_then()

    def _read(self, path: Path) -> tuple | None:
        import numpy as np

        try:
            data = path.read_bytes()
            body, digest = data[:-16], data[-16:]
            if not body.startswith(_MAGIC) or \
                    hashlib.blake2b(body, digest_size=16).digest() != digest:
                raise ValueError("torn or altered")
            at = len(_MAGIC) + 8
            (length,) = struct.unpack("<Q", body[len(_MAGIC):at])
            header = json.loads(body[at:at + length])
            at += length

            def take(nbytes: int | None):
                """The next `nbytes` of the body as uint8 (None: None), in the order save wrote."""
                nonlocal at
                if nbytes is None:
                    return None
                at += nbytes
                return np.frombuffer(body, np.uint8, nbytes, at - nbytes).copy()

            reads = [(index, take(mask_bytes), bytes.fromhex(digest))
                     for index, mask_bytes, digest in header["reads"]]
            writes = [(index, take(mask_bytes), take(nbytes).view(dtype))
                      for index, mask_bytes, dtype, nbytes in header["writes"]]
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        return tuple(reads), tuple(writes), held_bytes(reads, writes)

    def _prune_now_and_then(self) -> None:
        """At most once an hour across processes: the oldest used entries go, past the budget."""
        stamp = self.directory / ".pruned"
        try:
            if time.time() - stamp.stat().st_mtime < _PRUNE_EVERY_S:
                return
        except OSError:
            pass
        with contextlib.suppress(OSError):
            stamp.touch()
            self.prune(BUDGET_BYTES)

    def prune(self, budget: int) -> None:
        """Entries removed, least recently used first, until the rest fit 3/4 of `budget`."""
        files = []
        for folder in os.scandir(self.directory):
            if folder.is_dir():
                for file in os.scandir(folder.path):
                    st = file.stat()
                    files.append((st.st_mtime, st.st_size, file.path))
        total = sum(f[1] for f in files)
        if total <= budget:
            return
        for _, size, path in sorted(files):
            if total <= budget * 3 // 4:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                total -= size
                os.rmdir(os.path.dirname(path))  # where it was the last (else: not empty)


def held_bytes(reads, writes) -> int:
    """The bytes an entry holds: the written values and every mask."""
    return sum(v.nbytes for _, _, v in writes) + sum(
        m.nbytes for _, m, _ in (*reads, *writes) if m is not None)


def _code_name(kernel_objects: tuple, owners: tuple) -> str | None:
    try:
        kernel = sorted(content(o, strict=True) for o in kernel_objects)
        interpreter = _owners_name(owners)
    except Unnamed:
        return None
    return hashlib.blake2b(repr((interpreter, kernel, _environment())).encode(),
                           digest_size=16).hexdigest()


# the modules whose functions the interpreter may hold and still be named: a test's function in
# it (a spy, a planted operation) has effects beyond the launch's writes, or may
_OWN_MODULES = {"triton", "exactness", "dataclasses", "typing", "functools", "contextlib"}


def _foreign(value) -> bool:
    function = getattr(value, "__func__", value)  # (staticmethod, classmethod)
    return type(function) is types.FunctionType and \
        (function.__module__ or "").partition(".")[0] not in _OWN_MODULES


_ABSENT = object()
# a class's attributes no launch computes with; Triton and introspection add them as a
# process goes (tl.tensor's __repr__ at the first launch that runs, an empty __annotations__)
_UNUSED = {"__dict__", "__weakref__", "__doc__", "__annotations__", "__repr__", "__str__"}
# the last owners' attributes, their ids, their name; an attribute that is the interpreter
# module's own, copied into a language module when Triton rewrites one of its functions for the
# interpreter (which happens at a function's first call: a process's history), is named once,
# as the interpreter's
_owners_named: list = [None, None, None]


def _owners_name(owners: tuple) -> str:
    """The interpreter's owners by content, described again only when an attribute changed (the
    attributes are held meanwhile, so that no id is another object's)."""
    values = tuple(v for o in owners for v in vars(o).values())
    made_of = tuple(map(id, values))
    if _owners_named[1] != made_of:
        if any(map(_foreign, values)):
            raise Unnamed("the interpreter holds a function of another module")
        interpreter = vars(owners[0])  # (the first: Triton's interpreter module)
        described = [(getattr(o, "__qualname__", getattr(o, "__name__", type(o).__qualname__)),
                      sorted((k, content(v, strict=False)) for k, v in vars(o).items()
                             if k not in _UNUSED and
                             (o is owners[0] or interpreter.get(k, _ABSENT) is not v)))
                     for o in owners]
        _owners_named[:] = values, made_of, hashlib.blake2b(repr(described).encode(),
                                                            digest_size=16).hexdigest()
    return _owners_named[2]


@functools.cache
def default_store() -> Store:
    """The store in the kernels' private cache; none where EXACTNESS_LAUNCH_STORE=off or that
    cache cannot be had."""
    if os.environ.get("EXACTNESS_LAUNCH_STORE", "on") == "off":
        return Store(None)
    from ...kernels.toolchain import cache_dir

    cache, _ = cache_dir()
    return Store(None if cache is None else cache / "launches")
