"""vLLM serving a Kimi-shaped model: the plugin's exact int4 experts against vLLM's own MoE on the
same model with the experts dequantized to bf16, side by side in one run (docs/PERFORMANCE.md).

    make bench-vllm BENCH_ARGS='--layers 2 --experts 16'
    .venv-vllm/bin/python bench/vllm_serving.py [--layers N] [--experts E] [--rounds R] [--dir D]

The model is Kimi K2's layer at its real sizes (hidden 7168, moe_intermediate 2048, top-8, MLA
with 64 heads, one shared expert), `--layers` MoE layers deep and `--experts` routed experts
wide, random weights: the int4 checkpoint in Kimi's format (int4, group 32, bf16 scales), and
the same experts dequantized to bf16. Each side runs in a process of its own, in vLLM's default
(compiled) mode, the sides in turn for --rounds rounds (medians): decode tokens/s at batch 1
and 8, and the time to the first token of a 512-token prompt. The plugin's side also times its
MoE calls, the share of a decode step they take. Where the CPU has AMX, a third side would be
vLLM's own int4 CPU backend (not run here where it has none: said so in the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, INTER, TOP_K = 7168, 2048, 8
PROMPT, DECODE = 512, 32  # the first token's prompt; tokens generated in a decode measurement


def config(layers: int, experts: int) -> dict:
    return dict(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=18432,
                moe_intermediate_size=INTER, num_hidden_layers=layers, first_k_dense_replace=0,
                num_attention_heads=64, num_key_value_heads=64, n_routed_experts=experts,
                num_experts_per_tok=TOP_K, n_shared_experts=1, n_group=1, topk_group=1,
                kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                qk_nope_head_dim=128, max_position_embeddings=2048, tie_word_embeddings=False,
                routed_scaling_factor=2.827, norm_topk_prob=True, scoring_func="sigmoid",
                topk_method="noaux_tc", bos_token_id=0, eos_token_id=1)


def write_checkpoints(root: Path, layers: int, experts: int) -> tuple[Path, Path]:
    """(int4, bf16): the same random model, its routed experts int4 in Kimi's format in one and
    dequantized to bf16 in the other. Kept in `root` for the next run."""
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from exactness.formats import pack_weights
    from exactness.kimi.checkpoint import KIMI_QUANTIZATION_CONFIG

    int4, bf16 = root / f"int4-{layers}x{experts}", root / f"bf16-{layers}x{experts}"
    if (int4 / "config.json").exists() and (bf16 / "config.json").exists():
        return int4, bf16
    cfg = config(layers, experts)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in DeepseekV3ForCausalLM(
            DeepseekV3Config(**cfg)).state_dict().items() if "rotary" not in n}
    g = torch.Generator().manual_seed(0)
    for d in (int4, bf16):
        d.mkdir(parents=True, exist_ok=True)
    shared, quantized, dequantized = {}, {}, {}
    for name, shape in shapes.items():
        if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name + ".":
            base = name.rsplit(".", 1)[0]
            for e in range(experts):
                w = torch.randn(shape[1:], generator=g) * 0.02
                parts = ((("gate", w[:INTER]), ("up", w[INTER:])) if name.endswith("gate_up_proj")
                         else (("down", w),))
                for proj, p in parts:
                    n, k = p.shape
                    scale = (p.abs().view(n, k // 32, 32).amax(-1) / 7).bfloat16()
                    q = (p.view(n, k // 32, 32) / scale.float()[..., None]).round().clamp(-8, 7)
                    key = f"{base}.{e}.{proj}_proj"
                    quantized[f"{key}.weight_packed"] = torch.from_numpy(
                        pack_weights(q.view(n, k).to(torch.int64).numpy(), 4))
                    quantized[f"{key}.weight_scale"] = scale
                    quantized[f"{key}.weight_shape"] = torch.tensor([n, k])
                    dequantized[f"{key}.weight"] = (q * scale.float()[..., None]).view(
                        n, k).bfloat16()
        elif name.endswith("norm.weight"):
            shared[name] = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith("e_score_correction_bias"):
            shared[name] = torch.randn(shape, generator=g) * 0.01
        else:
            shared[name] = (torch.randn(shape, generator=g) * 0.02).bfloat16()
    save_file(shared | quantized, str(int4 / "model.safetensors"))
    save_file(shared | dequantized, str(bf16 / "model.safetensors"))
    common = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
              "torch_dtype": "bfloat16", **cfg}
    (int4 / "config.json").write_text(json.dumps(common | {
        "quantization_config": KIMI_QUANTIZATION_CONFIG}))
    (bf16 / "config.json").write_text(json.dumps(common))
    return int4, bf16


def measure(model: str, quantization: str | None) -> dict:
    """One side, in this process: TTFT at a 512-token prompt, decode tokens/s at batch 1 and 8
    (and the plugin's MoE share of a decode step)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    moe_seconds = [0.0]
    if quantization == "exactness":  # the op's body: the grouped calls and the glue
        from exactness.kimi.experts import ExactExperts

        forward = ExactExperts.forward

        def timed(self, *args):
            start = time.perf_counter()
            try:
                return forward(self, *args)
            finally:
                moe_seconds[0] += time.perf_counter() - start
        ExactExperts.forward = timed
    llm = LLM(model=model, quantization=quantization, dtype="bfloat16", max_model_len=1024,
              skip_tokenizer_init=True, seed=0, enable_prefix_caching=False)

    def prompts(batch, length, seed):
        return [TokensPrompt(prompt_token_ids=[(seed * 131 + b * 31 + i * 7) % 2000 + 2
                                               for i in range(length)]) for b in range(batch)]

    def timed_generate(batch, length, tokens, seed):
        params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens,
                                ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate(prompts(batch, length, seed), params, use_tqdm=False)
        return time.perf_counter() - start

    timed_generate(1, 16, 2, 0)  # warm-up
    result = {"ttft_s": statistics.median(timed_generate(1, PROMPT, 1, s) for s in range(1, 4))}
    for batch in (1, 8):
        first = statistics.median(timed_generate(batch, 32, 1, s) for s in range(10, 12))
        moe_seconds[0] = 0.0
        whole = timed_generate(batch, 32, DECODE, 20)
        moe_whole = moe_seconds[0]
        decode = max(whole - first, 1e-9)
        result[f"decode_tok_s_b{batch}"] = batch * (DECODE - 1) / decode
        if quantization == "exactness":
            result[f"moe_share_b{batch}"] = moe_whole / whole
    return result


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            flags = Path("/proc/cpuinfo").read_text()
            isa = ("AMX" if "amx_int8" in flags else "AVX-512 VNNI" if "avx512_vnni" in flags
                   else "AVX2")
            return f"{line.split(':', 1)[1].strip()} ({isa}, {os.cpu_count()} cores)"
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--dir", default="/tmp/exactness-vllm-bench")
    parser.add_argument("--rounds", type=int, default=3,
                        help="each side this many times, the sides in turn: medians")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # internal: one side, as JSON
    args = parser.parse_args()
    if args.side:
        model, quantization = args.side.split(",")
        print("RESULT " + json.dumps(measure(model, quantization or None)))
        return
    int4, bf16 = write_checkpoints(Path(args.dir), args.layers, args.experts)
    sides = {"exactness (int4, exact)": (int4, "exactness"),
             "vLLM's MoE (bf16 experts)": (bf16, "")}
    rounds = {label: [] for label in sides}
    for _ in range(args.rounds):  # in turn: the machine's drift falls on both sides alike
        for label, (model, quantization) in sides.items():
            done = subprocess.run([sys.executable, __file__, "--side",
                                   f"{model},{quantization}"], capture_output=True, text=True)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{label}: failed\n{done.stderr[-4000:]}")
            rounds[label].append(json.loads(line[len("RESULT "):]))
    results = {label: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
               for label, runs in rounds.items()}
    plugin, peer = results.values()
    print(f"# vLLM {args.layers} MoE layers x {args.experts} experts (Kimi K2's sizes), "
          f"{cpu_name()}, {time.strftime('%Y-%m-%d')}, medians of {args.rounds} rounds\n")
    print("| side | decode tok/s b=1 | decode tok/s b=8 | TTFT 512 tokens (s) |")
    print("| --- | ---: | ---: | ---: |")
    for label, r in results.items():
        print(f"| {label} | {r['decode_tok_s_b1']:.2f} | {r['decode_tok_s_b8']:.2f} | "
              f"{r['ttft_s']:.2f} |")
    print(f"| ratio exactness / bf16 | {plugin['decode_tok_s_b1'] / peer['decode_tok_s_b1']:.2f}x"
          f" | {plugin['decode_tok_s_b8'] / peer['decode_tok_s_b8']:.2f}x | "
          f"{plugin['ttft_s'] / peer['ttft_s']:.2f}x |")
    pairs = list(zip(*rounds.values(), strict=True))
    b1 = [p["decode_tok_s_b1"] / q["decode_tok_s_b1"] for p, q in pairs]
    b8 = [p["decode_tok_s_b8"] / q["decode_tok_s_b8"] for p, q in pairs]
    print(f"\nRound by round, decode exactness / bf16: batch 1 {min(b1):.2f}-{max(b1):.2f}x, "
          f"batch 8 {min(b8):.2f}-{max(b8):.2f}x.")
    print(f"The plugin's MoE calls take {plugin['moe_share_b1']:.0%} of a decode step at "
          f"batch 1, {plugin['moe_share_b8']:.0%} at batch 8; the rest is vLLM's (attention, "
          f"router, shared expert, lm_head, sampling).")
    if "amx_int8" not in Path("/proc/cpuinfo").read_text():
        print("vLLM's own int4 CPU backend (CPUExpertsInt4) needs AMX: not on this CPU.")


if __name__ == "__main__":
    main()
