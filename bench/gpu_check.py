"""GPU check, in one run: bit-exactness of the Triton kernel on CUDA against the reference, then
kernel vs torch bf16 matmul timings (CUDA events, median), as ratios. Prints a table; exit 1 on
any differing bit."""

from __future__ import annotations

import sys

import numpy as np
import torch

from exactness.cases import LinearCase, load_vectors
from exactness.contract import BFLOAT16
from exactness.formats import pack_weights
from exactness.paths import run


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


def main() -> int:
    assert torch.cuda.is_available(), "no CUDA device"
    bad = 0
    for case in load_vectors():
        bad += int(not (run(case, "triton") == case.expected).all())
    rng = np.random.default_rng(0)
    for (k, n), m, act_bits in [((7168, 2048), 1, 16), ((2048, 7168), 16, 16),
                                ((7168, 2048), 300, 8), ((2048, 7168), 33, 4)]:
        q = rng.integers(-8, 8, (n, k))
        case = LinearCase(rng.integers(0, 0x7F00, (m, k)), BFLOAT16, q, pack_weights(q, 4),
                          0x3C00 + rng.integers(0, 256, (n, k // 32)), act_bits, BFLOAT16)
        bad += int(not (run(case, "triton") == run(case, "reference")).all())
    print(f"bit-exactness: {'OK' if bad == 0 else f'{bad} cases differ'}")
    from bench.bench_forward import dequantized_bf16, kimi_layer

    print("| shape | M | exact ms | bf16 ms | ratio bf16/exact (speed-up) |")
    for k, n in ((7168, 2048), (2048, 7168)):
        layer = kimi_layer(k, n, 16)
        w = dequantized_bf16(layer).cuda()
        layer = layer.cuda()
        layer.backend = "auto"
        for m in (1, 16, 128, 4096):
            x = torch.randn(m, k, device="cuda").bfloat16()
            exact, bf16 = cuda_ms(lambda: layer(x)), cuda_ms(lambda: x @ w.t())
            print(f"| {k}->{n} | {m} | {exact:.3f} | {bf16:.3f} | {bf16 / exact:.2f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
