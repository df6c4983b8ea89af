"""GPU check, in one run. First bits and CUDA graphs, so that a run cut short still reports
them: the Triton kernel against the reference; a non-finite x's rows NaN; the forward captured
and replayed at Kimi's sizes, eager and reference bits, also after weights (a slow row) and x (a
NaN row) are written in place (capture_check); no sync in a forward or an MoE call
(sync_check); the MoE experts captured, new routing written in place (moe_capture_check); the
vLLM plugin's op over stacked experts captured (stacked_capture_check); the host's time beyond
the kernels' (host_overhead). Then timings (CUDA events, medians): kernel vs bf16 matmul, the
group and folded paths, each also from a CUDA graph, the quantization and the group kernel's
tiles; the MoE experts vs the per-expert loop and bf16, read-backs counted (moe_check); a
checkpoint streamed to the GPU (load_check). Prints tables; exit 1 on any differing bit, a
non-finite x let through, a failed capture or a read-back; 3 without CUDA (nothing checked:
unknown). `--parts` runs some of it: exact, capture, tables (the default: all three), memcheck
(a few shapes once, for compute-sanitizer: bench/gpu_check.sh)."""

from __future__ import annotations

import functools
import itertools
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from exactness.contract import BFLOAT16
from exactness.formats import pack_weights, tensor_to_bits, unpack_weights
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


def captured(fn, calls: int = 1):
    """(a CUDA graph of `calls` calls of fn, the last call's output), after a warm-up off the
    capture, on a side stream (compilation, the allocator, weight_shape's one read)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out


def graph_ms(fn, repeats=20, calls=20) -> float:
    """fn's ms a call, replayed from a CUDA graph of `calls` calls: the device's own time, without
    the host's launches in between (what a model run under CUDA graphs would see)."""
    graph, _ = captured(fn, calls)
    return cuda_ms(graph.replay, repeats) / calls


def kernels_ms(fn, repeats=20) -> float:
    """One call of fn's kernel (and copy) times summed, by torch's profiler over replays of its
    CUDA graph: the device's work alone; NaN where the profiler saw none or cannot run."""
    graph, _ = captured(fn)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                graph.replay()
            torch.cuda.synchronize()
        us = sum(e.device_time_total for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # no profiler here (CUPTI): a timing, not a failure
        us = 0
    return us / repeats / 1e3 if us else float("nan")


@contextmanager
def reads_counted():
    """A list of the synchronizing CUDA calls (read-backs) made inside the block, filled as it
    ends: torch's sync debug warnings."""
    reads: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield reads
        finally:
            torch.cuda.set_sync_debug_mode(0)
    reads.extend(w for w in caught if "synchroniz" in str(w.message))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b hold the same bits (NaNs included): bit views, never a tolerance."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def graphed(layer, x, w) -> str:
    """Table cells: the quantization, both paths (both_paths) and bf16, each under a CUDA graph."""
    try:
        quantize = graph_ms(lambda: triton_quantize.quantize(x, 16))
        group, folded, _ = both_paths(layer, x, graph_ms)
        return f"{quantize:.3f} | {group} | {folded} | {graph_ms(lambda: x @ w.t()):.3f}"
    except Exception as error:  # say so, go on: the rest of the run still counts
        return f"failed: {type(error).__name__}: {str(error)[:80]} | | |"


def kimi_on(k: int, n: int, device: str, act_bits: int = 16):
    """bench_forward's Kimi layer (16-bit activations unless told) on `device`, running the
    Triton kernel, and its bf16 weight there."""
    from bench.bench_forward import dequantized_bf16, kimi_layer

    layer = kimi_layer(k, n, act_bits)
    w = dequantized_bf16(layer).to(device)
    layer = layer.to(device)
    layer.backend = "triton"
    return layer, w


PARTS = ("exact", "capture", "tables", "memcheck")
NO_GPU = 3  # bench/gpu_check.sh reads it as unknown: nothing was checked


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python bench/gpu_check.py")
    parser.add_argument("--parts", default="exact,capture,tables",
                        help=f"comma-separated, of {', '.join(PARTS)}")
    parts = parser.parse_args(argv).parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}, got {','.join(parts)}")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return NO_GPU
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bad = 0
    if "exact" in parts:
        bad += exact_check()
    if "capture" in parts:
        for check in (capture_check, sync_check, moe_capture_check, stacked_capture_check,
                      host_overhead):
            bad += guarded(check)  # before the long tables: a run cut short still reports these
    if "memcheck" in parts:
        bad += memcheck_shapes()
    if "tables" in parts:
        bad += speed_tables()
    return 1 if bad else 0


