"""What one slow weight row costs (a row whose scales spread wider than any fast kernel holds):
the layer with one such row against the same layer without it, side by side, at a big batch.

    .venv/bin/python bench/bench_slow_rows.py [--m 20000]

Peak memory is the process's; the wide kernel works in blocks of rows (kernels/wide.py), so the
slow row adds no memory that grows with the batch.
"""

from __future__ import annotations

import argparse
import resource

import torch

from bench.bench_forward import kimi_layer, side_by_side


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--m", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    k, n = 7168, 2048
    fast, slow = kimi_layer(k, n, 16), kimi_layer(k, n, 16)
    slow.weight_scale.data[5, :2] = torch.tensor([2.0**100, 2.0**-100])  # spread 200
    assert slow.certificate.slow_rows.tolist() == [5]
    x = torch.randn(args.m, k).bfloat16()
    t_fast, t_slow = side_by_side([lambda: fast(x), lambda: slow(x)], args.repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"M = {args.m}, K = {k}, N = {n}, {torch.get_num_threads()} threads: "
          f"no slow row {t_fast:.2f} s, one slow row {t_slow:.2f} s "
          f"(ratio {t_slow / t_fast:.2f}); peak RSS {peak:.2f} GiB (x is "
          f"{x.numel() * 2 / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
