"""Tables of addresses in the interpreter's replayed launches (exactness.suite.interpreter.replay).

The grouped kernels read their experts' weights through a table of addresses
(exactness.kernels.triton.grouped.table), not through their arguments. Told what a table points
at, a replayed launch takes those tensors' buffers as its own: their bytes are part of its key,
and the table's bytes count by what they point at (an address is another in the next process,
and for another buffer in this one).
"""

from __future__ import annotations

import hashlib
import weakref

__all__ = ["digest", "install", "points_at", "pointed_by"]

_POINTED: dict = {}  # id(table) -> (a weak reference to it, weak references to its tensors)


def points_at(table, tensors) -> None:
    """`table`, a tensor of addresses a kernel reads through, points at `tensors`."""
    key = id(table)

    def forget(ref) -> None:
        if _POINTED.get(key, (None,))[0] is ref:
            del _POINTED[key]

    _POINTED[key] = weakref.ref(table, forget), tuple(weakref.ref(t) for t in tensors)


def pointed_by(tensor) -> list | None:
    """The tensors `tensor` points at (None for one gone), or None where it is no table."""
    table, pointed = _POINTED.get(id(tensor), (None, ()))
    if table is None or table() is not tensor:
        return None
    return [ref() for ref in pointed]


def install() -> list:
    """The grouped kernels' table maker, telling points_at what each table points at:
    [(owner, name, the product's own)] to put back."""
    from ...kernels.triton import grouped

    make = grouped.table

    def table(experts, device):
        made = make(experts, device)
        points_at(made, [b for parts in experts for held in parts if held is not None
                         for b in held])
        return made

    grouped.table = table
    return [(grouped, "table", make)]


def digest(table_bytes, buffers: list) -> bytes:
    """A table's bytes (uint8) as a digest, each 8-byte word that is an address inside one of
    `buffers` [(address, size, storage)] named by that buffer's place and the offset."""
    import numpy as np

    words = table_bytes[:table_bytes.size // 8 * 8].view(np.int64)
    bases = np.array([b[0] for b in buffers], dtype=np.int64)
    ends = bases + np.array([b[1] for b in buffers], dtype=np.int64)
    inside = (words[:, None] >= bases) & (words[:, None] < ends)
    which = np.where(inside.any(axis=1), inside.argmax(axis=1), -1)
    named = np.where(which >= 0, words - bases[np.maximum(which, 0)], words)
    return hashlib.blake2b(np.stack([which, named]).tobytes(), digest_size=16).digest()
