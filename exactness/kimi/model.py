"""A faithful minimal Kimi K2 / K2.5 MoE stack with the checkpoint's module names: routed experts
exact where config.use_exact_generators, shared experts and the dense MLP nn.Linear."""

from __future__ import annotations

import torch
from torch import nn

from ..glue import activation, check_block, exact_block_loop, round_float64
from ..kernels.routing import check_routing
from ..modules import PackedInt4Linear
from ..moe import experts_forward
from .config import KimiConfig


class KimiMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); exact int4 projections for routed experts."""

    def __init__(self, config: KimiConfig, intermediate_size: int, routed: bool = False):
        super().__init__()
        hidden = config.hidden_size
        if routed and config.use_exact_generators:
            def make(i, o):
                return PackedInt4Linear(i, o, act_bits=config.exact_act_bits)
        else:
            def make(i, o):
                return nn.Linear(i, o, bias=False, dtype=torch.bfloat16)
        self.gate_proj = make(hidden, intermediate_size)
        self.up_proj = make(hidden, intermediate_size)
        self.down_proj = make(intermediate_size, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activation(nn.functional.silu, self.gate_proj(x), self.up_proj(x)))


class KimiRouter(nn.Module):
    """Sigmoid scores; top-k on scores + e_score_correction_bias; weights from the unbiased
    scores, normalised, times routed_scaling_factor (noaux_tc with one group)."""

    def __init__(self, config: KimiConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size,
                                               dtype=torch.bfloat16))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        chosen = torch.topk(scores + self.e_score_correction_bias, self.config.num_experts_per_tok,
                            dim=-1, sorted=True).indices
        weights = scores.gather(-1, chosen)
        if self.config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * self.config.routed_scaling_factor


class KimiMoE(nn.Module):
    """Routed experts (one grouped call per projection where they are exact: exactness.moe; the
    per-expert loop with `grouped = False`), shared experts, the router. `block` "exact" (the
    default): the routed experts' exact block, summed in float64 with the shared experts and
    rounded once; "transformers": bf16 glue, the sum in fp32."""

    def __init__(self, config: KimiConfig, grouped: bool = True, block: str = "exact"):
        super().__init__()
        self.config, self.grouped, self.block = config, grouped, check_block(block)
        self.experts = nn.ModuleList(KimiMLP(config, config.moe_intermediate_size, routed=True)
                                     for _ in range(config.n_routed_experts))
        self.gate = KimiRouter(config)
        self.shared_experts = KimiMLP(config,
                                      config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights = self.gate(x)
        routed = (experts_forward(self.experts, nn.functional.silu, x, chosen, weights,
                                  self.sums, lambda: self.per_expert(x, chosen, weights),
                                  self.block)
                  if self.grouped else self.per_expert(x, chosen, weights))
        return round_float64(routed + self.shared_experts(x).to(self.sums),
                             x.dtype).reshape(shape)

    @property
    def sums(self) -> torch.dtype:
        """What the routed and shared experts' outputs are added in: float64 for the exact
        block of exact experts (bf16 nn.Linear experts have no exact block: fp32)."""
        exact = self.block == "exact" and self.config.use_exact_generators
        return torch.float64 if exact else torch.float32

    def per_expert(self, x: torch.Tensor, chosen: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
        """The routed experts one by one: the reference the grouped call is checked against."""
        check_routing(chosen.to(torch.int64), len(self.experts))
        if self.sums == torch.float64:
            return exact_block_loop(self.experts, nn.functional.silu, x, chosen, weights,
                                    self.sums)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(chosen).tolist():  # each expert sees only its tokens
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            out.index_add_(0, token, weights[token, slot, None] * self.experts[e](x[token]).float())
        return out


class KimiDecoderLayer(nn.Module):
    """Only what the experts need: the MLP (attention and norms stay out of this project)."""

    def __init__(self, config: KimiConfig, index: int):
        super().__init__()
        dense = index < config.first_k_dense_replace
        self.mlp = KimiMLP(config, config.intermediate_size) if dense else KimiMoE(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class KimiInner(nn.Module):
    def __init__(self, config: KimiConfig):
        super().__init__()
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))


class KimiModel(nn.Module):
    """`model.layers...` (K2 Thinking); wrap in `KimiK25` for the `language_model.` prefix."""

    def __init__(self, config: KimiConfig):
        super().__init__()
        self.config = config
        self.model = KimiInner(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return x


class KimiK25(nn.Module):
    def __init__(self, config: KimiConfig):
        super().__init__()
        self.language_model = KimiModel(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.language_model(x)
