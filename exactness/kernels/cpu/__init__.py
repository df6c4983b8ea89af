"""The CPU wing: C kernels built on first use, and torch GEMMs where those do not run.

- `vnni*.py`: cpu_vnni.c, AVX-512 VNNI. `vnni_library` builds, judges and loads it;
  `vnni_layout` holds the weights and activations as it reads them; `vnni_calls` calls its
  entry points with tensors; `vnni_check` is its self-check; `vnni` holds its kernels.
- `amx*.py`: cpu_amx.c on AMX-INT8 tiles, in the same five roles. It shares cpu_vnni.c's
  quantization, weight blocks and rounding.
- `gemm.py`: exact torch GEMMs of integers (int8, float64, int64), on any CPU.
- `activations.py`: the contract's activation quantization in float64, for the GEMMs.

The C sources are in `kernels/csrc/`; the compiler, its cache and the child-process first run
are `kernels/toolchain.py` and `kernels/first_run.py`.
"""

from pathlib import Path

CSRC = Path(__file__).parent.parent / "csrc"  # the C sources and headers of the CPU kernels
