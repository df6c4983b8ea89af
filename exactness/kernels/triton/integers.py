"""The integer helpers every Triton kernel calls, in registers: bit lengths, round-to-nearest-even
shifts, the one rounding to a float's bit pattern, unpacking weight fields and decoding floats.
Each is the twin of a formats.py function, named in its docstring; the suite checks the kernels
that call them bit for bit against the reference.
"""

from __future__ import annotations

from .launch import tl, triton

if triton is not None:

    @triton.jit
    def narrow(x, length, S: tl.constexpr):
        """One step of the binary search: drop S bits from x where it has more than S."""
        big = (x >> S) != 0
        return tl.where(big, x >> S, x), length + tl.where(big, S, 0)

    @triton.jit
    def bit_length(x):
        """formats.bit_length_array: bit length of int64 x >= 0, by binary search on shifts."""
        x, length = narrow(x, x * 0, 32)
        x, length = narrow(x, length, 16)
        x, length = narrow(x, length, 8)
        x, length = narrow(x, length, 4)
        x, length = narrow(x, length, 2)
        x, length = narrow(x, length, 1)
        return length + (x != 0).to(tl.int64)

    @triton.jit
    def rne_shift_right(a, s):
        """formats.rne_shift_right: RNE(a / 2**s) for int64 a >= 0 and 0 <= s <= 63."""
        one = a * 0 + 1
        n = a >> s
        rem = a & ((one << s) - 1)
        half = tl.where(s > 0, one << tl.maximum(s - 1, 0), 0)
        up = (s > 0) & ((rem > half) | ((rem == half) & ((n & 1) == 1)))
        return n + up.to(tl.int64)

    @triton.jit
    def round_scaled(m, e, MANT: tl.constexpr, EXP: tl.constexpr):
        """formats.round_scaled_array: bit patterns (int64) of RNE(m * 2**e), |m| < 2**63."""
        bias: tl.constexpr = (1 << (EXP - 1)) - 1
        a = tl.abs(m)
        length = bit_length(a)
        q = tl.maximum(e + length - (MANT + 1), 1 - bias - MANT)
        s = q - e
        # s > length: under half an ulp, rounds to zero; otherwise s <= 63
        n = tl.where(s <= 0, a << tl.minimum(tl.maximum(-s, 0), 63),
                     rne_shift_right(a, tl.minimum(tl.maximum(s, 0), 63)))
        n = tl.where(s > length, 0, n)
        carry = n == (1 << (MANT + 1))
        n = tl.where(carry, n >> 1, n)
        q += carry.to(tl.int64)
        field = q + MANT + bias
        normal = tl.where(field >= (1 << EXP) - 1, ((1 << EXP) - 1) << MANT,
                          (field << MANT) | (n & ((1 << MANT) - 1)))
        bits = tl.where(n >= (1 << MANT), normal, n)
        bits = bits | tl.where(m < 0, (a * 0 + 1) << (MANT + EXP), 0)  # int64: fp32's is 2**31
        return tl.where(m == 0, 0, bits)

    @triton.jit
    def store_exact(t, e, y_ptrs, mask, OUT_MANT: tl.constexpr, OUT_EXP: tl.constexpr):
        """The one rounding, from the exact int64 T: y = RNE(T * 2**e), stored at y_ptrs as the
        output's bit patterns."""
        bits = round_scaled(t, e, OUT_MANT, OUT_EXP)
        width: tl.constexpr = OUT_MANT + OUT_EXP + 1
        sign = (bits * 0 + 1) << (width - 1)
        signed = tl.where(bits >= sign, bits - 2 * sign, bits)  # the bits as the int view
        tl.store(y_ptrs, signed.to(y_ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def store_rounded(t, e_ptr, emin_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym,
                      OUT_MANT: tl.constexpr, OUT_EXP: tl.constexpr):
        """store_exact of the tile [offs_m, offs_n]: y = RNE(T * 2**(e_r + emin))."""
        e_r = tl.load(e_ptr + offs_m, mask=mask_m, other=0)
        emin = tl.load(emin_ptr + offs_n, mask=mask_n, other=0)
        store_exact(t, e_r[:, None] + emin[None, :],
                    y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                    mask_m[:, None] & mask_n[None, :], OUT_MANT, OUT_EXP)

    @triton.jit
    def unpack_fields(words, shifts, W_BITS: tl.constexpr):
        """formats.unpack_weights in registers: int32 words [R, C] -> their signed W_BITS fields
        [R, C, fields] (`shifts`: each field's bit offset). The stored field is q + 2**(bits-1);
        the mask drops the sign-extended high bits."""
        return ((words[:, :, None] >> shifts[None, None, :]) & ((1 << W_BITS) - 1)) - (
            1 << (W_BITS - 1))

    @triton.jit
    def decode(b, MANT: tl.constexpr, EXP: tl.constexpr):
        """formats.decode_array of unsigned finite patterns: (m, e), x = m * 2**e."""
        field = (b >> MANT) & ((1 << EXP) - 1)
        frac = b & ((1 << MANT) - 1)
        m = tl.where(field == 0, frac, frac | (1 << MANT))
        e = (2 - (1 << (EXP - 1)) - MANT) + tl.maximum(field - 1, 0)
        return tl.where((b >> (MANT + EXP)) != 0, -m, m), e
