"""GPU check, in one run: bit-exactness of the Triton kernel on CUDA against the reference, the
refusal of a non-finite x (the kernel's row flags, read back by the layer), then kernel vs torch
bf16 matmul timings (CUDA events, median), as ratios, with the forward's two GPU paths side by
side (the group kernel; linear_folded, taken from triton_layer.FOLDED_MIN_ROWS rows), each
also replayed from a CUDA graph (the device's time without the host's launches), then the
quantization alone and the group kernel's other tiles and warp counts at M = 1, 16, 128 and 4096
(same bits, their times), so that one run on a lent GPU also says which launch and crossover to
make the default. Last, an MoE layer's routed experts at Kimi's sizes (moe_check): the grouped
call's bits against the per-expert loop, its read-backs counted (one a call), its time beside the
loop's and transformers' bf16 experts'. Then a checkpoint streamed straight to the GPU
(load_check). Prints tables; exit 1 on any differing bit, a non-finite
x let through, a capture not refused or a second read-back."""

from __future__ import annotations

import sys

import numpy as np
import torch

from exactness.contract import BFLOAT16
from exactness.formats import pack_weights
from exactness.kernels.triton import folded as triton_folded
from exactness.kernels.triton import group as triton_group
from exactness.kernels.triton import layer as triton_layer
from exactness.kernels.triton import quantize as triton_quantize
from exactness.suite.cases import LinearCase, load_vectors
from exactness.suite.paths import run


