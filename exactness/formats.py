"""Storage formats, in integer arithmetic only.

- pack / unpack of 4- and 8-bit weights in compressed-tensors' "pack-quantized" layout;
- float bit patterns (bf16, fp16, fp32) <-> exact integer mantissa and exponent;
- exact round-to-nearest-even of `m * 2**e` to a float bit pattern, with gradual underflow and
  overflow to inf.

Each float routine comes twice: a scalar one in Python integers (the specification, read line by
line) and a vectorized numpy int64 one (checked against the scalar one by the suite). No float
arithmetic anywhere: floats are only ever looked at as bit patterns.
"""

from __future__ import annotations

import numpy as np
import torch

from .contract import (
    BFLOAT16,
    ContractTypeError,
    ContractValueError,
    FloatFormat,
    NonFiniteError,
    ShapeError,
    check_weight_bits,
    float_format,
    weight_range,
)

# --------------------------------------------------------------------------- packing


def pack_weights(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack integers `q[n, k]` into int32 words `[N, K*bits/32]`, element k at bit bits*(k % per).

    Stored unsigned as `q + 2**(bits-1)`, lowest element in the lowest bits (compressed-tensors).
    """
    check_weight_bits(bits)
    q = np.asarray(q)
    if q.ndim != 2:
        raise ShapeError(f"weights to pack must be 2-D [N, K], got shape {q.shape}")
    per = 32 // bits
    if q.shape[1] % per:
        raise ShapeError(f"K={q.shape[1]} is not a multiple of {per} ({bits}-bit packing)")
    lo, hi = weight_range(bits)
    bad = np.argwhere((q < lo) | (q > hi))
    if len(bad):
        n, k = bad[0]
        raise ContractValueError(
            f"weight q[{n}, {k}] = {int(q[n, k])} is outside [{lo}, {hi}] for {bits}-bit packing "
            f"({len(bad)} values out of range)")
    fields = (q.astype(np.int64) + 2 ** (bits - 1)).reshape(q.shape[0], -1, per)
    shifts = np.arange(per, dtype=np.int64) * bits
    words = (fields << shifts).sum(axis=-1)  # < 2**32: fields do not overlap
    return words.astype(np.uint32).view(np.int32)


def zero_word(bits: int) -> int:
    """The int32 word that packs 32 / bits zero weights (pack_weights of zeros), signed."""
    check_weight_bits(bits)
    word = sum(2 ** (bits - 1) << (bits * i) for i in range(32 // bits))
    return word - 2**32 if word >= 2**31 else word


def unpack_weights(packed: np.ndarray, bits: int, k: int | None = None) -> np.ndarray:
    """Inverse of `pack_weights`: int32 words `[N, W]` -> int8 `[N, k]` (k defaults to W*per)."""
    check_weight_bits(bits)
    packed = np.asarray(packed)
    if packed.dtype != np.int32:
        raise ContractTypeError(f"packed weights must be int32, got {packed.dtype}")
    if packed.ndim != 2:
        raise ShapeError(f"packed weights must be 2-D [N, K/{32 // bits}], got {packed.shape}")
    per = 32 // bits
    k = packed.shape[1] * per if k is None else k
    if k != packed.shape[1] * per:
        raise ShapeError(
            f"packed weights of shape {packed.shape} hold K={packed.shape[1] * per}, not {k}")
    words = packed.view(np.uint32).astype(np.int64)[:, :, None]
    shifts = np.arange(per, dtype=np.int64) * bits
    fields = (words >> shifts) & (2**bits - 1)
    return (fields - 2 ** (bits - 1)).reshape(packed.shape[0], k).astype(np.int8)


# --------------------------------------------------------------------------- scalar floats


def is_finite(bits: int, fmt: FloatFormat) -> bool:
    return (bits >> fmt.mant_bits) & fmt.exp_max_field != fmt.exp_max_field


def decode(bits: int, fmt: FloatFormat) -> tuple[int, int]:
    """The finite float with pattern `bits` as (m, e), value m * 2**e exactly, m signed."""
    if not is_finite(bits, fmt):
        raise NonFiniteError(f"{fmt.name} pattern {bits:#x} is not finite")
    field = (bits >> fmt.mant_bits) & fmt.exp_max_field
    frac = bits & ((1 << fmt.mant_bits) - 1)
    m = frac if field == 0 else frac | (1 << fmt.mant_bits)
    e = fmt.quantum_min + max(field - 1, 0)
    return (-m if bits & fmt.sign_bit else m), e


def round_scaled(m: int, e: int, fmt: FloatFormat) -> int:
    """The bit pattern of RNE(m * 2**e) in `fmt`; an exact zero is +0.0, overflow is +-inf."""
    if m == 0:
        return 0
    sign = fmt.sign_bit if m < 0 else 0
    a = abs(m)
    p = fmt.precision
    top = e + a.bit_length() - 1  # a * 2**e lies in [2**top, 2**(top+1))
    q = max(top - (p - 1), fmt.quantum_min)  # exponent of the result's last place
    if q <= e:
        n = a << (e - q)
    else:
        s = q - e
        n, rem, half = a >> s, a & ((1 << s) - 1), 1 << (s - 1)
        if rem > half or (rem == half and n & 1):
            n += 1
    if n == 1 << p:  # rounding carried into a new binade
        n, q = n >> 1, q + 1
    if n < 1 << (p - 1):  # subnormal (or zero after underflow): exponent field 0
        return sign | n
    field = q + fmt.mant_bits + fmt.bias
    if field >= fmt.exp_max_field:
        return sign | fmt.inf_bits
    return sign | (field << fmt.mant_bits) | (n & ((1 << fmt.mant_bits) - 1))


# --------------------------------------------------------------------------- vectorized floats
# The same code runs on numpy arrays (the reference) and torch tensors (the layers, on any device).


def array_module(a):
    """numpy or torch, whichever holds `a` (or a symbolic module: proofs/symbolic.py)."""
    if isinstance(a, torch.Tensor):
        return torch
    return getattr(type(a), "array_module", np)


def as_int64(a):
    if isinstance(a, torch.Tensor):
        return a.to(torch.int64)
    return a if hasattr(type(a), "array_module") else np.asarray(a).astype(np.int64)


def finite_mask(bits, fmt: FloatFormat):
    b = as_int64(bits) & ((1 << fmt.width) - 1)
    return ((b >> fmt.mant_bits) & fmt.exp_max_field) != fmt.exp_max_field


def check_finite(bits, fmt: FloatFormat, name: str) -> None:
    """Raise NonFiniteError naming `name`, the count and the first bad index."""
    bad = ~finite_mask(bits, fmt)
    if bad.any():
        first = tuple(int(i) for i in array_module(bad).argwhere(bad)[0])
        raise NonFiniteError(
            f"{name} has {int(bad.sum())} non-finite value(s); the first at index {first}")


CHECK_STEP = 2**16  # a CPU check's elements a step (below)


def check_finite_tensor(t: torch.Tensor, name: str) -> None:
    """check_finite of a float tensor's values: torch.isfinite (6x the bit-pattern check's
    speed on bf16 scales), the bit patterns only to name the first bad index. On the CPU in
    steps of CHECK_STEP elements: a larger temporary passes glibc's 128 KiB mmap threshold,
    which then rises, and a loader's thousands of checks left up to 240 MiB of heap behind
    (bench/bench_load.py); on a GPU in one step, one read of the device."""
    flat = t.reshape(-1)
    steps = flat.split(CHECK_STEP) if t.device.type == "cpu" else (flat,)
    if not all(bool(torch.isfinite(step).all()) for step in steps):
        check_finite(float_bits(t), float_format(t.dtype), name)


def decode_array(bits, fmt: FloatFormat):
    """Vectorized `decode` of finite patterns: int64 (m, e) arrays."""
    xp = array_module(bits)
    b = as_int64(bits) & ((1 << fmt.width) - 1)
    field = (b >> fmt.mant_bits) & fmt.exp_max_field
    frac = b & ((1 << fmt.mant_bits) - 1)
    m = xp.where(field == 0, frac, frac | (1 << fmt.mant_bits))
    e = fmt.quantum_min + (field - 1).clip(min=0)
    return xp.where((b & fmt.sign_bit) != 0, -m, m), e


def bit_length_array(a):
    """Bit length of non-negative int64 values, by binary search on shifts."""
    xp = array_module(a)
    x = as_int64(a)
    length = x * 0
    for s in (32, 16, 8, 4, 2, 1):
        big = (x >> s) != 0
        x = xp.where(big, x >> s, x)
        length = length + xp.where(big, s, 0)
    return length + (x != 0)


def rne_shift_right(a, s):
    """RNE(a / 2**s) elementwise, for int64 a >= 0 and shifts 0 <= s <= 63."""
    xp = array_module(a)
    one = s * 0 + 1
    n = a >> s
    rem = a & ((one << s) - 1)
    half = xp.where(s > 0, one << (s - 1).clip(min=0), 0)
    return n + ((s > 0) & ((rem > half) | ((rem == half) & ((n & 1) == 1))))


def round_scaled_array(m, e, fmt: FloatFormat):
    """Vectorized `round_scaled` for |m| < 2**63: int64 array of bit patterns."""
    xp = array_module(m)
    m = as_int64(m)
    e = as_int64(e) + m * 0  # broadcast to m's shape
    p = fmt.precision
    a = xp.abs(m)  # |m| < 2**63 by the caller's bound, so this does not wrap
    length = bit_length_array(a)
    q = (e + length - 1 - (p - 1)).clip(min=fmt.quantum_min)
    s = q - e
    # s > length: a < 2**(s-1), under half an ulp, rounds to zero; otherwise s <= 63.
    n = xp.where(s <= 0, a << (-s).clip(0, 63), rne_shift_right(a, s.clip(0, 63)))
    n = xp.where(s > length, 0, n)
    carry = n == (1 << p)
    n = xp.where(carry, n >> 1, n)
    q = q + carry
    field = q + fmt.mant_bits + fmt.bias
    normal = n >= (1 << (p - 1))
    bits = xp.where(
        normal,
        xp.where(field >= fmt.exp_max_field, fmt.inf_bits,
                 (field << fmt.mant_bits) | (n & ((1 << fmt.mant_bits) - 1))),
        n)
    bits = bits | xp.where(m < 0, fmt.sign_bit, 0)
    return xp.where(m == 0, 0, bits)


# --------------------------------------------------------------------------- torch bit views

_TORCH = {"bfloat16": (torch.bfloat16, torch.int16), "float16": (torch.float16, torch.int16),
          "float32": (torch.float32, torch.int32)}


def torch_dtype(fmt: FloatFormat | str) -> torch.dtype:
    return _TORCH[float_format(fmt).name][0]


def float_bits(t: torch.Tensor) -> torch.Tensor:
    """The unsigned bit patterns of a bf16 / fp16 / fp32 tensor, as int64 on its device."""
    fmt = float_format(t.dtype)
    return t.contiguous().view(_TORCH[fmt.name][1]).to(torch.int64) & ((1 << fmt.width) - 1)


def tensor_to_bits(t: torch.Tensor) -> np.ndarray:
    """`float_bits` as a numpy array."""
    return float_bits(t.detach().cpu()).numpy()


def bits_to_tensor(bits, fmt: FloatFormat | str) -> torch.Tensor:
    """A tensor of format `fmt` whose elements have the given bit patterns (numpy or torch)."""
    fmt = float_format(fmt)
    b = bits if isinstance(bits, torch.Tensor) else torch.from_numpy(np.asarray(bits, np.int64))
    b = b.to(torch.int64)
    signed = torch.where(b >= fmt.sign_bit, b - (1 << fmt.width), b)
    return signed.to(_TORCH[fmt.name][1]).view(_TORCH[fmt.name][0])


def split_scales(scale_bits):
    """bf16 scales [N, G] (numpy or torch) as (ms, shift, emin, spread):
    s = ms * 2**(emin + shift), emin[n] the least exponent of row n's nonzero scales (0 if none),
    shift 0 for zero scales, spread[n] the row's largest shift."""
    xp = array_module(scale_bits)
    ms, es = decode_array(scale_bits, BFLOAT16)
    big = 2**62
    emin = xp.amin(xp.where(ms != 0, es, big), axis=1)
    emin = xp.where(emin == big, 0, emin)
    shift = xp.where(ms != 0, es - emin[:, None], 0)
    return ms, shift, emin, xp.amax(shift, axis=1)
