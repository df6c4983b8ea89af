"""Kernels this project did not write, as `python -m exactness check` factories, and `make peers`.

Each factory takes the checkpoint's three tensors and returns x -> y, as check.py asks:
- `compressed_tensors_bf16`: compressed-tensors' own decompression (PackedQuantizationCompressor)
  to bf16 weights, then torch's bf16 matmul: what transformers runs for a pack-quantized model;
- `torch_int4_cpu`: torch's int4 CPU kernel, `aten._weight_int4pack_mm_for_cpu`, which torchao's
  int4 CPU path calls, through its own packing (`_convert_weight_to_int4pack_for_cpu`: unsigned
  nibbles with zero point 8) and its scales-and-zeros tensor [K / 32, N, 2] (zero 0: the
  dequantized weight is (nibble - 8) * scale = q * scale). It takes N a multiple of 16 only;
- this project's layers: `exact16` and `exact32` (ExactLinear at 16 and 32 activation bits).

`python -m exactness.suite.peers.kernels` checks each under both claims and times it against bf16 at
Kimi's shapes: the table of docs/PEERS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ...contract import GROUP_SIZE

TORCH_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"


def compressed_tensors_bf16(weight_packed, weight_scale, weight_shape):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP_SIZE))
    weight = PackedQuantizationCompressor.decompress(
        {"weight_packed": weight_packed, "weight_scale": weight_scale,
         "weight_shape": weight_shape}, scheme)["weight"].to(torch.bfloat16)
    return lambda x: x.to(torch.bfloat16) @ weight.t()


def torch_int4_cpu(weight_packed, weight_scale, weight_shape):
    from ...formats import unpack_weights

    n, k = (int(v) for v in weight_shape)
    q = torch.from_numpy(unpack_weights(weight_packed.numpy(), 4, k))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q + 8).to(torch.int32), 1)
    scale = weight_scale.to(torch.bfloat16).t()
    scales_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), packed, GROUP_SIZE, scales_and_zeros)


def _exact(default_act_bits: int):
    def factory(weight_packed, weight_scale, weight_shape, act_bits: int = default_act_bits):
        from .properties import exact_layer

        return exact_layer(weight_packed, weight_scale, weight_shape, act_bits)

    return factory


exact16, exact32 = _exact(16), _exact(32)

PEERS = {  # name -> (KERNEL, its tile's N multiple, what it states it does with inf and NaN)
    "compressed-tensors + bf16 matmul": ("exactness.suite.peers.kernels:compressed_tensors_bf16", 1,
                                         "propagate"),
    "torch int4 CPU kernel": ("exactness.suite.peers.kernels:torch_int4_cpu", TORCH_INT4_N_MULTIPLE,
                              "propagate"),
    "exactness, 16-bit activations": ("exactness.suite.peers.kernels:exact16", 1, "nan"),
    "exactness, 32-bit activations": ("exactness.suite.peers.kernels:exact32", 1, "nan"),
}


def timing(kernel: str, ms=(1, 16, 128), shapes=((7168, 2048), (2048, 7168)), repeats: int = 5
           ) -> dict[int, float]:
    """The kernel's time over bf16's (dequantized weights, torch's bf16 matmul) at Kimi's shapes:
    per M, the median over shapes and interleaved repeats of the per-call ratio."""
    from ...formats import pack_weights
    from ..precision import dequantize
    from .properties import load_kernel

    factory = load_kernel(kernel)
    g = torch.Generator().manual_seed(0)
    out = {}
    for m in ms:
        ratios = []
        for k, n in shapes:
            q = torch.randint(-8, 8, (n, k), generator=g)
            scale = (torch.rand(n, k // GROUP_SIZE, generator=g) * 0.01 + 1e-3).bfloat16()
            packed = torch.from_numpy(pack_weights(q.numpy(), 4))
            fn = factory(packed, scale, torch.tensor([n, k]))
            w = dequantize(packed, scale, torch.bfloat16)
            x = torch.randn(m, k, generator=g).bfloat16()
            fn(x), x @ w.t()  # warm
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(x)
                t1 = time.perf_counter()
                x @ w.t()
                t2 = time.perf_counter()
                ratios.append((t1 - t0) / (t2 - t1))
        out[m] = statistics.median(ratios)
    return out


def main(argv: list[str] | None = None) -> int:
    from .properties import Claim, check

    parser = argparse.ArgumentParser(prog="python -m exactness.suite.peers.kernels")
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for name, (kernel, multiple, non_finite) in PEERS.items():
        act_bits = 32 if kernel.endswith("exact32") else 16
        verdicts = {}
        for claim in (Claim("exact", act_bits, non_finite=non_finite),
                      Claim("w4a16", non_finite=non_finite)):
            report = check(kernel, claim, examples=args.examples, n_multiple=multiple,
                           scales="qat")
            verdicts[claim.name] = report
        w4 = verdicts["w4a16"]
        by = {v.prop: v.verdict for v in w4.verdicts}
        times = {} if args.no_timing else timing(kernel)
        rounded = w4.within[0.5] / w4.outputs
        rows.append((name, verdicts["exact"].verdicts[0].verdict, w4.worst_ulp, rounded,
                     by["batch-invariant"], by["deterministic"],
                     f"{non_finite}d: {by['non-finite']}", by["tails"], times))
        print(f"{name}: done", flush=True)
    print("| kernel | exact claim | worst ulp found | correctly rounded | batch-invariant | "
          "deterministic | inf and NaN, as stated | tails | time / bf16, M = 1, 16, 128 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, exact, worst, rounded, batch, det, nonfinite, tails, times in rows:
        t = ", ".join(f"{times[m]:.2f}" for m in sorted(times)) or "-"
        print(f"| {name} | {exact} | {worst:.3g} | {rounded:.1%} | {batch} | {det} | "
              f"{nonfinite} | {tails} | {t} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
