"""Two kernels the interpreter runs but a GPU build must refuse (tests/test_triton_compile.py):
an int8 dot with K = 16 (the compiler needs K >= 32 for int8 MMA) and int8 operands multiplied
as fp16 (a float MMA: not the exact integer dot). Run as a script, it prints triton_aot's verdicts
for both as JSON."""

import json
import sys
from dataclasses import asdict

import triton
import triton.language as tl


@triton.jit
def short_int8_dot(a_ptr, b_ptr, c_ptr):
    i = tl.arange(0, 16)
    a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
    b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
    tl.store(c_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b, out_dtype=tl.int32))


@triton.jit
def float_dot(a_ptr, b_ptr, c_ptr):
    i = tl.arange(0, 16)
    k = tl.arange(0, 32)
    a = tl.load(a_ptr + i[:, None] * 32 + k[None, :]).to(tl.float16)
    b = tl.load(b_ptr + k[:, None] * 16 + i[None, :]).to(tl.float16)
    tl.store(c_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b).to(tl.int32))


TYPES = {"a_ptr": "*i8", "b_ptr": "*i8", "c_ptr": "*i32"}

if __name__ == "__main__":
    from exactness.suite.triton_aot import compile_kernel

    print(json.dumps([asdict(compile_kernel(fn, TYPES, {}, int(sys.argv[1]), needs_int_mma=True))
                      for fn in (short_int8_dot, float_dot)]))
