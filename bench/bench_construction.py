"""Building Kimi K2's whole routed-expert tree on the meta device: 61 layers x 384 experts x 3
projections (gate and up 7168 -> 2048, down 2048 -> 7168), each a PackedInt4Linear inside an
ExactExperts, as exactness.hf.from_pretrained builds it before the weights load.

    .venv/bin/python -m bench.bench_construction [--layers 61]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from exactness.kimi import ExactExperts

LAYERS, EXPERTS, HIDDEN, INTER = 61, 384, 7168, 2048


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()
    start = time.perf_counter()
    tree = nn.ModuleList(ExactExperts(EXPERTS, HIDDEN, INTER, nn.SiLU(), device="meta")
                         for _ in range(args.layers))
    seconds = time.perf_counter() - start
    layers = sum(1 for m in tree.modules() if hasattr(m, "weight_packed"))
    packed = sum(b.numel() * b.element_size() for b in tree.buffers())
    print(f"{layers} PackedInt4Linear on meta in {seconds:.2f} s ({seconds / layers * 1e6:.0f} us "
          f"each); their buffers once loaded: {packed / 2**30:.1f} GiB "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
