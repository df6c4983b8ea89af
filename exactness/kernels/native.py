"""The CPU path's fast kernel (cpu_vnni.c): compiled on first use with the system C compiler,
cached by source hash, loaded with ctypes, and used only where the CPU has AVX-512 VNNI and the
compiled kernel passes its exactness self-check; otherwise the int8-GEMM path runs instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
from pathlib import Path

import torch

from .. import dataflow
from ..contract import GROUP_SIZE

SOURCE = Path(__file__).with_name("cpu_vnni.c")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512dq",
         "-mavx512vl", "-mavx512vnni"]
NEEDS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")


def _cpu_has_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(f in flags for f in NEEDS)


@functools.cache
def library():
    """The loaded kernel, or None (no VNNI, no compiler, or a failed self-check)."""
    if os.environ.get("EXACTNESS_NATIVE", "1") == "0" or not _cpu_has_vnni():
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "exactness"
    so = cache / f"cpu_vnni-{key}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        cc = os.environ.get("CC", "cc")
        try:
            subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], check=True,
                           capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.exact_linear_vnni.restype = None
    lib.exact_linear_vnni.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.split_limbs.restype = lib.round_rows.restype = None
    lib.split_limbs.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
    lib.round_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                               ctypes.c_void_p]
    return lib if _self_check(lib) else None


class NativeWeights:
    """Derived at load for cpu_vnni.c: int8 weights interleaved for 16 rows per vector (one byte
    per weight), and per group: the weight sums, scale mantissas and shifts (0 on slow rows)."""

    def __init__(self, q: torch.Tensor, mantissa: torch.Tensor, shift: torch.Tensor):
        n, k = q.shape
        self.n, self.k = n, k
        self.np = -(-n // 16) * 16
        pad = self.np - n
        q8 = torch.nn.functional.pad(q.to(torch.int8), (0, 0, 0, pad))
        self.w = q8.view(self.np // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
        groups = q8.view(self.np, k // GROUP_SIZE, GROUP_SIZE).sum(-1, dtype=torch.int32)
        self.wsum = groups.t().contiguous()
        scale = mantissa.to(torch.int64) << shift.to(torch.int64)  # |.| < 2**31: proofs/
        self.c = torch.nn.functional.pad(scale, (0, 0, 0, pad)).t().contiguous()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.wsum, self.c))


def accumulate(qa: torch.Tensor, act_bits: int, weights: NativeWeights, lib=None) -> torch.Tensor:
    """T [M, Np] int64 (padded columns are 0) from activations qa [M, K] int32."""
    lib = lib or library()
    qa = qa.to(torch.int32).contiguous()
    m = qa.shape[0]
    two = dataflow.act_limbs(act_bits) == 2
    lo = torch.empty(qa.shape, dtype=torch.uint8)
    hi = torch.empty(qa.shape, dtype=torch.uint8) if two else lo
    lib.split_limbs(qa.data_ptr(), lo.data_ptr(), hi.data_ptr(), qa.numel(), int(two))
    t = torch.empty((m, weights.np), dtype=torch.int64)
    lib.exact_linear_vnni(lo.data_ptr(), hi.data_ptr(), weights.w.data_ptr(),
                          weights.wsum.data_ptr(), weights.c.data_ptr(), t.data_ptr(), m,
                          weights.k, weights.np, int(two))
    return t


def round_rows(t: torch.Tensor, n: int, e_r: torch.Tensor, emin: torch.Tensor, fmt,
               lib=None) -> torch.Tensor:
    """formats.round_scaled of t[:, :n] * 2**(e_r[r] + emin[n]), in C: bit patterns int64."""
    lib = lib or library()
    e_r, emin = e_r.to(torch.int64).contiguous(), emin.to(torch.int64).contiguous()
    out = torch.empty((t.shape[0], n), dtype=torch.int32)
    lib.round_rows(t.data_ptr(), t.shape[1], e_r.data_ptr(), emin.data_ptr(), t.shape[0], n,
                   fmt.mant_bits, fmt.exp_bits, out.data_ptr())
    return out.to(torch.int64) & 0xFFFFFFFF


def _self_check(lib) -> bool:
    """The compiled kernel against int64 arithmetic and formats.round_scaled_array: the worst
    case, random limbs, and rounding at ties, subnormals and overflow."""
    from ..contract import FORMATS
    from ..formats import round_scaled_array

    g = torch.Generator().manual_seed(0)
    for act_bits in (8, 16):
        qmax = 2 ** (act_bits - 1) - 1
        q = torch.randint(-8, 8, (37, 256), generator=g)
        q[0] = -8
        qa = torch.randint(-qmax, qmax + 1, (6, 256), generator=g)
        qa[0] = -qmax
        ms = torch.randint(-255, 256, (37, 8), generator=g, dtype=torch.int32)
        sh = torch.randint(0, 13, (37, 8), generator=g, dtype=torch.int32)
        got = accumulate(qa, act_bits, NativeWeights(q, ms, sh), lib)[:, :37]
        p = (qa.view(6, 1, 8, 32) * q.view(1, 37, 8, 32)).sum(-1)
        if not torch.equal(got, ((p * ms.long()) << sh.long()).sum(-1)):
            return False
    t = torch.randint(-(2**62), 2**62, (4, 64), generator=g) >> torch.randint(0, 62, (4, 64),
                                                                            generator=g)
    e_r, emin = torch.randint(-300, 200, (4,), generator=g), torch.randint(-40, 40, (64,),
                                                                            generator=g)
    for fmt in FORMATS.values():
        want = round_scaled_array(t, e_r[:, None] + emin[None, :], fmt)
        if not torch.equal(round_rows(t, 64, e_r, emin, fmt, lib), want):
            return False
    return True
