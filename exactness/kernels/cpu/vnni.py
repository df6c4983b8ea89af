"""The C kernel's kernels (csrc/cpu_kernel.c), as the registry sees them, for each build: the
limb kernel (any widths, the layer's buffers read in place), the span kernel (16-bit activations
as int16 words, 4-bit weights; the AVX-512 build only) and the grouped call (an MoE layer's
routed experts in one call). Each is one call of exact_grouped (vnni_calls.py); the builds are
loaded and judged by vnni_library.py.

- AVX-512 VNNI: `vnni-limbs`, `vnni-spans`, `vnni-grouped`. Emulated (EXACTNESS_NATIVE=emulate),
  they run only when asked for by name.
- AVX2: `avx2-limbs`, `avx2-grouped`, for every x86-64 CPU without AVX-512 VNNI. The registry
  lists them after the VNNI ones, so the plan takes them where those do not run.
"""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import FloatFormat
from ...formats import torch_dtype
from ..registry import Fit, Weights, int8_limbs_hold, no, refuse_unheld, warn_fallback, yes
from . import vnni_library
from .vnni_calls import grouped, linear, scratch_bytes
from .vnni_layout import InPlace

SPAN_MIN_ROWS = 24  # from here on the span kernel is faster (measured: docs/PERFORMANCE.md)


class _VnniKernel:
    """The C kernel's one-call path (exact_grouped, one expert) in one build, through the limb or
    the span kernel."""

    family, layout, grouped = "cpu", "vnni", False
    act_limbs = dataflow.GROUP_ACT_LIMBS

    def __init__(self, name: str, build: vnni_library.Build, spans: bool, min_rows: int,
                 auto: bool = True):
        self.name, self.build, self.spans, self.min_rows = name, build, spans, min_rows
        self._auto = auto

    @property
    def auto(self) -> bool:
        """Whether the plan may pick it unasked: an emulated build only when asked for."""
        return self._auto and not self.build.emulated()

    def available(self, device: torch.device) -> Fit:
        if device.type != "cpu":
            return no(f"it runs on the CPU, x is on {device}")
        lib, why = self.build.status()
        if lib is None:
            instead = vnni_library.instead_of(self.build)
            # a CPU without the ISA, whose best build runs: the right kernel, nothing to warn
            # of (plan(x) still says why); a refused build, or none running, is a fallback
            if not (instead and self.build.missing_features()):
                warn_fallback(f"the C kernel ({self.build.what})", why.why,
                              *([f"its {instead.what} build runs instead"] if instead else []))
        return why

    def eligible(self, rows: int, weights: Weights) -> Fit:
        held = int8_limbs_hold(weights.act_bits, self.act_limbs)
        if not held:
            return held
        if self.spans and not (weights.act_bits == 16 and weights.bits == 4):
            return no(f"it takes 16-bit activations and 4-bit weights, not act_bits "
                      f"{weights.act_bits} and {weights.bits}-bit weights")
        return yes("16-bit activations as int16 words" if self.spans else "any widths")

    def prepare(self, weights: Weights) -> InPlace:
        """The live buffers, read in place: each block (and the span kernel's scales) built in C
        as its thread reaches it."""
        return InPlace(weights)

    def run(self, x, weights: Weights, prepared: InPlace, out_format: FloatFormat):
        y = linear(x, weights.act_bits, prepared, None, out_format, self.build.library(),
                   spans=self.spans)
        weights.found = prepared.found()  # its slow and NaN rows, as the blocks found them
        return y


class _VnniGroupedKernel(_VnniKernel):
    """The C kernel's grouped call (exact_grouped) in one build: every routed expert's rows in
    one call, each layer read in place by the limb kernel. As a layer's kernel
    (kernel="vnni-grouped"): one expert, every row routed to it (the limb kernel's prepare and
    run)."""

    grouped, reads = True, "layers"

    def __init__(self, name: str, build: vnni_library.Build):
        super().__init__(name, build, spans=False, min_rows=0, auto=False)

    @property
    def auto_grouped(self) -> bool:
        """Whether plan_grouped may pick it unasked: an emulated build only when asked for."""
        return not self.build.emulated()

    def run_grouped(self, x, routing, experts, bits: int, act_bits: int, out_format: FloatFormat,
                    gather: bool, workspace=None):
        """(y [routed rows, parts * N], None): `experts` [E] holds, for each expert with routed
        rows, its parts' (Weights, InPlace) of these widths, None for the others; routed row r
        reads row routing.token[r] of x where `gather`, else row r (x then in routing order
        already). Each part's InPlace then holds the rows the call found slow or NaN (found()).
        With a `workspace` (moe.Workspace), y and the quantized x are its buffers, which its
        next use overwrites. Raises NonFiniteError for a non-finite x, and
        KernelUnavailableError for activations wider than its limbs."""
        refuse_unheld(self.name, act_bits, self.act_limbs)
        offsets = routing.offsets.tolist()
        active = [e for e, parts in enumerate(experts) if parts is not None]
        ends = [0, *(offsets[e + 1] - offsets[e] for e in active)]
        routed = offsets[routing.experts]
        source = routing.token[:routed] if gather else None
        lists = [[(prepared, None) for _, prepared in experts[e]] for e in active]
        offsets = torch.tensor(ends).cumsum(0).tolist()
        out = scratch = None
        if workspace is not None:
            n = len(lists[0]) * lists[0][0][0].n
            out = workspace.get("y", (offsets[-1], n), torch_dtype(out_format), x.device)
            scratch = workspace.get("x", (scratch_bytes(*x.shape, self.build.library()),),
                                    torch.uint8, x.device)
        return grouped(x, act_bits, lists, [False] * len(active), offsets, source, out_format,
                       self.build.library(), out=out, scratch=scratch), None


# the span kernel: not the plan's own pick until a measurement of it read in place (issue 52)
# shows it faster than the limb kernel; min_rows is where it was, with its layout derived ahead
SPANS = _VnniKernel("vnni-spans", vnni_library.AVX512, spans=True, min_rows=SPAN_MIN_ROWS,
                    auto=False)
LIMBS = _VnniKernel("vnni-limbs", vnni_library.AVX512, spans=False, min_rows=0)
GROUPED = _VnniGroupedKernel("vnni-grouped", vnni_library.AVX512)
AVX2_LIMBS = _VnniKernel("avx2-limbs", vnni_library.AVX2, spans=False, min_rows=0)
AVX2_GROUPED = _VnniGroupedKernel("avx2-grouped", vnni_library.AVX2)
