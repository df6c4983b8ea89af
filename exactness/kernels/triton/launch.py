"""What every Triton launch shares: whether Triton is here and interpreted, the tile's rows, the
integer widths and bit views the kernels take, and how many programs fill the GPU.
"""

from __future__ import annotations

import functools
import os

import torch

from ...contract import ExactnessError


class DeviceError(ExactnessError, ValueError):
    """EXACTNESS_DEVICE names no device, or one this machine does not have."""


# EXACTNESS_DEVICE (interpret | cuda), where set, decides for the whole process whether the
# kernels are interpreted: applied here, before triton is imported (triton reads
# TRITON_INTERPRET when a kernel is defined). exactness.suite.device is the suite's side.
DEVICES = ("interpret", "cuda")
ASKED = os.environ.get("EXACTNESS_DEVICE", "").strip() or None
if ASKED is not None and ASKED not in DEVICES:
    raise DeviceError(f"EXACTNESS_DEVICE must be one of {', '.join(DEVICES)}, got {ASKED!r}")
if ASKED is not None:
    os.environ["TRITON_INTERPRET"] = "1" if ASKED == "interpret" else "0"

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = tl = None

# Under the interpreter every program and loop step costs Python time: wide tiles, few programs.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # activation rows of a tile (the quantization's most, the group kernel's default)
# programs to aim at under the interpreter (on a GPU: the SMs, times a launch's per_sm)
INTERPRETED_PROGRAMS = 4
TRITON_INT = {32: tl.int32, 64: tl.int64} if triton is not None else {}  # widths of dataflow
BIT_VIEW = {16: torch.int16, 32: torch.int32}  # a float tensor's bit view, by width


def available() -> bool:
    return triton is not None


def fill_slices(blocks: int, most: int, device: torch.device, per_sm: int = 1) -> int:
    """Slices of K (1 to `most`) for a launch of `blocks` blocks to have per_sm programs for
    each of the GPU's SMs; under the interpreter INTERPRETED_PROGRAMS in all."""
    target = (per_sm * _multiprocessors(device.index) if device.type == "cuda"
              else INTERPRETED_PROGRAMS)
    return max(1, min(most, triton.cdiv(target, blocks)))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index or 0).multi_processor_count
