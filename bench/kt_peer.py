"""kt-kernel's RAWINT4 MoE (KTransformers' CPU experts) beside this project's exact grouped MoE
call, on one Kimi-shaped layer of routed experts: speed side by side, and each one's distance from
the block computed in float64.

kt-kernel is a measurement peer, never a dependency: it lives in its own venv (.venv-kt: torch
2.13 CPU, numpy, safetensors, gguf, kt-kernel 0.7.2 without its pinned torch 2.9.1, triton, which
`import exactness` needs today, and this project installed editable), and nothing in `exactness`
imports it.

    .venv-kt/bin/python bench/kt_peer.py [--tokens 1 16 128] [--experts 16] [--top-k 8]
        [--hidden 7168] [--intermediate 2048] [--threads 2] [--precision-tokens 1 16]

What it builds: E experts, each gate [I, H], up [I, H], down [H, I] in Kimi's pack-quantized int4
(weight_packed int32 [N, K/8], nibble q + 8 at bits 4 * (k % 8) of word k // 8; weight_scale bf16
[N, K/32], q * scale), q uniform in [-8, 7] and scales over 2**-7 .. 2**-5, held by the project's
ExactExperts (exactness.kimi). kt-kernel's backend is given the addresses of those same buffers,
with no requantization: it reads the int32 words in place at every forward (as bytes, two nibbles
a byte: the same memory), and converts the bf16 scales into a copy of its own at loading (the run
checks both, by writing the live buffers, and prints it). Both take the same bf16 x [T, H], the
same top-k ids [T, top_k] int64 and fp32 weights, and give bf16 [T, H].

How kt-kernel is called: its KTMoEWrapper cannot run here, for two reasons, so this calls the
backend (kt_kernel_ext.moe.AVX2RawInt4_MOE, or whatever kt's own selection picks) directly:
- the wrapper allocates its buffers with pin_memory=True, which a CPU-only torch refuses
  ("pin_memory=True requires a CUDA or other accelerator backend");
- the wrapper's load_weights passes the backend raw pointers to the weight tensors and then
  deletes its references to them (and closes the safetensors mmaps), while the AVX2 backend
  keeps reading the weight words through those pointers at every forward: a use after free
  (freed and reused, the next forward here died with SIGSEGV). Here the experts' own buffers
  stay alive as long as the backend (KtRawInt4MoE.layers).

Timing: both in one process, alternating call by call, median of repeats, the same thread count
(torch.set_num_threads and OMP_NUM_THREADS for the exact side, kt's worker pool for kt's).
Precision: |y - truth| / ulp_bf16(truth) per output element, truth the whole block in float64
from the same dequantized weights (gate and up matmuls, SiLU(gate) * up, down, the weighted sum;
float64's own rounding is ~1e-13 relative, far below a bf16 ulp).

No `check` factory: kt-kernel exposes no single int4 linear (kt_kernel_ext.linear holds only a
LinearConfig, no operator), and the MoE is no linear: one expert at top-1 with weight 1.0 still
computes down(SiLU(gate x) * up x), and its input width is down's output width, so no choice of
weights turns it into x -> W x for an arbitrary [N, K] weight.
"""

from __future__ import annotations

import argparse
import os
import sys


def _threads_in(argv: list[str]) -> str:
    """--threads' value in argv (2 by default), before argparse and before torch is imported."""
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return "2"


if __name__ == "__main__":
    # OpenMP reads OMP_NUM_THREADS when its library loads, with torch (below): the exact C
    # kernel's OpenMP is not necessarily the one torch.set_num_threads sets
    os.environ.setdefault("OMP_NUM_THREADS", _threads_in(sys.argv))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contextlib  # noqa: E402
import platform  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.bench_forward import random_layer, side_by_side  # noqa: E402
from exactness import moe  # noqa: E402
from exactness.kimi import ExactExperts  # noqa: E402

REPEATS = {1: 21, 16: 11, 128: 7}  # per token count: a call is ~T times longer
KIMI_ROUTED_SCALE = 2.827  # Kimi K2's routed_scaling_factor: the routing weights' sum


# ---------------------------------------------------------------- the layer, as Kimi stores it

def kimi_experts(experts: int, hidden: int, inter: int, seed: int = 0) -> ExactExperts:
    """The exact experts module (16-bit activations, the default) holding random weights."""
    generator = torch.Generator().manual_seed(seed)
    module = ExactExperts(experts, hidden, inter, torch.nn.SiLU())
    for expert in module:
        for layer in (expert.gate_proj, expert.up_proj, expert.down_proj):
            random_layer(layer, generator)
    return module


def routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k distinct experts at random, ids int64; fp32 weights summing to Kimi's
    routed scale."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    return ids.contiguous(), (weights / weights.sum(1, keepdim=True) * KIMI_ROUTED_SCALE).float()


# ---------------------------------------------------------------- kt-kernel, called directly

@contextlib.contextmanager
def quiet_stdout():
    """kt's C++ prints greetings to file descriptor 1 as it builds its pool and experts."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


class KtRawInt4MoE:
    """kt-kernel's RAWINT4 backend over `experts`' own buffers, what NativeMoEWrapper.load_weights
    builds (kt_kernel/utils/amx.py) without its pinned buffers and without freeing the tensors."""

    def __init__(self, experts: ExactExperts, top_k: int, threads: int, max_tokens: int):
        import kt_kernel  # noqa: F401  (loads the extension for this CPU as kt_kernel_ext)
        import kt_kernel_ext
        from kt_kernel.utils.amx import _select_rawint4_backend
        from kt_kernel_ext.moe import MOEConfig

        first = experts[0]
        hidden, inter = first.gate_proj.in_features, first.gate_proj.out_features
        self.top_k, self.hidden, self.max_tokens = top_k, hidden, max_tokens
        # kept alive as long as the backend: it reads the weight words through raw pointers
        # into these layers' buffers at every forward
        self.layers = [[getattr(e, p) for e in experts] for p in ("gate_proj", "up_proj",
                                                                   "down_proj")]
        self.gpu_mask = torch.zeros(len(experts), dtype=torch.bool)  # no expert on a GPU
        self.identity = torch.arange(len(experts), dtype=torch.int64)  # physical -> logical
        self.backend_cls = _select_rawint4_backend(32)
        with quiet_stdout():
            pool = kt_kernel_ext.WorkerPoolConfig()
            pool.subpool_count, pool.subpool_numa_map = 1, [0]
            pool.subpool_thread_count = [threads]
            self.cpu_infer = kt_kernel_ext.CPUInfer(pool)
            config = MOEConfig(len(experts), top_k, hidden, inter, self.gpu_mask.data_ptr())
            config.layer_idx, config.pool, config.max_len = 0, self.cpu_infer.backend_, max_tokens
            # [numa][expert] addresses of the checkpoint's own buffers. The int32 words are read
            # as bytes, two nibbles a byte, which is the same memory (little-endian); the bf16
            # scales are converted into kt's own copy by load_weights_task
            gate, up, down = self.layers
            config.gate_projs = [[layer.weight_packed.data_ptr() for layer in gate]]
            config.up_projs = [[layer.weight_packed.data_ptr() for layer in up]]
            config.down_projs = [[layer.weight_packed.data_ptr() for layer in down]]
            config.gate_scales = [[layer.weight_scale.data_ptr() for layer in gate]]
            config.up_scales = [[layer.weight_scale.data_ptr() for layer in up]]
            config.down_scales = [[layer.weight_scale.data_ptr() for layer in down]]
            config.quant_config.bits, config.quant_config.group_size = 4, 32
            config.quant_config.zero_point = False  # symmetric: value = (nibble - 8) * scale
            self.moe = self.backend_cls(config)
            self.cpu_infer.submit(self.moe.load_weights_task(self.identity.data_ptr()))
            self.cpu_infer.sync()

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 [T, H]: the routed experts' weighted sum for bf16 x [T, H], ids int64 and fp32
        weights [T, top_k], all contiguous on the CPU."""
        # kt reads raw pointers: anything else would be read as garbage, not refused
        assert x.dtype == torch.bfloat16 and ids.dtype == torch.int64
        assert weights.dtype == torch.float32 and ids.shape == (x.shape[0], self.top_k)
        assert x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()
        if out is None:
            out = torch.empty(x.shape, dtype=torch.bfloat16)
        tokens = torch.tensor([x.shape[0]], dtype=torch.int32)  # kt reads T through a pointer
        self.cpu_infer.submit(self.moe.forward_task(
            tokens.data_ptr(), self.top_k, ids.data_ptr(), weights.data_ptr(), x.data_ptr(),
            out.data_ptr(), False))  # False: not incremental, out is overwritten
        self.cpu_infer.sync()
        return out


# ---------------------------------------------------------------- the truth, in float64

