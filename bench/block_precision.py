"""The whole routed-expert block's precision (issue 68): one Kimi-shaped MoE layer's routed
experts, each side's bf16 output against the same block computed in float64.

    .venv/bin/python bench/block_precision.py [--tokens 1 16 128] [--act-bits 8 16 32]
        [--experts 16] [--top-k 8] [--hidden 7168] [--intermediate 2048] [--threads 2]
        [--out reports]

Every side takes the same bf16 x [T, H], the same top-k ids and fp32 routing weights (summing
to Kimi's routed scale), and the same int4 weights (bench/kt_peer.py's kimi_experts: uniform
nibbles, bf16 scales over 2**-7 .. 2**-5):
- transformers bf16: transformers' own DeepseekV3Experts, the weights dequantized to bf16 (what
  compressed-tensors' decompression gives it), bf16 matmuls and bf16 glue;
- kt-kernel RAWINT4: KTransformers' int4 MoE (fp32 dots and glue, one rounding), run by
  bench/kt_peer.py --outputs in its own venv (make kt-peer), when that venv exists;
- exact, transformers block: the exact projections with transformers' bf16 glue;
- exact, exact block: fp32 projections, float64 glue, one rounding (docs/KIMI.md).

The truth is the block in float64 (kt_peer.truth64: the dequantized weights, which are exact in
float64, SiLU in float64, the weighted sum): float64's own error is ~1e-13 relative, 10**10
below a bf16 ulp, so "correctly rounded" is RNE_bf16 of it (glue.round_float64). Per side:
the share of outputs equal to that, within 0.5 and 1 ulp (a bf16 ulp at the true value), the
median, p99 and max in ulps, and apart, the outputs whose sign differs from the truth's (near
zero, where ulps mean little), left out of the ulp statistics. The exact sides at each act_bits;
the others do not depend on it. Writes reports/block_precision.md and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.kt_peer import (  # noqa: E402
    cpu_line,
    dequantized64,
    kimi_experts,
    routing,
    truth64,
    ulps,
)
from exactness.glue import round_float64  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KT_PYTHON = ROOT / ".venv-kt" / "bin" / "python"
COLUMNS = ("= RNE", "<= 0.5 ulp", "<= 1 ulp", "median", "p99", "max", "sign flips")


def statistics(y: torch.Tensor, truth: torch.Tensor) -> dict:
    """y's distance from the float64 truth, in bf16 ulps at the true value (COLUMNS)."""
    rne = round_float64(truth, torch.bfloat16).flatten()
    flips = ((torch.sign(y.double()) * torch.sign(truth.double())) < 0).flatten()
    err = ulps(y, truth)[~flips.numpy()]
    return {"= RNE": 100 * float((y.flatten().view(torch.int16) == rne.view(torch.int16))
                                 .double().mean()),
            "<= 0.5 ulp": 100 * float(np.mean(err <= 0.5)),
            "<= 1 ulp": 100 * float(np.mean(err <= 1)),
            "median": float(np.median(err)), "p99": float(np.percentile(err, 99)),
            "max": float(err.max()), "sign flips": int(flips.sum())}


def row(t: int, side: str, act_bits: str, stats: dict) -> str:
    shown = [f"{stats[c]:.1f}%" if c.startswith(("=", "<=")) else
             (str(stats[c]) if c == "sign flips" else f"{stats[c]:.3f}") for c in COLUMNS]
    return f"| {t} | {side} | {act_bits} | " + " | ".join(shown) + " |"


