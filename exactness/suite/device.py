"""The one device every check runs the Triton kernels on: EXACTNESS_DEVICE.

- "interpret": under TRITON_INTERPRET=1, on CPU tensors (make's default, and pytest's without a
  GPU);
- "cuda": compiled, on CUDA tensors (make verify DEVICE=cuda).

The choice is fixed when triton is first imported (exactness.kernels.triton.launch applies
EXACTNESS_DEVICE then), so a command asked for another device than its process has starts
itself again (`restart_on`). Tests take the Triton kernels' torch device from
paths.device_of (triton_torch_device behind it); the C kernels always run on the CPU. A
counterexample file records `describe()`, and replays on the device asked for.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

import torch

from ..kernels.triton import launch
from ..kernels.triton.launch import DEVICES, DeviceError
from . import interpreter

__all__ = ["DEVICES", "DeviceError", "chosen", "describe", "require", "restart_on",
           "triton_torch_device"]

if launch.INTERPRETED:
    interpreter.install()  # the suite's interpreted launches, 2.5-4x faster


def chosen() -> str | None:
    """Where this process runs the Triton kernels: "interpret", "cuda", or None (neither: no
    Triton, or no GPU and no interpreter)."""
    if not launch.available():
        return None
    if launch.INTERPRETED:
        return "interpret"
    return "cuda" if torch.cuda.is_available() else None


def require() -> str | None:
    """chosen(), after refusing a device asked for (EXACTNESS_DEVICE) that this machine lacks:
    never a quiet fall back to the interpreter, or to no Triton at all."""
    if launch.ASKED == "cuda" and chosen() != "cuda":
        why = ("Triton is not installed" if not launch.available() else
               f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is "
               f"False)")
        raise DeviceError(f"EXACTNESS_DEVICE=cuda, but {why}")
    return chosen()


def triton_torch_device() -> str | None:
    """The torch device of the Triton kernels' tensors: "cuda", "cpu" when interpreted, None
    where they do not run."""
    return {"cuda": "cuda", "interpret": "cpu"}.get(chosen())


def describe() -> dict:
    """Where the checks ran, for a counterexample file and a report's first lines: the device,
    the GPU's name and the Triton version (None where absent)."""
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    gpu = torch.cuda.get_device_name() if chosen() == "cuda" else None
    return {"device": chosen(), "gpu": gpu, "triton": triton}


def restart_on(device: str | None, argv: list[str]) -> None:
    """Start `python -m exactness *argv` again with EXACTNESS_DEVICE=device where this process
    runs the kernels elsewhere (the interpreter is fixed at import); else return."""
    if device is None or device == chosen():
        return
    if device not in DEVICES:
        raise DeviceError(f"the device must be one of {', '.join(DEVICES)}, got {device!r}")
    if launch.ASKED == device:  # asked already, and still elsewhere: say why, never loop
        require()
        raise DeviceError(f"EXACTNESS_DEVICE={device}, but Triton is not installed")
    env = dict(os.environ, EXACTNESS_DEVICE=device)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "exactness", *argv], env)
