"""`python -m exactness kimi DIR`: a Kimi checkpoint on disk checked without a model (every
routed-expert tensor loaded through PackedInt4Linear, certified, and compared bit for bit with the
reference on sampled tokens)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ...contract import ExactnessError
from ...formats import float_bits, tensor_to_bits
from ...kimi import KimiCheckpoint, KimiCheckpointError
from ...modules import PackedInt4Linear
from ..reference import reference_linear


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactness kimi")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("--layers", type=int, nargs="+")
    parser.add_argument("--experts", type=int, nargs="+")
    parser.add_argument("--tokens", type=positive_int, default=4,
                        help="sampled tokens per projection")
    args = parser.parse_args(argv)
    try:
        return check_checkpoint(args.checkpoint_dir, args.layers, args.experts, args.tokens)
    except KimiCheckpointError as e:  # one line, no traceback: the message names file and key
        print(f"FAILED: {e}")
        return 1


def check_checkpoint(directory: str | Path, layers: list[int] | None = None,
                     experts: list[int] | None = None, tokens: int = 4, seed: int = 0) -> int:
    """`python -m exactness kimi DIR`: every routed-expert tensor's dtype and shape, loaded
    through PackedInt4Linear, certified, and compared bit for bit with the reference on sampled
    tokens. Prints progress and a summary; returns the exit code. A checkpoint it cannot open
    raises KimiCheckpointError."""
    import resource
    import sys
    import time

    start = time.perf_counter()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ckpt = KimiCheckpoint(directory)
    cfg = ckpt.config
    shapes = {"gate": (cfg.moe_intermediate_size, cfg.hidden_size),
              "up": (cfg.moe_intermediate_size, cfg.hidden_size),
              "down": (cfg.hidden_size, cfg.moe_intermediate_size)}
    chosen = {key: names for key, names in sorted(ckpt.routed_experts().items())
              if (layers is None or key[0] in layers) and (experts is None or key[1] in experts)}
    if not chosen:
        print(f"FAILED: no routed experts match in {directory}")
        return 1
    generator = torch.Generator().manual_seed(seed)
    failures, projections, slow_rows, max_spread, compared = [], 0, 0, 0, 0
    for i, ((layer, expert), names) in enumerate(chosen.items(), 1):
        for name in sorted(names):
            kind = name.rsplit(".", 1)[1].removesuffix("_proj")
            n, k = shapes[kind]
            layer_module = PackedInt4Linear(k, n, act_bits=cfg.exact_act_bits)
            try:
                ckpt.load_packed(layer_module, name)
                cert = layer_module.certificate.summary()
            except ExactnessError as e:
                failures.append(str(e))
                continue
            projections += 1
            slow_rows += cert["slow_rows"]
            max_spread = max(max_spread, cert["max_spread"])
            x = torch.randn(tokens, k, generator=generator).bfloat16()
            got = tensor_to_bits(layer_module(x))
            want = reference_linear(tensor_to_bits(x), "bfloat16",
                                    layer_module.weight_packed.numpy(),
                                    float_bits(layer_module.weight_scale).numpy(),
                                    act_bits=cfg.exact_act_bits)
            compared += want.size
            if (got != want).any():
                failures.append(f"{name}: {(got != want).sum()} outputs differ from the reference")
        sys.stdout.write(f"\r  [{i}/{len(chosen)}] layer {layer} expert {expert}   ")
        sys.stdout.flush()
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    print()
    rows = [("layers", len({key[0] for key in chosen})), ("experts", len(chosen)),
            ("projections loaded and certified", projections),
            ("rows on the slow exact path", slow_rows), ("largest scale-exponent spread",
                                                          max_spread),
            ("outputs compared bit for bit", compared), ("bytes read", ckpt.bytes_read),
            ("peak RSS growth (bytes)", rss), ("seconds", round(time.perf_counter() - start, 2)),
            ("failures", len(failures))]
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")
    for f in failures[:20]:
        print(f"  x {f}")
    print("PASSED" if not failures else "FAILED")
    return 1 if failures else 0
