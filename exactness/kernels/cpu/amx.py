"""The AMX kernel, as the registry sees it: an exact int8 GEMM on AMX tiles, for the Intel
Xeons with AMX-INT8 (Sapphire Rapids on), where torch's bf16 matmul runs on tiles too.

It reads the checkpoint's buffers in place, as the limb kernel does (cpu_vnni.c's prepare_block,
a block of 16 weight rows at a time). Per block, in C, the scales are folded into the weights over
spans of groups: f = c >> base, |q * f| an s16 split into a u8 and an s8 digit. The tiles sum each
span's dots of the activations' biased u8 limbs (cpu_vnni.c's quantization) by those digits in
int32, and the int64 combine runs once a span, not once a group. It shares cpu_vnni.c's
quantization, block layout and one rounding. 16-bit activations at most (two limbs); 32 bits take
`vnni-limbs`. Emulated tiles are never picked unasked: kernel="amx" or EXACTNESS_KERNEL=amx runs
them."""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import FloatFormat
from ..registry import Fit, Weights, int8_limbs_hold, no, warn_fallback, yes
from . import amx_library, vnni_library
from .amx_calls import linear
from .amx_layout import AmxInPlace

# the plan prefers the real tiles from this many rows on; None: never, where no table measured on
# AMX shows them faster than the VNNI kernels (docs/PERFORMANCE.md)
MIN_ROWS: int | None = None


class _AmxKernel:
    """cpu_amx.c for one layer, in one C call (exact_linear_amx): quantized by cpu_vnni.c's
    passes, the tiles, the rounding fused."""

    name, family, layout, grouped = "amx", "cpu", "vnni", False
    act_limbs = dataflow.AMX_ACT_LIMBS

    @property
    def auto(self) -> bool:
        """The plan picks the real tiles unasked where MIN_ROWS says at what size; emulated ones
        only when asked for."""
        return amx_library.mode() == "1" and MIN_ROWS is not None

    @property
    def min_rows(self) -> int:
        return MIN_ROWS or 0

    def available(self, device: torch.device) -> Fit:
        if device.type != "cpu":
            return no(f"it runs on the CPU, x is on {device}")
        lib, why = amx_library.status()
        on_amx = not amx_library.missing_features()
        if lib is None and amx_library.mode() == "1" and vnni_library.mode() != "0" and on_amx:
            warn_fallback("the AMX kernel", why.why)  # an AMX machine that does not run it
        return why

    def eligible(self, rows: int, weights: Weights) -> Fit:
        held = int8_limbs_hold(weights.act_bits, self.act_limbs)
        if not held:
            return held
        # at the certified spread, the most a fast row has (the plan reads no scales)
        spread = dataflow.certified_spread(weights.k, weights.bits, weights.act_bits)
        if not dataflow.amx_holds(weights.k, weights.bits, weights.act_bits, spread):
            return no(f"K = {weights.k} by factors of spread {spread} could pass int64 in its "
                      f"combine")
        return yes(f"act_bits {weights.act_bits} in {dataflow.act_limbs(weights.act_bits)} "
                   f"u8 limb(s), scales folded into two digits")

    def prepare(self, weights: Weights) -> AmxInPlace:
        """The live buffers, read in place: each block, its spans and digit planes built in C."""
        return AmxInPlace(weights)

    def run(self, x, weights: Weights, prepared: AmxInPlace,
            out_format: FloatFormat) -> torch.Tensor:
        y = linear(x, weights.act_bits, prepared, None, out_format)
        weights.found = prepared.found()  # its slow and NaN rows, as the blocks found them
        return y


AMX = _AmxKernel()