def dequantized64(layer) -> torch.Tensor:
    """q * scale [N, K] in float64 (exact: q has 4 bits, a bf16 scale 8)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((layer.weight_packed[:, :, None] >> shifts) & 15) - 8
    return (q.reshape(layer.out_features, -1).double()
            * layer.weight_scale.double().repeat_interleave(32, 1))


def truth64(experts: ExactExperts, x: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    """The block in float64 [T, H], one routed expert's weights dequantized at a time (a whole
    Kimi expert is 350 MB in float64)."""
    x64 = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        expert = experts[e]
        gate = x64[token] @ dequantized64(expert.gate_proj).T
        up = x64[token] @ dequantized64(expert.up_proj).T
        h = gate / (1 + torch.exp(-gate)) * up  # SiLU(gate) * up
        y = h @ dequantized64(expert.down_proj).T
        out.index_add_(0, token, y * weights[token, slot, None].double())
    return out


def ulps(y: torch.Tensor, truth: torch.Tensor) -> np.ndarray:
    """|y - truth| in bf16 ulps at the true value: ulp(t) = 2**(max(floor(log2 |t|), -126) - 7)
    (exactness/suite/truth.py's ulp_errors takes an exact integer truth; this one is float64)."""
    t = truth.numpy().ravel()
    exponent = np.maximum(np.floor(np.log2(np.abs(t), where=t != 0, out=np.full_like(t, -126.0))),
                          -126)
    err = np.abs(y.double().numpy().ravel() - t) / np.ldexp(1.0, (exponent - 7).astype(int))
    return np.where(np.isfinite(y.double().numpy().ravel()), err, np.inf)


def row_scaled(y: torch.Tensor, truth: torch.Tensor) -> float:
    """The largest |y - truth| in bf16 ulps of its row's largest |truth|: the ulps above blow up
    where a token's weighted sum cancels to near 0, and this shows what is left without that."""
    top = truth.abs().amax(1, keepdim=True)
    ulp = torch.exp2(torch.floor(torch.log2(top)).clamp_min(-126) - 7)
    return float(((y.double() - truth).abs() / ulp).max())


def summary(y: torch.Tensor, truth: torch.Tensor) -> str:
    err = ulps(y, truth)
    return (f"{np.median(err):.3f} | {np.percentile(err, 99):.2f} | {err.max():.2f} | "
            f"{100 * np.mean(err <= 0.5):.1f}% | {100 * np.mean(err <= 1):.1f}% | "
            f"{row_scaled(y, truth):.2f}")


# ---------------------------------------------------------------- the run

def cpu_line() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    shown = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return f"{model}, {os.cpu_count()} cores, flags: {' '.join(shown)}"


def exact_plan(experts: ExactExperts, x: torch.Tensor) -> str:
    """The grouped kernel the exact call takes for x, and why (exactness.moe.plan)."""
    layers = [(e.gate_proj, e.up_proj, e.down_proj) for e in experts]
    chosen = moe.plan(layers, x)
    return "per-expert loop (no grouped kernel)" if chosen is None else str(chosen)


def count_loop_fallbacks(experts: ExactExperts) -> list[int]:
    """A counter of the exact call's fallbacks to its per-expert loop (where the grouped kernel
    could not run): ExactExperts.forward reaches the loop through self.per_expert."""
    calls = [0]
    loop = experts.per_expert

    def counted(*args):
        calls[0] += 1
        return loop(*args)

    experts.per_expert = counted
    return calls


def reads_live(kt: KtRawInt4MoE, experts: ExactExperts, hidden: int, top_k: int) -> dict:
    """For the weight words and for the scales: whether kt reads the experts' live buffers (a
    write in place after loading changes kt's output) rather than a copy made at loading. Every
    write is undone, and the first output must come back."""
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(7)).bfloat16()
    ids, weights = routing(1, len(experts), top_k, seed=7)
    gate = experts[int(ids[0, 0])].gate_proj
    before = kt(x, ids, weights)
    seen = {}
    with torch.no_grad():
        gate.weight_scale.mul_(2)  # exact in bf16
        seen["scales"] = not torch.equal(before, kt(x, ids, weights))
        gate.weight_scale.div_(2)
        gate.weight_packed.bitwise_xor_(0x11111111)  # every nibble changed, undone by itself
        seen["weight words"] = not torch.equal(before, kt(x, ids, weights))
        gate.weight_packed.bitwise_xor_(0x11111111)
    assert torch.equal(before, kt(x, ids, weights)), "kt: the writes were not undone"
    return seen


def resident_mib() -> float:
    """This process's resident memory, MiB (/proc/self/statm's second field, in pages)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def batch_invariant(call, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether each token's output bits are the same alone as in the batch."""
    together = call(x, ids, weights).clone()
    return all(torch.equal(call(x[r:r + 1], ids[r:r + 1].contiguous(),
                                weights[r:r + 1].contiguous()), together[r:r + 1])
               for r in range(x.shape[0]))


