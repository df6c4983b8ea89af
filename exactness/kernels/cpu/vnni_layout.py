"""cpu_vnni.c's layouts, as Python builds and reads them: the weights in blocks of 16 rows
(NativeWeights, derived once; InPlace, the checkpoint's own buffers read in place), the span
kernel's scales (span_scales), the activations' limbs and words (biased_limbs, span_order: the
twins of its quantize_limbs), and the ctypes structs its entry points take. The AMX kernel reads
layers of both kinds too (amx_layout.py).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ... import dataflow
from ...contract import BFLOAT16, GROUP_SIZE
from ...formats import bits_to_tensor, pack_weights
from ..registry import Weights

# lane 2i of a 16-lane block holds weight row i, lane 2i + 1 row 8 + i (cpu_vnni.c's layout)
LANE_ROWS = [row for i in range(8) for row in (i, 8 + i)]


class Layer(ctypes.Structure):
    """cpu_vnni.c's Layer: what exact_grouped reads of a layer that does not change between
    forwards."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("w", "wsum", "c", "f", "rsh", "ends", "unshifted", "emin")] + [
        ("k", ctypes.c_int64), ("np", ctypes.c_int64), ("n", ctypes.c_int64),
        ("nibbles", ctypes.c_int32), ("packed", ctypes.c_void_p), ("scale", ctypes.c_void_p),
        ("flags", ctypes.c_void_p), ("bits", ctypes.c_int32), ("limit", ctypes.c_int32)]


FLAG_SLOW, FLAG_NONFINITE = 1, 2  # cpu_vnni.c's per-row flags of a layer read in place


