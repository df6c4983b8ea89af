"""transformers' fused routed experts, exact (ExactExperts): one grouped call per projection."""

from __future__ import annotations

import torch
from torch import nn

from ..contract import DEFAULT_ACT_BITS
from ..glue import activation, check_block, exact_block_loop
from ..kernels.routing import check_routing
from ..modules import PackedInt4Linear
from ..moe import experts_forward


class ExactExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, act_bits: int, device=None):
        super().__init__()
        self.gate_proj = PackedInt4Linear(hidden, inter, act_bits, device=device)
        self.up_proj = PackedInt4Linear(hidden, inter, act_bits, device=device)
        self.down_proj = PackedInt4Linear(inter, hidden, act_bits, device=device)


class ExactExperts(nn.Module):
    """transformers' fused DeepseekV3Experts (exactness.hf), exact, with the same call. Expert
    E's projections are `E.gate_proj`, `E.up_proj` and `E.down_proj`: the checkpoint's own
    names (`...mlp.experts.E.gate_proj.weight_packed`). A forward is one grouped call per
    projection (exactness.moe); `grouped = False` runs the per-expert loop instead
    (`per_expert`), the reference the grouped call is checked against.

    `block` says what the glue between the exact projections computes in (exactness.glue):
    "exact" (the default: fp32 projections, float64 glue, one rounding of the block) or
    "transformers" (transformers' bf16 glue, bit for bit its own loop's)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act_fn,
                 act_bits: int = DEFAULT_ACT_BITS, device=None, grouped: bool = True,
                 block: str = "exact"):
        super().__init__()
        for e in range(num_experts):
            self.add_module(str(e), ExactExpert(hidden, inter, act_bits, device))
        self.num_experts, self.act_fn, self.grouped = num_experts, act_fn, grouped
        self.block = check_block(block)

    def __getitem__(self, e: int) -> ExactExpert:
        return getattr(self, str(e))

    def __len__(self) -> int:
        return self.num_experts

    def __iter__(self):
        return (self[e] for e in range(self.num_experts))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, block={self.block!r}"

    @classmethod
    def like(cls, fused: nn.Module, act_bits: int = DEFAULT_ACT_BITS, device=None,
             block: str = "exact") -> ExactExperts:
        """The exact experts for transformers' fused module `fused` (its sizes, its act_fn)."""
        return cls(fused.num_experts, fused.hidden_dim, fused.intermediate_dim, fused.act_fn,
                   act_bits, device, block=block)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if not self.grouped:
            return self.per_expert(hidden_states, top_k_index, top_k_weights)
        return experts_forward(self, self.act_fn, hidden_states, top_k_index, top_k_weights,
                               hidden_states.dtype,
                               lambda: self.per_expert(hidden_states, top_k_index, top_k_weights),
                               self.block)

    def per_expert(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts one by one, ids in [0, E], E its padding for "no expert": in the
        transformers block, transformers' own loop (DeepseekV3Experts.forward) over the exact
        layers; in the exact block, glue.exact_block_loop."""
        ids = top_k_index.to(torch.int64)
        check_routing(ids, self.num_experts)
        if self.block == "exact":
            return exact_block_loop(self, self.act_fn, hidden_states, ids, top_k_weights,
                                    hidden_states.dtype)
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(ids).tolist():
            if e == self.num_experts:
                continue
            token, slot = torch.where(ids == e)
            x, expert = hidden_states[token], self[e]
            y = expert.down_proj(activation(self.act_fn, expert.gate_proj(x), expert.up_proj(x)))
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` is transformers' fused routed experts (DeepseekV3Experts' shape)."""
    return (isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(module, "down_proj", None), torch.Tensor)
            and module.gate_up_proj.dim() == 3 and hasattr(module, "num_experts"))