def print_header(args, kt: KtRawInt4MoE, experts: ExactExperts) -> None:
    import kt_kernel

    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {cpu_line()}; load average "
          f"{os.getloadavg()[0]:.2f} (other processes share these cores)")
    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS')}; kt-kernel "
          f"{kt_kernel.__version__}, extension variant {kt_kernel.__cpu_variant__}, backend "
          f"{kt.backend_cls.__name__}, {args.threads} worker threads")
    print(f"layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, "
          f"intermediate {args.intermediate}, int4 group 32, bf16 in and out")
    probe = torch.zeros(1, args.hidden, dtype=torch.bfloat16)
    print(f"exact grouped plan: {exact_plan(experts, probe)}", flush=True)


def timing_table(args, kt: KtRawInt4MoE, experts: ExactExperts, loop_calls: list[int]) -> None:
    print("\n| T | kt ms | exact ms | ratio exact/kt |\n| --- | --- | --- | --- |", flush=True)
    for t in args.tokens:
        x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(t)).bfloat16()
        ids, weights = routing(t, args.experts, args.top_k, seed=t)
        kt_s, exact_s = side_by_side([lambda: kt(x, ids, weights),
                                      lambda: experts(x, ids, weights)], REPEATS.get(t, 3))
        print(f"| {t} | {kt_s * 1e3:.1f} | {exact_s * 1e3:.1f} | {exact_s / kt_s:.2f} |",
              flush=True)
    print(f"\nexact calls that fell back to the per-expert loop: {loop_calls[0]}; load average "
          f"{os.getloadavg()[0]:.2f}")


def precision_table(args, kt: KtRawInt4MoE, experts: ExactExperts) -> None:
    print("\nulps of bf16 against the block in float64 (same dequantized weights)\n")
    print("| T | side | median | p99 | max | <= 0.5 ulp | <= 1 ulp | max, in ulps of the "
          "row's largest | batch-invariant |\n| --- | --- | --- | --- | --- | --- | --- | --- "
          "| --- |")
    for t in args.precision_tokens:
        x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(1000 + t))
        x = x.bfloat16()
        ids, weights = routing(t, args.experts, args.top_k, seed=1000 + t)
        truth = truth64(experts, x, ids, weights)
        y_kt = kt(x, ids, weights, out=torch.full(x.shape, float("nan"), dtype=torch.bfloat16))
        # a NaN-filled out, then a fresh one: kt overwrites all of out, with the same bits
        assert torch.equal(y_kt, kt(x, ids, weights)), "kt: out not overwritten, or not repeatable"
        y_exact = experts(x, ids, weights)
        for side, y, call in (("kt RAWINT4", y_kt, kt), ("exact", y_exact, experts)):
            invariant = "yes" if batch_invariant(call, x, ids, weights) else "no"
            print(f"| {t} | {side} | {summary(y, truth)} | {invariant if t > 1 else '-'} |",
                  flush=True)


def outputs_only(args, experts: ExactExperts, inputs: str, outputs: str) -> int:
    """kt's y for each (x, ids, weights) of `inputs` (a list, torch.save'd), into `outputs`;
    the experts are kimi_experts' (seed 0), the ones bench/block_precision.py builds."""
    cases = torch.load(inputs)
    kt = KtRawInt4MoE(experts, args.top_k, args.threads, max(x.shape[0] for x, _, _ in cases))
    torch.save([kt(x.contiguous(), ids.contiguous(), weights.contiguous()).clone()
                for x, ids, weights in cases], outputs)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision-tokens", type=int, nargs="*", default=[1, 16],
                        help="token counts to measure precision at (float64 truth)")
    parser.add_argument("--outputs", nargs=2, metavar=("INPUTS", "OUTPUTS"),
                        help="only kt's outputs, for bench/block_precision.py: each (x, ids, "
                             "weights) of the torch file INPUTS, kt's y into OUTPUTS")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    experts = kimi_experts(args.experts, args.hidden, args.intermediate)
    if args.outputs:
        return outputs_only(args, experts, *args.outputs)
    loop_calls = count_loop_fallbacks(experts)
    held = resident_mib()
    kt = KtRawInt4MoE(experts, args.top_k, args.threads,
                      max(args.tokens + args.precision_tokens))
    held = resident_mib() - held
    buffers = sum(t.numel() * t.element_size() for t in experts.buffers()) / 2**20
    print_header(args, kt, experts)
    print(f"the experts' buffers: {buffers:.0f} MiB; kt's backend adds {held:.0f} MiB resident "
          f"at loading (its copies and its buffers for {kt.max_tokens} tokens)")
    for part, live in reads_live(kt, experts, args.hidden, args.top_k).items():
        where = "in place (the live buffers)" if live else "from a copy made at loading"
        print(f"kt reads the {part}: {where}")
    timing_table(args, kt, experts, loop_calls)
    if args.precision_tokens:
        precision_table(args, kt, experts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