class InPlace:
    """A layer's live buffers as one forward's grouped call reads them in place (cpu_vnni.c's
    prepare_block): nothing derived ahead, nothing kept. The call writes each row's emin and
    flags (slow, non-finite scale) here; `found()` reads the flags back."""

    def __init__(self, weights: Weights):
        self.packed, self.scale = weights.packed, weights.scale  # the call reads these in place
        self.n, self.k, self.bits = weights.n, weights.k, weights.bits
        self.np = -(-self.n // 16) * 16
        self.emin = torch.zeros(self.np, dtype=torch.int64)
        self.flags = torch.zeros(self.np, dtype=torch.uint8)
        self._layer = Layer(None, None, None, None, None, None, None, self.emin.data_ptr(),
                            self.k, self.np, self.n, 0, self.packed.data_ptr(),
                            self.scale.data_ptr(), self.flags.data_ptr(), weights.bits,
                            dataflow.certified_spread(self.k, weights.bits, weights.act_bits))

    def layer(self, emin: None, spans: bool) -> Layer:
        """exact_grouped's Layer (the emin of a derived layer does not apply; the span kernel
        builds its scales per block, 4-bit words only)."""
        return self._layer

    def found(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slow rows, rows with a non-finite scale) [int64], as the call found them."""
        flags = self.flags[:self.n]
        if not bool(flags.any()):
            none = torch.empty(0, dtype=torch.int64)
            return none, none
        return (torch.nonzero(flags & FLAG_SLOW).flatten(),
                torch.nonzero(flags & FLAG_NONFINITE).flatten())

    def agrees_with(self, cert) -> bool:
        """Whether the emin and flags the call found are the certificate's (the self-checks)."""
        flags = self.flags[:self.n]
        return (torch.equal(self.emin[:self.n], cert.emin)
                and torch.equal((flags & FLAG_SLOW) != 0, ~cert.fast)
                and torch.equal((flags & FLAG_NONFINITE) != 0, cert.nonfinite))

    @property
    def nbytes(self) -> int:
        """What one forward derives and frees: the rows' emin and flags, and each thread's block
        of 16 rows (its words, weight sums, factors, decoded scales and span scales:
        exact_grouped's)."""
        groups = self.k // GROUP_SIZE
        block = -(-(self.k * 16 + 4 * groups * 16 * 4 + groups * 16 * 3 + groups) // 64) * 64
        return self.emin.numel() * 8 + self.flags.numel() + block * torch.get_num_threads()


class Grouped(ctypes.Structure):
    """cpu_vnni.c's Grouped: the experts, their layers and their routed rows of one call."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("layers", "offsets", "source", "spans")] + [
        ("experts", ctypes.c_int64), ("parts", ctypes.c_int64)]


class NativeWeights:
    """Derived at load for cpu_vnni.c: the weights in blocks of 16 rows per vector, as 4-bit pairs
    when every weight fits 4 bits (else a byte each), and per group: the weight sums and the scale
    factors ms << shift (0 on slow rows), int32 each; the span kernel's scales (`spans`) are
    derived from these when it first runs (span_scales: a layer read in place has them built per
    block, in C)."""

    def __init__(self, q: torch.Tensor, factor: torch.Tensor):
        n, k = q.shape
        self.n, self.k = n, k
        self.np = -(-n // 16) * 16
        pad = self.np - n
        q8 = torch.nn.functional.pad(q.to(torch.int8), (0, 0, 0, pad))
        lanes = q8.view(self.np // 16, 16, k)[:, LANE_ROWS]
        w = lanes.view(self.np // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
        self.nibbles = bool(q8.numel() == 0 or (q8.min() >= -8 and q8.max() <= 7))
        if self.nibbles:  # 4-k steps j, j + 1 share a byte: j low, j + 1 high, offset by 8
            pairs = (w.to(torch.int16) + 8).view(self.np // 16, k // 8, 2, 64)
            w = (pairs[:, :, 0] | pairs[:, :, 1] << 4).to(torch.uint8)
        self.w = w.contiguous()
        groups = lanes.reshape(self.np, k // GROUP_SIZE, GROUP_SIZE).sum(-1, dtype=torch.int32)
        self.wsum = groups.t().contiguous()
        self.c = torch.nn.functional.pad(factor.to(torch.int32), (0, 0, 0, pad)).t().contiguous()

    @property
    def nbytes(self) -> int:
        built = (*self.__dict__.get("spans", ()), *self._emin[1:])  # counted once built
        return sum(t.numel() * t.element_size() for t in (self.w, self.wsum, self.c, *built))

    @property
    def bits(self) -> int:
        """The width of the weights as its words hold them: 4 (nibbles) or 8."""
        return 4 if self.nibbles else 8

    _emin: tuple = ()  # (the certificate's emin, padded to np): what self._layer points to
    _layer: Layer | None = None

    def padded(self, emin: torch.Tensor) -> torch.Tensor:
        """A per-row int64 vector (the certificate's emin) padded with zeros to np rows."""
        return torch.nn.functional.pad(emin.to(torch.int64), (0, self.np - self.n)).contiguous()

    def layer(self, emin: torch.Tensor, spans: bool) -> Layer:
        """exact_linear's Layer for the certificate's `emin` (with the span kernel's scales when
        `spans`), built once and kept: it points into tensors this object holds."""
        if self._layer is None or self._emin[0] is not emin:
            self._emin = (emin, self.padded(emin))
            self._layer = Layer(self.w.data_ptr(), self.wsum.data_ptr(), self.c.data_ptr(),
                                None, None, None, None, self._emin[1].data_ptr(), self.k,
                                self.np, self.n, int(self.nibbles))
        if spans and not self._layer.f:
            scales = [t.data_ptr() for t in self.spans]
            self._layer.f, self._layer.rsh, self._layer.ends, self._layer.unshifted = scales
        return self._layer

    @functools.cached_property
    def spans(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """exact_linear_spans' scales (span_scales), built on first use."""
        return span_scales(self.c, self.w, self.k)


def span_scales(c: torch.Tensor, w: torch.Tensor, k: int):
    """The twin of cpu_vnni.c's span_block_scales (the self-check and tests/test_modules.py
    compare them): exact_linear_spans' scales for 4-bit weights (NativeWeights' c and nibbles w,
    K = k): (f [Np/16, G, 16] int16 in lane order, rsh [Np/16, G, 16] int8 in row order, ends
    [Np/16, G] uint8, unshifted [Np/16] uint8). Per block of 16 rows, one of two kinds (whatever
    the activations, every sum below times 32767 is an int32, and |q * f| fits s16: |f| <=
    dataflow.span_fold_limit):
    - unshifted, where it holds: f = c = ms << shift itself, every group its own span, and
      |f| * sum_k |q| <= dataflow.span_size_limit over each of a group's two chains (the k of
      each 4-k step in the pairs (k0, k2) and (k1, k3): vpdpwssd's two sums per row);
    - else spans: with base the span's largest power of two dividing every c (so f = c >> base
      is exact), groups are taken into a span while, for every row, sum_g |f_g| * sum_k |q| <=
      span_size_limit, both chains together. One group always fits (proofs: span-fold,
      span-group)."""
    nb, groups = c.shape[1] // 16, k // GROUP_SIZE
    c = c.t().to(torch.int64).view(nb, 16, groups)  # row order
    pairs = w.view(nb, groups, 4, 16, 4).to(torch.int16)
    q_abs = ((pairs & 15) - 8).abs() + ((pairs >> 4) - 8).abs()  # both nibbles of a byte

    def by_row(lanes):  # [Nb, G, 16 lanes] -> [Nb, 16 rows, G]
        rows = torch.empty_like(lanes.transpose(1, 2))
        rows[:, LANE_ROWS] = lanes.transpose(1, 2)
        return rows

    chains = [by_row(q_abs[..., k0::2].sum((2, 4))) for k0 in (0, 1)]  # (k0, k2), (k1, k3)
    q_sum, chain_sum = chains[0] + chains[1], torch.maximum(*chains)  # sum_k |q| per group
    limit, fold_limit = dataflow.span_size_limit(16), dataflow.span_fold_limit(4)
    unshifted = ((c.abs() <= fold_limit) & (c.abs() * chain_sum <= limit)).flatten(1).all(1)
    never = 1 << 40  # "no nonzero scale yet": divides nothing
    low_bit = torch.where(c != 0, c & -c, never)  # the largest power of two dividing c
    size = c.abs() * q_sum
    ends = torch.zeros(nb, groups, dtype=torch.bool)
    divisor = torch.zeros(nb, 16, groups, dtype=torch.int64)  # 2**base at each span end
    span_div, span_size, span_max = low_bit[..., 0], size[..., 0], c[..., 0].abs()
    for g in range(1, groups):  # greedy: extend the span while every row's bound holds
        div = torch.minimum(span_div, low_bit[..., g])
        tot, top = span_size + size[..., g], torch.maximum(span_max, c[..., g].abs())
        fits = ((tot // div <= limit) & (top // div <= fold_limit)).all(1) & ~unshifted
        ends[~fits, g - 1] = True
        divisor[~fits, :, g - 1] = span_div[~fits]
        keep = fits[:, None]
        span_div = torch.where(keep, div, low_bit[..., g])
        span_size = torch.where(keep, tot, size[..., g])
        span_max = torch.where(keep, top, c[..., g].abs())
    ends[:, -1] = True
    divisor[..., -1] = span_div
    divisor = torch.where((divisor == never) | unshifted[:, None, None], 1, divisor)
    base = at_span_ends(divisor.log2().round().to(torch.int64), ends)  # exact: powers of two
    f = c >> base
    return (f[:, LANE_ROWS].transpose(1, 2).to(torch.int16).contiguous(),
            (32 - base).transpose(1, 2).to(torch.int8).contiguous(),
            ends.to(torch.uint8).contiguous(), unshifted.to(torch.uint8).contiguous())


def at_span_ends(values: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """values [Nb, 16, G] as each group's span holds them at its end: per block, each group's
    span is the first end (ends [Nb, G] true) at or after it. (span_scales',
    amx_layout.amx_spans'.)"""
    nb, rows, groups = values.shape
    last = torch.where(ends, torch.arange(groups), groups)
    end_of = last.flip(1).cummin(1).values.flip(1)
    return torch.gather(values, 2, end_of[:, None, :].expand(nb, rows, groups))


def biased_limbs(qa: torch.Tensor, act_bits: int) -> torch.Tensor:
    """quantize_limbs' twin: qa [M, K] as exact_linear_limbs's limbs [L, M, K] uint8,
    dataflow.activation_limbs plus 128 (the bytes of qa + 2**(8 L - 1), lowest first)."""
    return (dataflow.activation_limbs(qa, act_bits).to(torch.int16) + 128).to(torch.uint8)


def plain_limbs(qa: torch.Tensor, act_bits: int, chunk: int) -> torch.Tensor:
    """kernel_avx2.h's quantize_into, its twin: qa [M, K] as limbs [L, M, ACT_ROW_BYTES(K)] uint8,
    the L bytes of qa in two's complement (no offset), each `chunk` k (64 against 4-bit words
    read in place, else 32) as their even k then their odd k, zeros to K rounded up to 64; then
    in plane 0 each group's S_lo [G8] and S_hi [G8] int32 (L <= 2: S_lo = sum_k qa, S_hi = 0;
    L = 4: sums of qa & 0xFFFF and of qa >> 16), G8 the groups rounded up to 8, zeros past them;
    with chunks of 64, each 8 groups in the order 0, 2, 4, 6, 1, 3, 5, 7 (the 4-bit factors')."""
    m, k = qa.shape
    limbs, padded, groups = dataflow.act_limbs(act_bits), -(-k // 64) * 64, k // GROUP_SIZE
    g8 = -(-groups // 8) * 8
    qa = qa.to(torch.int64)
    order = torch.arange(k).view(-1, chunk // 2, 2).transpose(1, 2).reshape(k)  # evens, odds
    out = torch.zeros((limbs, m, padded + 8 * g8), dtype=torch.uint8)
    for limb in range(limbs):
        out[limb, :, :k] = ((qa[:, order] >> (8 * limb)) & 255).to(torch.uint8)
    groups_of = qa.view(m, groups, GROUP_SIZE)
    sums = torch.zeros((m, 2, g8), dtype=torch.int32)
    if limbs == 4:
        sums[:, 0, :groups] = (groups_of & 0xFFFF).sum(-1).to(torch.int32)
        sums[:, 1, :groups] = (groups_of >> 16).sum(-1).to(torch.int32)
    else:
        sums[:, 0, :groups] = groups_of.sum(-1).to(torch.int32)
    if chunk == 64:
        sums = sums.view(m, 2, g8 // 8, 8)[..., [0, 2, 4, 6, 1, 3, 5, 7]].reshape(m, 2, g8)
    out[0, :, padded:] = sums.reshape(m, -1).contiguous().view(torch.uint8)
    return out


def span_order(qa: torch.Tensor) -> torch.Tensor:
    """qa [M, K] as int16 in exact_linear_spans' order: in each 4 k, 0, 2, 1, 3."""
    m, k = qa.shape
    return qa.view(m, k // 4, 4)[:, :, [0, 2, 1, 3]].reshape(m, k).to(torch.int16).contiguous()


def checkpoint_layer(bits: int, k: int, n: int, g: torch.Generator):
    """(q, weight_packed, weight_scale) of a layer as a checkpoint holds it, for the self-checks
    of the layers read in place: weights at their extremes; scales anywhere in row 0, of spreads
    up to 12 elsewhere (fast rows), a zero row, an infinite, a subnormal row and a NaN in the
    buffer's last element."""
    least = -(1 << (bits - 1))
    q = torch.randint(least, -least, (n, k), generator=g)
    q[0] = least
    scale_bits = torch.randint(0, 1 << 16, (n, k // 32), generator=g)  # row 0: anywhere
    scale_bits[1:] = (scale_bits[1:] & 0x807F) | (torch.randint(
        118, 131, scale_bits[1:].shape, generator=g) << 7)  # spreads up to 12: fast rows
    scale_bits[2] = 0
    scale_bits[3, 0] = 0x7F80  # +inf
    scale_bits[4] &= 0x807F  # subnormal
    scale_bits[n - 1, -1] = 0xFFC1  # a NaN, in the buffer's last element
    packed = torch.from_numpy(pack_weights(q.numpy(), bits))
    return q, packed, bits_to_tensor(scale_bits, BFLOAT16)
