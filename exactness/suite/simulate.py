"""The kernel's dataflow executed step by step in numpy, at the widths `dataflow` describes.

With the real widths it equals the reference bit for bit (the suite checks that); given a narrower
accumulator it wraps exactly where such a kernel would, which is how a refuted proof obligation is
replayed as concrete wrong bits.
"""

from __future__ import annotations

import numpy as np

from .. import dataflow
from ..contract import GROUP_SIZE
from ..formats import round_scaled_array
from ..kernels.registry import int8_limbs_hold
from .cases import LinearCase
from .reference import quantize_activations, split_scales


def wrap(v, bits: int):
    """Two's-complement wrap of Python ints / object arrays to `bits` (what a register holds)."""
    half = 1 << (bits - 1)
    return ((v + half) % (1 << bits)) - half


def simulate(case: LinearCase, dot_bits: int | None = None,
             combine_bits: int | None = None) -> np.ndarray:
    """Output bits of `case` through limbs -> group dots -> combine -> one rounding, wrapping at
    `dot_bits` / `combine_bits` (default: dataflow's). Exact Python integers in between. It is
    the int8 kernels' dataflow at one or two limbs: 32-bit activations raise ValueError."""
    held = int8_limbs_hold(case.act_bits, dataflow.GEMM_ACT_LIMBS)
    if not held:
        raise ValueError(f"no int8 kernel's dataflow to simulate: {held.why}")
    dot_bits = dot_bits or dataflow.DOT_ACC_BITS
    combine_bits = combine_bits or dataflow.COMBINE_ACC_BITS
    qa, e_r = quantize_activations(case.x_bits, case.x_format, case.act_bits)
    q = case.q.astype(object)
    m, k = qa.shape
    groups = k // GROUP_SIZE
    ms, shift, emin, _ = split_scales(case.scale_bits)
    two = dataflow.act_limbs(case.act_bits) == 2
    v = qa.astype(object) - (dataflow.LIMB_OFFSET if two else 0)
    lo = (v + 128) % 256 - 128
    hi = (v - lo) // 256
    factor = wrap(ms.astype(object) << shift.astype(object), dataflow.FACTOR_BITS)
    out = np.zeros((m, q.shape[0]), dtype=np.int64)
    for n in range(q.shape[0]):
        row_sum = 0  # R[n] = sum_k q * f, the limb offset's part (derived once per weights)
        for g in range(groups):
            ks = slice(GROUP_SIZE * g, GROUP_SIZE * (g + 1))
            row_sum = wrap(row_sum + int(q[n, ks].sum()) * factor[n, g], combine_bits)
        for r in range(m):
            acc = 0
            for g in range(groups):
                ks = slice(GROUP_SIZE * g, GROUP_SIZE * (g + 1))
                p = 0
                for a, w in zip(lo[r, ks], q[n, ks], strict=True):
                    p = wrap(p + a * w, dot_bits)
                if two:  # P' = 256 * D_hi + D_lo
                    d_hi = 0
                    for a, w in zip(hi[r, ks], q[n, ks], strict=True):
                        d_hi = wrap(d_hi + a * w, dot_bits)
                    p = wrap(wrap(d_hi * 256, dot_bits) + p, dot_bits)
                acc = wrap(acc + wrap(p * factor[n, g], combine_bits), combine_bits)
            if two:
                acc = wrap(acc + wrap(dataflow.LIMB_OFFSET * row_sum, combine_bits),
                           combine_bits)
            out[r, n] = round_scaled_array(np.array([acc], np.int64), int(e_r[r] + emin[n]),
                                           case.out_format)[0]
    return out
