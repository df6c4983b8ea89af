"""Which routed experts this process holds (expert parallelism), and stand-ins for the rest."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..modules import PackedInt4Linear
from ..moe import RemoteLinear
from .checkpoint import ROUTED
from .config import KimiConversionError, brief


def expert_parallel(rank: int, world: int, n_experts: int) -> Callable[[int, int], bool]:
    """The routed experts rank `rank` of `world` holds, placed as vLLM's expert parallelism
    places them by default: a contiguous block each, the first `n_experts % world` ranks one
    more. A predicate on (layer, expert), for `experts=`."""
    for what, value, low in (("world", world, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise KimiConversionError(f"{what} must be an int >= {low}, got {brief(value)}")
    if rank >= world:
        raise KimiConversionError(f"rank {rank} is not below world {world}")
    base, extra = divmod(n_experts, world)
    start = rank * base + min(rank, extra)
    stop = start + base + (rank < extra)
    return lambda layer, expert: start <= expert < stop


def local_experts(experts, rank, world, n_experts: int):
    """`experts=` (a predicate on (layer, expert)), or the one `rank`/`world` make, or None: all
    of them."""
    if rank is None and world is None:
        if experts is not None and not callable(experts):
            raise KimiConversionError(f"experts= takes a predicate on (layer, expert), got "
                                      f"{brief(experts)}")
        return experts
    if experts is not None:
        raise KimiConversionError("experts= or rank= and world=, not both")
    if rank is None or world is None:
        raise KimiConversionError(f"rank= and world= go together, got rank={rank!r}, "
                                  f"world={world!r}")
    return expert_parallel(rank, world, n_experts)


def make_remote(targets: dict[str, PackedInt4Linear], local, parents: dict[str, nn.Module],
                replacements: dict[str, nn.Module]) -> list[str]:
    """Each routed projection in `targets` of an expert `local` does not take becomes a
    RemoteLinear (in its new parent from `parents`, else a replacement) and leaves `targets`.
    The experts held elsewhere, by name."""
    remote = set()
    for name in list(targets):
        m = ROUTED.match(name)
        if m is None:
            raise KimiConversionError(f"{name}: not named like a routed projection, so experts= "
                                      f"cannot tell which expert it is")
        if local(int(m[1]), int(m[2])):
            continue
        layer = targets.pop(name)
        stand_in = RemoteLinear(name, layer.in_features, layer.out_features)
        parent, _, child = name.rpartition(".")
        if parent in parents:
            setattr(parents[parent], child, stand_in)
        else:
            replacements[name] = stand_in
        remote.add(parent)
    return sorted(remote, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])
