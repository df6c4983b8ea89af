"""The GPU wing, in Triton; on CPU its kernels run under the interpreter (TRITON_INTERPRET=1).

One forward, below layer.FOLDED_MIN_ROWS activation rows, is two launches:
- `quantize.quantize_kernel`, up to BLOCK_M activation rows and a slice of K per program: the
  row exponent e_r by the contract's integer rule (section 3) on the row maximum's bit pattern
  (which also flags a row holding inf or NaN), then qa = RNE(x * 2**-e_r) by integer shifts of
  each value's significand, written as dataflow's int8 limbs;
- `group.exact_group_kernel`, per output tile and per group of 32: the packed words unpacked to
  int8 in registers, one int8 x int8 -> int32 dot per activation limb gives the group's exact
  P' = 256 * D_1 + D_0, and P' * f (f = ms << shift, int32 x int32) is added into an int64
  accumulator, the limb offset's sum once at the end (widths: exactness/dataflow.py); with four
  limbs (32-bit activations) P' stays in two int32 halves, P'_hi = 256 * D_3 + D_2 and
  P'_lo = 256 * D_1 + D_0, and the term is (P'_hi * f << 16) + P'_lo * f in int64; the tile's
  exact T is rounded once (`integers.round_scaled`, the twin of formats.round_scaled_array) and
  stored as the output's bit patterns.
From FOLDED_MIN_ROWS rows on, `folded.linear_folded` runs kernels/cpu/gemm.py's dataflow
instead, which leaves the GEMM no per-group work: `fold_kernel` (the scales folded into the
weights' int8 digits), one integer GEMM (torch._int_mm) and `combine_kernel` (int64
combination, the rounding). `grouped.py` runs an MoE layer's routed experts in one launch.

Files: launch.py (what every launch shares), integers.py (the integer helpers, twins of
formats.py's), quantize.py, group.py, folded.py, grouped.py, and layer.py (the kernels as the
registry sees them). The suite checks every kernel bit for bit against the reference.
"""