def memcheck_shapes() -> int:
    """A few shapes once each, small enough for compute-sanitizer's memcheck (every access
    checked, ~100x slower): the layer's paths (group, folded, 32-bit activations, a slow row, a
    NaN row, a tail of K and N), each against the reference, and one grouped MoE call, run for
    memcheck's sake only."""
    rng = np.random.default_rng(1)
    bad = 0
    for (k, n), m, act_bits in [((256, 40), 3, 16), ((512, 72), 70, 8), ((96, 24), 5, 32),
                                ((7168, 64), 17, 16)]:
        q = rng.integers(-8, 8, (n, k))
        scales = 0x3C00 + rng.integers(0, 256, (n, k // 32))
        scales[1, 0::2], scales[1, 1::2] = 0x2180, 0x5380  # a slow row: 2**-60 and 2**40
        x = rng.integers(0, 0x7F00, (m, k))
        x[m - 1, 0] = 0x7FC0  # a NaN row
        case = LinearCase(x, BFLOAT16, q, pack_weights(q, 4), scales, act_bits, BFLOAT16)
        same_bits = bool((run(case, "triton") == run(case, "reference")).all())
        print(f"memcheck shape K={k} N={n} M={m} act_bits={act_bits}: "
              f"{'exact' if same_bits else 'DIFFERENT BITS'}", flush=True)
        bad += not same_bits
    experts = exact_experts(4)
    x, ids, weights = routed(5, 4, 0)
    y = experts(x, ids, weights)
    torch.cuda.synchronize()
    print(f"memcheck MoE call, 4 experts, 5 tokens: {tuple(y.shape)} done", flush=True)
    return bad


def exact_check() -> int:
    """The contract's vectors and six Kimi-size cases against the reference; x's non-finite
    rows NaN."""
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
    return bad + (not nan_rows)


def speed_tables() -> int:
    """The timings: the layer against bf16, each path, graphed; tiles; the MoE call; a load."""
    bad = 0
    print(f"| shape | M | exact ms (layer) | bf16 ms | ratio bf16/exact (speed-up) | "
          f"group kernel ms (K split as k_slices says / whole) | folded ms "
          f"(triton_layer.FOLDED_MIN_ROWS = {triton_layer.FOLDED_MIN_ROWS}) | "
          f"graphed: quantize ms | graphed: group ms | graphed: folded ms | graphed: bf16 ms |")
    for k, n in ((7168, 2048), (2048, 7168)):
        layer, w = kimi_on(k, n, "cuda")
        for m in (1, 16, 32, 64, 128, 512, 4096):
            x = torch.randn(m, k, device="cuda").bfloat16()
            exact, bf16 = cuda_ms(lambda: layer(x)), cuda_ms(lambda: x @ w.t())
            group, folded, agree = both_paths(layer, x)
            bad += not agree
            print(f"| {k}->{n} | {m} | {exact:.3f} | {bf16:.3f} | {bf16 / exact:.2f} | "
                  f"{group} | {folded}{'' if agree else ' DIFFERENT BITS'} | "
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
    loop, bit for bit, with its read-backs counted (reads_counted; none), and the three side by
    side (CUDA events). Returns how many token counts failed."""
    from bench.bench_moe import HIDDEN, experts_pair, routing

    exact, bf16 = experts_pair(experts, 16)
    exact, bf16 = exact.to("cuda"), bf16.to("cuda")
    bad = 0
    print(f"| {experts} experts, top-8: T | read-backs a call | grouped ms | per-expert ms | "
          f"bf16 ms | grouped / bf16 | grouped / per-expert |")
    for t in tokens:
        x = torch.randn(t, HIDDEN, device="cuda").bfloat16()
        ids, weights = (v.to("cuda") for v in routing(t, experts, t))
        exact(x, ids, weights)  # compilation
        with reads_counted() as reads:
            y = exact(x, ids, weights)
        count = len(reads)
        same = torch.equal(y, exact.per_expert(x, ids, weights))
        grouped = cuda_ms(lambda: exact(x, ids, weights), 20)
        loop = cuda_ms(lambda: exact.per_expert(x, ids, weights), 10)
        base = cuda_ms(lambda: bf16(x, ids, weights), 20)
        bad += not same or count != 0
        print(f"| {t} | {count} | {grouped:.3f}{'' if same else ' DIFFERENT BITS'} | "
              f"{loop:.3f} | {base:.3f} | {grouped / base:.2f} | {grouped / loop:.2f} |")
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


def guarded(check) -> int:
    """check()'s failures (False: one), or 1 with its error printed: one check that raises (a
    capture torch refuses) must not hide the others."""
    try:
        result = check()
    except Exception as error:
        print(f"{check.__name__}: FAILED, {type(error).__name__}: {str(error)[:300]}")
        return 1
    return int(not result) if isinstance(result, bool) else int(result)


def cells(results: list) -> tuple[int, str]:
    """(1 if a check failed, else 0; table cells): a bool OK or DIFFERENT, a str as it is (one
    starting "FAILED" fails)."""
    bad = any(r.startswith("FAILED") if isinstance(r, str) else not r for r in results)
    return int(bad), " | ".join(r if isinstance(r, str) else "OK" if r else "DIFFERENT"
                                for r in results)


SLOW_ROW, REFERENCE_ROWS = 3, 256  # a row past the fast kernels' spread; rows the reference runs


def new_weights(layer, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed words and scales (2**-7 .. 2**-5) for `layer`, on its device, row SLOW_ROW a
    slow row: scales 2**-60 and 2**40 in turn, a spread of 100, past the fast kernels' int64."""
    generator = torch.Generator().manual_seed(seed)
    n, k = layer.out_features, layer.in_features
    packed = torch.randint(-2**31, 2**31, (n, k // 8), dtype=torch.int32, generator=generator)
    scale = (0x3C00 + torch.randint(0, 256, (n, k // 32), generator=generator)).to(
        torch.int16).view(torch.bfloat16)
    scale[SLOW_ROW, 0::2], scale[SLOW_ROW, 1::2] = 2.0**-60, 2.0**40
    return packed.to(layer.weight_packed.device), scale.to(layer.weight_packed.device)


def reference_bits(layer, x: torch.Tensor) -> np.ndarray:
    """The reference's bits of x through the layer's first REFERENCE_ROWS rows as its buffers
    hold them now (the whole layer at M = 128 would take the reference minutes)."""
    packed = layer.weight_packed[:REFERENCE_ROWS].cpu().numpy()
    case = LinearCase(tensor_to_bits(x), BFLOAT16, unpack_weights(packed, 4, layer.in_features),
                      packed, tensor_to_bits(layer.weight_scale[:REFERENCE_ROWS]),
                      layer.act_bits, BFLOAT16)
    return run(case, "reference")


def capture_check(sizes=((7168, 2048, 16), (2048, 7168, 16), (7168, 2048, 8), (7168, 2048, 32)),
                  batches=(1, 16, 128)) -> int:
    """The forward captured and replayed: the eager and the reference bits; again after new
    weights (a slow row) and x (a NaN row, M > 1) are written in place. A forward that read
    anything back could not be captured, or would replay a stale plan. Returns the failures."""
    bad = 0
    print("| K->N | act bits | M | replay = eager = reference | after writes in place: "
          "replay = eager = reference | NaN row all NaN | slow row exact |")
    for k, n, act_bits in sizes:
        layer, _ = kimi_on(k, n, "cuda", act_bits)
        for m in batches:  # from M = 16 on, the weights the last M wrote (a slow row) first
            try:
                x = torch.randn(m, k, device="cuda").bfloat16()
                eager = layer(x)
                graph, y = captured(lambda: layer(x))
                graph.replay()
                results = [same(y, eager) and np.array_equal(
                    tensor_to_bits(y[:, :REFERENCE_ROWS]), reference_bits(layer, x))]
                packed, scale = new_weights(layer, m)
                layer.weight_packed.data.copy_(packed)
                layer.weight_scale.data.copy_(scale)
                x.copy_(torch.randn(m, k, device="cuda").bfloat16())
                if m > 1:
                    x[m - 1, k // 2] = float("nan")
                graph.replay()
                eager, want = layer(x), reference_bits(layer, x)
                got = tensor_to_bits(y[:, :REFERENCE_ROWS])
                results += [same(y, eager) and np.array_equal(got, want),
                            "-" if m == 1 else bool(y[m - 1].isnan().all()),
                            np.array_equal(got[:, SLOW_ROW], want[:, SLOW_ROW])]
            except Exception as error:  # say so, go on: the other cases still count
                results = [f"FAILED: {type(error).__name__}: {str(error)[:120]}"]
            failed, row = cells(results)
            bad += failed
            print(f"| {k}->{n} | {act_bits} | {m} | {row} |")
    return bad


@functools.cache
def exact_experts(experts: int):
    """bench_moe's exact experts at Kimi's sizes (not its bf16 twin), on the GPU."""
    from bench.bench_moe import HIDDEN, INTER, random_layer
    from exactness.kimi import ExactExperts

    exact, generator = ExactExperts(experts, HIDDEN, INTER, torch.nn.SiLU(), 16), torch.Generator()
    for e in exact:  # one generator in turn: the same weights each run
        for layer in (e.gate_proj, e.up_proj, e.down_proj):
            random_layer(layer, generator)
    return exact.to("cuda")


def routed(tokens: int, experts: int, seed: int) -> tuple[torch.Tensor, ...]:
    """x [tokens, HIDDEN], top_k_index and top_k_weights (bench_moe's routing), on the GPU."""
    from bench.bench_moe import HIDDEN, routing

    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return tuple(t.to("cuda") for t in (x, *routing(tokens, experts, seed)))


def sync_check(experts: int = 16, tokens: int = 16) -> bool:
    """A layer forward and an MoE call under torch's sync debug mode "error", each after a
    warm-up outside it: a read-back (any synchronizing CUDA call) raises there."""
    layer, _ = kimi_on(7168, 2048, "cuda")
    x = torch.randn(tokens, 7168, device="cuda").bfloat16()
    exact, args = exact_experts(experts), routed(tokens, experts, 0)
    calls = {"layer forward": lambda: layer(x), "MoE call": lambda: exact(*args)}
    failed = []
    for name, call in calls.items():
        call()  # compilation, weight_shape's one read
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        except RuntimeError as error:
            failed.append(f"{name}: {str(error)[:200]}")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    print(f"sync debug mode 'error': {'; '.join(failed) or 'no sync in ' + ', '.join(calls)}")
    return not failed


def moe_capture_check(experts: int = 16, tokens=(1, 16, 128)) -> int:
    """The MoE experts (moe.experts_forward) captured with fixed x and routing tensors, replayed:
    the eager call's bits; again after new x and routing are copied in (and the per-expert
    loop's), the eager call's read-backs counted (none). Returns the failures."""
    exact, bad = exact_experts(experts), 0
    print(f"| {experts} experts, top-8: T, block | read-backs a call | replay = eager | new "
          f"routing in place: replay = eager = per-expert |")
    for t, block in itertools.product(tokens, ("exact", "transformers")):
        exact.block = block
        try:
            args = routed(t, experts, t)
            exact(*args)  # compilation
            with reads_counted() as reads:
                eager = exact(*args)
            graph, y = captured(lambda: exact(*args))
            graph.replay()
            results = [str(len(reads)) if not reads else f"FAILED: {len(reads)}", same(y, eager)]
            for arg, new in zip(args, routed(t, experts, t + 1), strict=True):
                arg.copy_(new)
            graph.replay()
            eager = exact(*args)
            results.append(same(y, eager) and same(eager, exact.per_expert(*args)))
        except Exception as error:  # say so, go on: the other token counts still count
            results = [f"FAILED: {type(error).__name__}: {str(error)[:120]}"]
        failed, row = cells(results)
        bad += failed
        print(f"| {t}, {block} | {row} |")
    exact.block = "exact"
    return bad


def stacked_capture_check(experts: int = 16, tokens=(1, 16)) -> int:
    """The vLLM plugin's op (exactness::stacked_experts) over the experts stacked as vLLM holds
    them, as its apply calls it: captured and replayed, the eager call's bits and the per-expert
    loop's; no read-back in a call. (vLLM itself is not on the GPU machine.) Returns failures."""
    from exactness import stacked

    exact, bad = exact_experts(experts), 0
    tensors = {"w13_packed": torch.stack([torch.cat([e.gate_proj.weight_packed,
                                                     e.up_proj.weight_packed]) for e in exact]),
               "w13_scale": torch.stack([torch.cat([e.gate_proj.weight_scale,
                                                    e.up_proj.weight_scale]) for e in exact]),
               "w2_packed": torch.stack([e.down_proj.weight_packed for e in exact]),
               "w2_scale": torch.stack([e.down_proj.weight_scale for e in exact])}
    print("| stacked_experts (the vLLM plugin's op): T, block | read-backs a call | replay = "
          "eager = per-expert |")
    for t, block in itertools.product(tokens, ("exact", "transformers")):
        exact.block = block
        try:
            x, ids, weights = routed(t, experts, t)

            def call():
                return torch.ops.exactness.stacked_experts(
                    x, ids.int(), weights, *tensors.values(), 16, block, f"gpu-check-{block}")
            call()  # compilation, weight_shape's one read
            with reads_counted() as reads:
                eager = call()
            graph, y = captured(call)
            graph.replay()
            results = [str(len(reads)) if not reads else f"FAILED: {len(reads)}",
                       same(y, eager) and same(eager, exact.per_expert(x, ids, weights))]
        except Exception as error:
            results = [f"FAILED: {type(error).__name__}: {str(error)[:120]}"]
        failed, row = cells(results)
        bad += failed
        print(f"| {t}, {block} | {row} |")
    exact.block = "exact"
    stacked.forget()
    return bad


def host_overhead(k: int = 7168, n: int = 2048) -> int:
    """The host's time a forward beyond its kernels' at M = 1: eager (CUDA events) minus from a
    CUDA graph (target <= 15 us), and that over its kernels' sum (<= 1.1x). Reports only."""
    layer, _ = kimi_on(k, n, "cuda")
    x = torch.randn(1, k, device="cuda").bfloat16()
    eager, graphed_ms = cuda_ms(lambda: layer(x)), graph_ms(lambda: layer(x))
    kernels = kernels_ms(lambda: layer(x))
    print(f"| {k}->{n}, M = 1 | eager ms | graph ms | kernels ms | eager - graph us (target <= "
          f"15) | graph / kernels (target <= 1.1) |\n| host overhead | {eager:.4f} | "
          f"{graphed_ms:.4f} | {kernels:.4f} | {(eager - graphed_ms) * 1e3:.1f} | "
          f"{graphed_ms / kernels:.2f} |")
    return 0


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
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.* as a script too
    sys.exit(main())
