"""An MoE layer's routing as the grouped kernels read it: the (token, slot) pairs sorted by expert.

`top_k_index` [T, top_k] names each token's experts, as transformers' DeepseekV3 experts take it:
ids in [0, E), and E itself for "no expert" (transformers' padding, under expert parallelism).
Pair p = t * top_k + s is token t's slot s. A grouped call's rows are the pairs in (expert,
token, slot) order: the order transformers' loop visits them, expert by expert.

A token may name E in any number of slots, but an expert at most once: a router's top-k never
repeats one, and transformers' loop would sum such a pair otherwise than two experts (index_add_
sums a call's repeated indices in fp32, then rounds once). So a repeated expert is refused, as is
an id outside [0, E] (`check_routing`).

Every tensor is made on top_k_index's device without reading anything back, so a GPU call queues
its launches without waiting on the host. There (check=False) a refused id is counted in `bad`,
and the caller raises once it reads that count; on the CPU `route` raises at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract import ContractTypeError, ContractValueError, ShapeError


@dataclass(frozen=True)
class Routing:
    tokens: int
    top_k: int
    experts: int
    key: torch.Tensor  # [T, top_k] int64: each pair's expert, E for none (and refused ids)
    pair: torch.Tensor  # [T * top_k] int64: each row's pair, rows in (expert, token, slot) order
    offsets: torch.Tensor  # [E + 2] int64: expert e's rows are offsets[e] .. offsets[e + 1]
    bad: torch.Tensor  # [] int64: how many ids are refused (check_routing says which)

    @property
    def token(self) -> torch.Tensor:
        """[T * top_k] int64: the token of each row."""
        return self.pair // self.top_k

    @property
    def routed(self) -> torch.Tensor:
        """[] int64: how many rows name an expert (they come first)."""
        return self.offsets[self.experts]


def route(top_k_index: torch.Tensor, experts: int, check: bool | None = None) -> Routing:
    """The routing of `top_k_index` [T, top_k] over `experts` experts. With `check` (default:
    on the CPU) a refused id raises ContractValueError; else it is counted in `bad`."""
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != 2:
        raise ShapeError(f"top_k_index must be a [tokens, top_k] tensor, got "
                         f"{getattr(top_k_index, 'shape', type(top_k_index).__name__)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex \
            or top_k_index.dtype == torch.bool:
        raise ContractTypeError(f"top_k_index must hold integer expert ids, got "
                                f"{top_k_index.dtype}")
    tokens, top_k = top_k_index.shape
    ids = top_k_index.to(torch.int64)
    if check if check is not None else top_k_index.device.type == "cpu":
        check_routing(ids, experts)
    out_of_range, repeated = refused(ids, experts)
    key = torch.where(out_of_range, experts, ids)
    flat = key.reshape(-1)
    pair = torch.sort(flat, stable=True).indices
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return Routing(tokens, top_k, experts, key, pair, offsets,
                   out_of_range.sum() + repeated.sum())


def refused(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids outside [0, E] [T, top_k], slots repeating an expert of an earlier slot [T, top_k])."""
    out_of_range = (ids < 0) | (ids > experts)
    same = (ids[:, :, None] == ids[:, None, :]).tril(-1).any(2)
    return out_of_range, same & (ids != experts) & ~out_of_range


def check_routing(ids: torch.Tensor, experts: int) -> None:
    """ContractValueError naming the first refused id of `ids` [T, top_k] (int64), if any: one
    outside [0, E], or an expert a token names twice. Reads the ids (on a GPU, a wait)."""
    out_of_range, repeated = refused(ids, experts)
    if bool(out_of_range.any()):
        where = tuple(int(i) for i in torch.nonzero(out_of_range)[0])
        raise ContractValueError(
            f"top_k_index has {int(out_of_range.sum())} expert id(s) outside [0, {experts}] "
            f"({experts} is 'no expert'); the first, {int(ids[where])}, at index {where}")
    if bool(repeated.any()):
        token, slot = (int(i) for i in torch.nonzero(repeated)[0])
        raise ContractValueError(
            f"top_k_index names expert {int(ids[token, slot])} twice for token {token} (slot "
            f"{slot} repeats an earlier one): a token's experts must differ, as a router's top-k "
            f"does")