def transformers_bf16(experts, hidden: int, inter: int):
    """transformers' DeepseekV3Experts holding the int4 weights dequantized to bf16."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    config = DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=inter,
                              n_routed_experts=len(experts))
    config._experts_implementation = "eager"  # transformers' own loop, as a model runs it
    fused = DeepseekV3Experts(config)
    with torch.no_grad():
        fused.gate_up_proj.data = torch.stack([torch.cat(
            [dequantized64(e.gate_proj), dequantized64(e.up_proj)]).bfloat16() for e in experts])
        fused.down_proj.data = torch.stack([dequantized64(e.down_proj).bfloat16()
                                            for e in experts])
    return fused


def kt_outputs(args, cases: list) -> list | str:
    """kt-kernel's y for each case, from its own venv; or why there is none."""
    if not KT_PYTHON.exists():
        return "not installed (make kt-peer builds .venv-kt)"
    with tempfile.TemporaryDirectory() as tmp:
        inputs, outputs = Path(tmp) / "in.pt", Path(tmp) / "out.pt"
        torch.save(cases, inputs)
        done = subprocess.run(
            [str(KT_PYTHON), str(ROOT / "bench" / "kt_peer.py"), "--outputs", str(inputs),
             str(outputs), "--experts", str(args.experts), "--top-k", str(args.top_k),
             "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
             "--threads", str(args.threads)], capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            return f"failed: {done.stderr.strip().splitlines()[-1:]}"
        return torch.load(outputs)


def plot(errors: dict, file: Path, title: str) -> None:
    """The share of outputs within each ulp distance, per side (one T, one act_bits)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for side, err in errors.items():
        err = np.sort(err)
        ax.plot(np.maximum(err, 1e-3), np.arange(1, err.size + 1) / err.size, label=side)
    ax.set_xscale("log")
    ax.set_xlabel("|y - float64 block| in bf16 ulps at the true value")
    ax.set_ylabel("share of outputs within")
    ax.axvline(0.5, color="grey", linestyle=":")
    ax.axvline(1, color="grey", linestyle="--")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(file, dpi=120)


# ---------------------------------------------------------------- the model level

def small_kimi(block: str | None, layers: int = 4, seed: int = 0):
    """A small Kimi-shaped KimiModel (a dense layer, then MoE layers of 16 experts, top-4, one
    shared expert) and an lm_head, random weights: bf16 N(0, 1/fan_in) for the bf16 parts, int4
    nibbles with kimi_experts' scales for the routed experts. `block` None: the routed experts as
    bf16 nn.Linear on the same weights dequantized (transformers' bf16 path)."""
    from bench.bench_forward import random_layer
    from exactness.kimi import KimiConfig, KimiModel, KimiMoE

    config = KimiConfig(hidden_size=512, moe_intermediate_size=256, intermediate_size=1024,
                        n_routed_experts=16, num_experts_per_tok=4, num_hidden_layers=layers,
                        use_exact_generators=True, exact_act_bits=32)
    exact = KimiModel(config)
    generator = torch.Generator().manual_seed(seed)
    for p in exact.parameters():
        fan_in = p.shape[-1] if p.dim() == 2 else 1
        p.data = (torch.randn(p.shape, generator=generator) / fan_in ** 0.5).to(p.dtype)
    for module in exact.modules():
        if hasattr(module, "weight_packed"):
            random_layer(module, generator)
    lm_head = torch.nn.Linear(512, 2048, bias=False, dtype=torch.bfloat16)
    lm_head.weight.data = (torch.randn(2048, 512, generator=generator) / 512 ** 0.5).bfloat16()
    if block is not None:
        for module in exact.modules():
            if isinstance(module, KimiMoE):
                module.block = block
        return exact, lm_head
    bf16 = KimiModel(dataclasses.replace(config, use_exact_generators=False))
    state = {k: v for k, v in exact.state_dict().items() if not k.endswith(
        ("weight_packed", "weight_scale", "weight_shape"))}
    for name, module in exact.named_modules():
        if hasattr(module, "weight_packed"):
            state[f"{name}.weight"] = dequantized64(module).bfloat16()
    bf16.load_state_dict(state)
    return bf16, lm_head


def logits64(model, lm_head, x: torch.Tensor) -> torch.Tensor:
    """The same model in float64 throughout: routing, experts, glue, residual stream."""
    from exactness.kimi import KimiMoE

    def weight(layer):
        return dequantized64(layer) if hasattr(layer, "weight_packed") else layer.weight.double()

    def mlp(m, x):
        gate, up = x @ weight(m.gate_proj).T, x @ weight(m.up_proj).T
        return (torch.nn.functional.silu(gate) * up) @ weight(m.down_proj).T

    x = x.double()
    for layer in model.model.layers:
        block = layer.mlp
        if not isinstance(block, KimiMoE):
            x = x + mlp(block, x)
            continue
        router, config = block.gate, block.config
        scores = torch.sigmoid(x @ router.weight.double().T)
        chosen = torch.topk(scores + router.e_score_correction_bias.double(),
                            config.num_experts_per_tok, dim=-1).indices
        w = scores.gather(-1, chosen)
        w = w / w.sum(-1, keepdim=True) * config.routed_scaling_factor
        routed = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == e)
            routed.index_add_(0, token, w[token, slot, None] * mlp(block.experts[e], x[token]))
        x = x + routed + mlp(block.shared_experts, x)
    return x @ lm_head.weight.double().T


def model_level(tokens: int = 64) -> list[str]:
    """Each side's final logits against the float64 run: top-1 agreement, and the logit error
    (median and max |logit - float64's|, in units of the float64 logits' largest)."""
    x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    reference, head = small_kimi("exact")
    truth = logits64(reference, head, x)
    scale = float(truth.abs().max())
    lines = ["", f"Model level: KimiModel, 4 layers (a dense one, then MoE: 16 experts, top-4, a "
             f"shared expert), hidden 512, lm_head 2048; {tokens} random bf16 tokens; "
             f"float64 run of the same model", "",
             "| side | act_bits | top-1 = float64's | median error | max error |",
             "| --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for side, block, bits in (("transformers bf16", None, "-"),
                              ("exact, transformers block", "transformers", 16),
                              ("exact, transformers block", "transformers", 32),
                              ("exact, exact block", "exact", 16),
                              ("exact, exact block", "exact", 32)):
        model, head = small_kimi(block)
        for layer in model.modules():
            if hasattr(layer, "act_bits"):
                layer.act_bits = bits
        logits = head(model(x)).double()
        top1 = 100 * float((logits.argmax(-1) == truth.argmax(-1)).double().mean())
        err = (logits - truth).abs() / scale
        lines.append(f"| {side} | {bits} | {top1:.1f}% | {float(err.median()):.2e} | "
                     f"{float(err.max()):.2e} |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--act-bits", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "reports")
    parser.add_argument("--model-only", action="store_true",
                        help="only the model level (a small Kimi-shaped model's logits)")
    args = parser.parse_args()
    if args.model_only:
        model_level()
        return 0
    torch.set_num_threads(args.threads)
    experts = kimi_experts(args.experts, args.hidden, args.intermediate)
    cases = []
    for t in args.tokens:
        x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(2000 + t))
        cases.append((x.bfloat16(), *routing(t, args.experts, args.top_k, seed=2000 + t)))
    kt = kt_outputs(args, cases)
    fused = transformers_bf16(experts, args.hidden, args.intermediate)
    lines = [f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {cpu_line()}; torch {torch.__version__}",
             f"layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, "
             f"intermediate {args.intermediate}; kt-kernel: "
             f"{'measured' if isinstance(kt, list) else kt}", "",
             "| T | side | act_bits | " + " | ".join(COLUMNS) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |"]
    print("\n".join(lines), flush=True)
    curves = {}
    for i, (x, ids, weights) in enumerate(cases):
        t = x.shape[0]
        truth = truth64(experts, x, ids, weights)
        sides = [("transformers bf16", "-", fused(x, ids, weights))]
        if isinstance(kt, list):
            sides.append(("kt-kernel RAWINT4", "-", kt[i]))
        for bits in args.act_bits:
            for layer in experts.modules():
                if hasattr(layer, "act_bits"):
                    layer.act_bits = bits
            for block in ("transformers", "exact"):
                experts.block = block
                sides.append((f"exact, {block} block", str(bits), experts(x, ids, weights)))
        for side, bits, y in sides:
            lines.append(row(t, side, bits, statistics(y, truth)))
            print(lines[-1], flush=True)
            if t == max(args.tokens) and bits in ("-", str(max(args.act_bits))):
                curves[side] = ulps(y, truth)
    lines += model_level()
    args.out.mkdir(exist_ok=True)
    (args.out / "block_precision.md").write_text("\n".join(lines) + "\n")
    plot(curves, args.out / "block_precision.png",
         f"T = {max(args.tokens)}, act_bits {max(args.act_bits)}: the block against float64")
    print(f"\nwritten: {args.out / 'block_precision.md'}, {args.out / 'block_precision.png'}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    raise SystemExit(main())
