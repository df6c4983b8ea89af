"""An MoE layer's routed experts at Kimi's sizes (hidden 7168, expert width 2048, top-8): the
grouped exact call, in the exact block (the default) and in the transformers block, against
transformers' own DeepseekV3Experts in bf16 on the dequantized weights, and against the exact
per-expert loop (the exact block's, one expert at a time), side by side.

They alternate call by call, the same tokens and routing, medians. Routing: each token's 8
experts drawn at random among E, so that at T = 128 with E = 64 every expert has about 16 rows.
The checks column is the part of the grouped call that checks the routed experts' buffers are
readable (each layer's `weights()`), timed alone.

    .venv/bin/python -m bench.bench_moe [--experts 64] [--tokens 1 16 128 1024]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

from bench.bench_forward import cpu_name, random_layer, side_by_side
from exactness.kimi import ExactExperts

HIDDEN, INTER, TOP_K = 7168, 2048, 8
REPEATS = {1: 21, 16: 11, 128: 7, 1024: 3}  # per token count: each call is ~T times longer


def dequantized(layer) -> torch.Tensor:
    """The layer's q * s in bf16 [N, K] (torch, one layer at a time)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((layer.weight_packed[:, :, None] >> shifts) & 15) - 8
    return (q.reshape(layer.out_features, -1).float()
            * layer.weight_scale.float().repeat_interleave(32, 1)).bfloat16()


def experts_pair(experts: int, act_bits: int, seed: int = 0):
    """(exact ExactExperts, transformers' DeepseekV3Experts on the same weights in bf16)."""
    generator = torch.Generator().manual_seed(seed)
    exact = ExactExperts(experts, HIDDEN, INTER, torch.nn.SiLU(), act_bits)
    config = DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=INTER,
                              n_routed_experts=experts, num_experts_per_tok=TOP_K)
    bf16 = DeepseekV3Experts(config).to(torch.bfloat16)
    with torch.no_grad():
        for e, expert in enumerate(exact):
            for layer in (expert.gate_proj, expert.up_proj, expert.down_proj):
                random_layer(layer, generator)
            bf16.gate_up_proj[e] = torch.cat([dequantized(expert.gate_proj),
                                             dequantized(expert.up_proj)])
            bf16.down_proj[e] = dequantized(expert.down_proj)
    return exact, bf16


def routing(tokens: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:TOP_K]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=generator)
    return ids, weights / weights.sum(1, keepdim=True) * 2.827


def in_block(experts: ExactExperts, block: str, x, ids, weights, loop: bool = False):
    experts.block = block
    return experts.per_expert(x, ids, weights) if loop else experts(x, ids, weights)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024])
    parser.add_argument("--act-bits", type=int, default=16)
    parser.add_argument("--out", default="reports/bench_moe.md")
    args = parser.parse_args()
    exact, bf16 = experts_pair(args.experts, args.act_bits)
    from exactness import moe

    plan = moe.plan([[exact[0].gate_proj, exact[0].up_proj]], torch.zeros(1, HIDDEN).bfloat16())
    lines = [f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; {args.experts} experts of {HIDDEN} -> "
             f"{INTER}, top-{TOP_K}, act_bits {args.act_bits}; the grouped call: "
             f"{plan.kernel.name if plan else 'the per-expert loop'}; medians", "",
             "| T | grouped ms | transformers block ms | per-expert ms | bf16 ms | "
             "grouped / bf16 | grouped / transformers block | grouped / per-expert | "
             "checks ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for t in args.tokens:
        x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(t)).bfloat16()
        ids, weights = routing(t, args.experts, t)
        active = [exact[e] for e in torch.unique(ids).tolist()]
        layers = [layer for e in active for layer in (e.gate_proj, e.up_proj, e.down_proj)]
        want = exact.per_expert(x, ids, weights)
        assert torch.equal(exact(x, ids, weights), want), "the grouped call differs"
        grouped, compatible, loop, base, check = side_by_side(
            [lambda: in_block(exact, "exact", x, ids, weights),
             lambda: in_block(exact, "transformers", x, ids, weights),
             lambda: in_block(exact, "exact", x, ids, weights, loop=True),
             lambda: bf16(x, ids, weights), lambda: [layer.weights() for layer in layers]],
            REPEATS.get(t, 3))
        line = (f"| {t} | {grouped * 1e3:.1f} | {compatible * 1e3:.1f} | {loop * 1e3:.1f} | "
                f"{base * 1e3:.1f} | {grouped / base:.2f} | {grouped / compatible:.2f} | "
                f"{grouped / loop:.2f} | {check * 1e3:.1f} |")
        lines.append(line)
        print(line, flush=True)
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