def cuda_ms(fn, repeats=50) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def graph_ms(fn, repeats=20, calls=20) -> float:
    """fn's ms a call, replayed from a CUDA graph of `calls` calls: the device's own time, without
    the host's launches in between (what a model run under CUDA graphs would see). The layer
    itself refuses capture (its flags' read-back): this times its launches alone."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, allocator) off the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_ms(graph.replay, repeats) / calls


def graphed(layer, x, w) -> str:
    """Table cells: the quantization, both paths (both_paths) and bf16, each under a CUDA graph."""
    try:
        quantize = graph_ms(lambda: triton_quantize.quantize(x, 16))
        group, folded, _ = both_paths(layer, x, graph_ms)
        return f"{quantize:.3f} | {group} | {folded} | {graph_ms(lambda: x @ w.t()):.3f}"
    except Exception as error:  # say so, go on: the rest of the run still counts
        return f"failed: {type(error).__name__}: {str(error)[:80]} | | |"


def kimi_on(k: int, n: int, device: str):
    """bench_forward's Kimi layer (16-bit activations) on `device`, running the Triton kernel,
    and its bf16 weight there."""
    from bench.bench_forward import dequantized_bf16, kimi_layer

    layer = kimi_layer(k, n, 16)
    w = dequantized_bf16(layer).to(device)
    layer = layer.to(device)
    layer.backend = "triton"
    return layer, w


def main() -> int:
    assert torch.cuda.is_available(), "no CUDA device"
    bad = 0
    for case in load_vectors():  # every width: the group kernel carries 32-bit activations
        bad += int(not (run(case, "triton") == case.expected).all())
    rng = np.random.default_rng(0)
    for (k, n), m, act_bits in [((7168, 2048), 1, 16), ((2048, 7168), 16, 16),
                                ((7168, 2048), 300, 8), ((2048, 7168), 33, 4),
                                ((7168, 2048), 16, 32), ((2048, 7168), 100, 32)]:
        q = rng.integers(-8, 8, (n, k))
        case = LinearCase(rng.integers(0, 0x7F00, (m, k)), BFLOAT16, q, pack_weights(q, 4),
                          0x3C00 + rng.integers(0, 256, (n, k // 32)), act_bits, BFLOAT16)
        bad += int(not (run(case, "triton") == run(case, "reference")).all())
    print(f"bit-exactness: {'OK' if bad == 0 else f'{bad} cases differ'}")
    nan_rows = nonfinite_rows("cuda")
    print(f"non-finite x: {'NaN rows; strict: ValueError with the count' if nan_rows else 'WRONG'}")
    bad += not nan_rows
    captured = capture_refused()
    print(f"CUDA-graph capture: {'refused, typed' if captured else 'NOT REFUSED CLEARLY'}")
    bad += not captured
    print(f"| shape | M | exact ms (layer) | bf16 ms | ratio bf16/exact (speed-up) | "
          f"group kernel ms (K split as k_slices says / whole) | folded ms "
          f"(triton_layer.FOLDED_MIN_ROWS = {triton_layer.FOLDED_MIN_ROWS}) | "
          f"graphed: quantize ms | graphed: group ms | graphed: folded ms | graphed: bf16 ms |")
    for k, n in ((7168, 2048), (2048, 7168)):
        layer, w = kimi_on(k, n, "cuda")
        for m in (1, 16, 32, 64, 128, 512, 4096):
            x = torch.randn(m, k, device="cuda").bfloat16()
            exact, bf16 = cuda_ms(lambda: layer(x)), cuda_ms(lambda: x @ w.t())
            group, folded, same = both_paths(layer, x)
            bad += not same
            print(f"| {k}->{n} | {m} | {exact:.3f} | {bf16:.3f} | {bf16 / exact:.2f} | "
                  f"{group} | {folded}{'' if same else ' DIFFERENT BITS'} | "
                  f"{graphed(layer, x, w)} |")
    bad += tiles()
    bad += moe_check()
    bad += load_check()
    return 1 if bad else 0


def load_check(experts: int = 8) -> int:
    """bench_load's checkpoint (full-width experts), streamed straight to the GPU by both
    loaders: every routed tensor on the device and equal to the CPU load's, an expert's output
    the same bits as on the CPU, and the time beside the CPU load's. Returns 1 on a
    difference."""
    import tempfile
    import time
    from pathlib import Path

    from bench.bench_load import write
    from exactness import hf
    from exactness.kimi import KimiConfig, KimiModel, convert_kimi_to_exact

    directory = write(Path(tempfile.mkdtemp()) / "load", experts)
    loaded, seconds = {}, {}
    for device in ("cpu", "cuda"):
        with torch.device("meta"):
            model = KimiModel(KimiConfig(hidden_size=7168, moe_intermediate_size=2048,
                                         n_routed_experts=experts, num_hidden_layers=1,
                                         first_k_dense_replace=0))
        start = time.perf_counter()
        report = convert_kimi_to_exact(model, directory, device=device, progress=False)
        torch.cuda.synchronize()
        seconds[device] = (time.perf_counter() - start, report.bytes_read)
        loaded[device] = model
    cpu, gpu = (dict(loaded[d].named_buffers()) for d in ("cpu", "cuda"))
    same = all(b.device.type == "cuda" and torch.equal(b.cpu(), cpu[n]) for n, b in gpu.items())
    layer = {d: loaded[d].model.layers[0].mlp.experts[0].gate_proj for d in loaded}
    x = torch.randn(4, 7168).bfloat16()
    same &= torch.equal(layer["cuda"](x.cuda()).cpu(), layer["cpu"](x))
    model = hf.from_pretrained(directory, device="cuda", progress=False)
    on_gpu = {t.device.type for t in (*model.parameters(), *model.buffers())} == {"cuda"}
    print(f"load to the GPU: {'same tensors and bits as the CPU' if same else 'DIFFERENT'}; "
          f"from_pretrained: {'all on cuda' if on_gpu else 'NOT ALL ON CUDA'}; " + ", ".join(
              f"{d} {s:.2f} s ({b / s / 1e9:.2f} GB/s)" for d, (s, b) in seconds.items()))
    return int(not (same and on_gpu))


def moe_check(experts: int = 32, tokens=(1, 16, 128, 1024)) -> int:
    """bench_moe's layer on the GPU: the grouped call (triton-grouped) against the per-expert
    loop, bit for bit, with its read-backs counted, and the three side by side (CUDA events).
    Returns how many token counts failed."""
    from bench.bench_moe import HIDDEN, experts_pair, routing
    from exactness import moe

    exact, bf16 = experts_pair(experts, 16)
    exact, bf16 = exact.to("cuda"), bf16.to("cuda")
    reads, read_back = [], moe.read_back
    moe.read_back = lambda counts: (reads.append(1), read_back(counts))[1]
    bad = 0
    print(f"| {experts} experts, top-8: T | read-backs a call | grouped ms | per-expert ms | "
          f"bf16 ms | grouped / bf16 | grouped / per-expert |")
    for t in tokens:
        x = torch.randn(t, HIDDEN, device="cuda").bfloat16()
        ids, weights = (v.to("cuda") for v in routing(t, experts, t))
        reads.clear()
        y = exact(x, ids, weights)
        count = len(reads)
        same = torch.equal(y, exact.per_expert(x, ids, weights))
        grouped = cuda_ms(lambda: exact(x, ids, weights), 20)
        loop = cuda_ms(lambda: exact.per_expert(x, ids, weights), 10)
        base = cuda_ms(lambda: bf16(x, ids, weights), 20)
        bad += not same or count != 1
        print(f"| {t} | {count} | {grouped:.3f}{'' if same else ' DIFFERENT BITS'} | "
              f"{loop:.3f} | {base:.3f} | {grouped / base:.2f} | {grouped / loop:.2f} |")
    moe.read_back = read_back
    return bad


def nonfinite_rows(device: str) -> bool:
    """Whether the Triton forward on `device` gives x's rows with an inf and a NaN the
    canonical NaN (contract v1.2) with nothing read back, the other row its own bits, and a
    strict layer refuses them with the count and the first index."""
    from exactness.contract import NonFiniteError
    from exactness.formats import tensor_to_bits
    from exactness.modules import ExactLinear

    layer = ExactLinear.from_weight(torch.randn(4, 64), backend="triton").to(device)
    x = torch.randn(3, 64).bfloat16().to(device)
    clean = tensor_to_bits(layer(x[:1]))
    x[1, 5], x[2, 7] = float("inf"), float("nan")
    y = tensor_to_bits(layer(x))
    if not ((y[1:] == 0x7FC0).all() and (y[:1] == clean).all()):
        return False
    layer.strict = True
    try:
        layer(x)
    except NonFiniteError as error:
        return "x has 2 non-finite value(s); the first at index (1, 5)" in str(error)
    return False


def capture_refused() -> bool:
    """Whether a forward under CUDA-graph capture raises the layer's own error before it
    launches anything (its buffer compare reads the device), and the layer
    still runs eagerly afterwards."""
    from exactness.contract import ContractValueError
    from exactness.modules import ExactLinear

    layer = ExactLinear.from_weight(torch.randn(4, 64)).to("cuda")
    x = torch.randn(3, 64, device="cuda").bfloat16()
    layer(x)  # compiled and derived before the capture
    refused = False
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layer(x)
    except ContractValueError as error:
        refused = "CUDA graph" in str(error)
    except RuntimeError:  # torch's own, from inside the capture: not the layer's error
        refused = False
    return refused and layer(x).shape == (3, 4)


def both_paths(layer, x, timer=None) -> tuple[str, str, bool]:
    """The forward's two GPU paths on x, each without the layer's Python: the group kernel's ms
    (K split as k_slices says / whole), linear_folded's ms (or "-" where it does not take x) and
    whether all their bits agree."""
    from exactness.dataflow import folded_weight_limbs

    timer = timer or cuda_ms
    cert = layer.certificate
    limbs, e_r, _ = triton_quantize.quantize(x, 16)
    gpu = triton_layer.gpu_weights(layer.weights(), x.device)
    args = (limbs, e_r, layer.weight_packed, *gpu, 4)
    split = timer(lambda: triton_group.linear(*args, torch.bfloat16))
    whole = timer(lambda: triton_group.linear(*args, torch.bfloat16, slices=1))
    want = triton_group.linear(*args, torch.bfloat16, slices=1).view(torch.int16)
    same = bool((triton_group.linear(*args, torch.bfloat16).view(torch.int16) == want).all())
    group = f"{split:.3f} / {whole:.3f}"
    if not triton_folded.folded_fits(x.shape[0], layer.out_features, layer.in_features):
        return group, "-", same
    digits = folded_weight_limbs(4, cert.fast_spread)
    same &= bool((triton_folded.linear_folded(*args, digits, torch.bfloat16).view(torch.int16)
                  == want).all())
    folded = timer(lambda: triton_folded.linear_folded(*args, digits, torch.bfloat16))
    return group, f"{folded:.3f} ({digits} digits)", same


def tiles(shapes=((7168, 2048), (2048, 7168)), batches=(1, 16, 128, 4096), device="cuda",
          timer=None) -> int:
    """The group kernel alone at other tiles: bits against the default launch, and times (the
    quantize kernel's time apart). Returns how many launches gave other bits. (The suite runs it
    small under the interpreter: tests/test_modules.py.)"""
    timer = timer or cuda_ms
    bad = 0
    print("| shape | M | BLOCK_M x BLOCK_N, warps | group kernel ms | bf16 ms | ratio bf16/group |")
    for k, n in shapes:
        layer, w = kimi_on(k, n, device)
        layer(torch.zeros(1, k, device=device).bfloat16())  # derives the certificate
        gpu = triton_layer.gpu_weights(layer.weights(), torch.device(device))
        args = (layer.weight_packed, *gpu, 4,
                torch.bfloat16)
        for m in batches:
            x = torch.randn(m, k, device=device).bfloat16()
            limbs, e_r, _ = triton_quantize.quantize(x, 16)
            print(f"| {k}->{n} | {m} | quantize_kernel | "
                  f"{timer(lambda: triton_quantize.quantize(x, 16)):.3f} | | |")
            want = triton_group.linear(limbs, e_r, *args)
            bf16 = timer(lambda: x @ w.t())
            for bm, bn, warps in triton_group.TUNING_TILES:
                try:
                    y = triton_group.linear(limbs, e_r, *args, bm, bn, warps)
                    same = bool((y.view(torch.int16) == want.view(torch.int16)).all())
                    ms = timer(lambda: triton_group.linear(limbs, e_r, *args, bm, bn, warps))
                except Exception as error:  # a launch that does not compile: say so, go on
                    print(f"| {k}->{n} | {m} | {bm} x {bn}, {warps} | failed: "
                          f"{type(error).__name__}: {str(error)[:80]} | | |")
                    continue
                bad += not same
                print(f"| {k}->{n} | {m} | {bm} x {bn}, {warps} | {ms:.3f}"
                      f"{'' if same else ' DIFFERENT BITS'} | {bf16:.3f} | {bf16 / ms:.2f} |")
    return bad


if __name__ == "__main__":
    sys.exit(main())
