"""`make bench`: the exact layer against the bf16 matmul a user would otherwise run, side by side.

For each Kimi shape and batch M, both are timed in the same process, alternating call by call,
median of repeats; the table reports the ratio exact / bf16 (<= 1.0: the exact path is no slower).
The baseline is torch's bf16 matmul on a weight dequantized once, ahead of time, to bf16.
The checks column is the part of each forward that checks the buffers a kernel can read
(`layer.weights()`: types, shapes, weight_shape's values), timed alone.
Memory, for every CPU kernel that runs here: what the layer holds besides its buffers (nothing:
the kernels read the buffers in place), the layer against the checkpoint's bytes, and what one
forward derives and frees (the C kernel's per-row outputs and each thread's block of rows; the
slower paths' layouts).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from exactness import PackedInt4Linear
from exactness.formats import bits_to_tensor, pack_weights
from exactness.suite.precision import dequantized

SHAPES = {"gate/up 7168->2048": (7168, 2048), "down 2048->7168": (2048, 7168)}


def kimi_layer(k: int, n: int, act_bits: int, seed: int = 0, binades: int = 2,
               kernel: str | None = None) -> PackedInt4Linear:
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, (n, k))
    # QAT-like: 2**-7 .. 2**-5 for the default two binades (each binade is 128 bf16 patterns)
    scales = 0x3C00 + rng.integers(0, 128 * binades, (n, k // 32))
    layer = PackedInt4Linear(k, n, act_bits, backend="cpu", kernel=kernel)
    layer.load_state_dict({"weight_packed": torch.from_numpy(pack_weights(q, 4)),
                           "weight_scale": bits_to_tensor(scales, "bfloat16"),
                           "weight_shape": torch.tensor([n, k])})
    return layer


def random_layer(layer, generator: torch.Generator) -> None:
    """Uniform nibbles and bf16 scales over two binades (2**-7 .. 2**-5), as bench_forward's."""
    n, k = layer.out_features, layer.in_features
    layer.load_state_dict({
        "weight_packed": torch.randint(-2**31, 2**31, (n, k // 8), dtype=torch.int32,
                                       generator=generator),
        "weight_scale": (0x3C00 + torch.randint(0, 256, (n, k // 32), generator=generator)).to(
            torch.int16).view(torch.bfloat16),
        "weight_shape": torch.tensor([n, k])})


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def dequantized_bf16(layer: PackedInt4Linear) -> torch.Tensor:
    return dequantized(layer, torch.bfloat16)


def side_by_side(fns, repeats: int) -> list[float]:
    """The median time of each of `fns`, called in turn `repeats` times (after one warm-up
    call each): alternating call by call, both see the same machine, drift and noise included."""
    samples = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, times in zip(fns, samples, strict=True):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in samples]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--act-bits", type=int, nargs="+", default=[16, 8, 32])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--binades", type=int, default=2,
                        help="the spread of each weight row's scales (2: every block unshifted)")
    parser.add_argument("--out", default="reports/bench.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = [f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"median of {args.repeats}, scales over {args.binades} binades per row", "",
             "| shape | act_bits | M | kernel | exact ms | bf16 ms | ratio exact/bf16 | "
             "checks ms | checks/exact |", "|" + " --- |" * 9]
    print("\n".join(lines), flush=True)
    for name, (k, n) in SHAPES.items():
        for act_bits in args.act_bits:
            layer = kimi_layer(k, n, act_bits, binades=args.binades)
            w = dequantized_bf16(layer)
            for m in args.m:
                x = torch.randn(m, k).bfloat16()
                exact, bf16, check = side_by_side(
                    [lambda: layer(x), lambda: x @ w.t(), layer.weights], args.repeats)
                line = (f"| {name} | {act_bits} | {m} | {layer.plan(x).kernel.name} | "
                        f"{exact * 1e3:.2f} | {bf16 * 1e3:.2f} | "
                        f"{exact / bf16:.2f} | {check * 1e3:.2f} | {check / exact:.2f} |")
                lines.append(line)
                print(line, flush=True)
    memory = memory_table()
    lines += ["", *memory]
    print("\n".join(memory), flush=True)
    amx_lines = amx_table(args)
    lines += ["", *amx_lines]
    print("\n".join(amx_lines), flush=True)
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


def memory_table(act_bits: int = 16) -> list[str]:
    """Each CPU kernel that runs here, at both Kimi shapes: the layer's bytes (buffers and all it
    holds) against the checkpoint's three tensors, and the bytes one forward derives and frees."""
    from exactness.kernels import REGISTRY
    from exactness.suite.paths import unavailable

    lines = [f"Memory, act_bits {act_bits}: the layer / the checkpoint's bytes, for every CPU "
             f"kernel that runs here", "",
             "| shape | kernel | checkpoint MiB | held besides the buffers MiB | layer / "
             "checkpoint | one forward derives MiB (freed) | bf16 weight MiB |",
             "|" + " --- |" * 7]
    for name, (k, n) in SHAPES.items():
        for kernel in REGISTRY:
            if kernel.family != "cpu" or kernel.grouped or unavailable(kernel.name):
                continue
            layer = kimi_layer(k, n, act_bits, kernel=kernel.name)
            layer(torch.randn(1, k).bfloat16())
            buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
            held = buffers + layer.derived_nbytes() + sum(
                v.numel() * v.element_size() for v in vars(layer).values()
                if isinstance(v, torch.Tensor))
            per_forward = getattr(layer.prepared(kernel), "nbytes", 0)
            lines.append(f"| {name} | {kernel.name} | {buffers / 2**20:.2f} | "
                         f"{(held - buffers) / 2**20:.2f} | {held / buffers:.2f} | "
                         f"{per_forward / 2**20:.2f} | {n * k * 2 / 2**20:.2f} |")
    return lines


def amx_table(args) -> list[str]:
    """The AMX kernel beside both VNNI kernels (the span kernel at 16-bit activations) and bf16,
    on a machine with AMX (the plan's choice between them: amx.MIN_ROWS); elsewhere one line
    saying why there are no rows."""
    from exactness.kernels.cpu import amx_library

    lib, why = amx_library.status()
    if lib is None or amx_library.mode() != "1":
        return [f"AMX: no rows here ({why.why}). make verify checks the emulated kernel's bits."]
    lines = [f"AMX: {torch.get_num_threads()} threads, median of {args.repeats}, scales over "
             f"{args.binades} binades per row", "",
             "| shape | act_bits | M | amx ms | vnni-limbs ms | vnni-spans ms | bf16 ms | "
             "amx/bf16 | best vnni/bf16 |", "|" + " --- |" * 9]
    print("\n".join(lines), flush=True)
    for name, (k, n) in SHAPES.items():
        for act_bits in args.act_bits:
            if act_bits > 16:
                continue  # amx takes two limbs at most
            kernels = ("amx", "vnni-limbs", "vnni-spans") if act_bits == 16 else (
                "amx", "vnni-limbs")
            layers = [kimi_layer(k, n, act_bits, binades=args.binades, kernel=kernel)
                      for kernel in kernels]
            w = dequantized_bf16(layers[0])
            for m in args.m:
                x = torch.randn(m, k).bfloat16()
                times = side_by_side([*(lambda layer=layer: layer(x) for layer in layers),
                                      lambda: x @ w.t()], args.repeats)
                ms = [f"{t * 1e3:.2f}" for t in times[:-1]] + (["-"] if len(kernels) == 2 else [])
                lines.append(f"| {name} | {act_bits} | {m} | {' | '.join(ms)} | "
                             f"{times[-1] * 1e3:.2f} | {times[0] / times[-1]:.2f} | "
                             f"{min(times[1:-1]) / times[-1]:.2f} |")
                print(lines[-1], flush=True)
    return lines


def amx_only() -> int:
    """--amx: the AMX table alone (bench/amx_check.sh runs it on a Xeon with AMX)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--amx", action="store_true")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256])
    parser.add_argument("--act-bits", type=int, nargs="+", default=[16, 8])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--binades", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = amx_table(args)
    if len(lines) == 1:
        print(lines[0])
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(amx_only() if "--amx" in sys.argv else main())
