"""transformers' fused routed experts, exact (ExactExperts): one grouped call per projection."""

from __future__ import annotations

import torch
from torch import nn

from ..contract import DEFAULT_ACT_BITS
from ..kernels.routing import check_routing
from ..modules import PackedInt4Linear
from ..moe import activation, experts_forward


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
    projection (exactness.moe); `grouped = False` runs transformers' own loop instead
    (`per_expert`), the reference the grouped call is checked against."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act_fn,
                 act_bits: int = DEFAULT_ACT_BITS, device=None, grouped: bool = True):
        super().__init__()
        for e in range(num_experts):
            self.add_module(str(e), ExactExpert(hidden, inter, act_bits, device))
        self.num_experts, self.act_fn, self.grouped = num_experts, act_fn, grouped

    def __getitem__(self, e: int) -> ExactExpert:
        return getattr(self, str(e))

    def __len__(self) -> int:
        return self.num_experts

    def __iter__(self):
        return (self[e] for e in range(self.num_experts))

    @classmethod
    def like(cls, fused: nn.Module, act_bits: int = DEFAULT_ACT_BITS,
             device=None) -> ExactExperts:
        """The exact experts for transformers' fused module `fused` (its sizes, its act_fn)."""
        return cls(fused.num_experts, fused.hidden_dim, fused.intermediate_dim, fused.act_fn,
                   act_bits, device)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if not self.grouped:
            return self.per_expert(hidden_states, top_k_index, top_k_weights)
        return experts_forward(self, self.act_fn, hidden_states, top_k_index, top_k_weights,
                               hidden_states.dtype,
                               lambda: self.per_expert(hidden_states, top_k_index, top_k_weights))

    def per_expert(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' own loop (DeepseekV3Experts.forward) over the exact layers, expert by
        expert: ids in [0, E], E its padding for "no expert"."""
        ids = top_k_index.to(torch.int64)
        check_routing(ids, self.num_experts)
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
