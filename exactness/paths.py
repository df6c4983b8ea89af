"""Every way the project computes the contract, behind one call: `run(case, path)` -> bit patterns.

Paths: "oracle" (Python integers), "reference" (numpy int64), "cpu" (the layer's CPU path),
"triton" (the layer's Triton kernel: on a GPU, or on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .cases import LinearCase
from .contract import BFLOAT16
from .formats import bits_to_tensor, tensor_to_bits, torch_dtype
from .kernels import triton_exact
from .reference import oracle_linear, reference_linear

PATHS = ("oracle", "reference", "cpu", "triton")


def triton_device() -> str | None:
    """Where the Triton kernel can run here: 'cuda', 'cpu' (interpreter), or None."""
    if not triton_exact.available():
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


def available_paths() -> list[str]:
    return [p for p in PATHS if p != "triton" or triton_device() is not None]


def layer_for(case: LinearCase, backend: str, device: str = "cpu"):
    from .modules import ExactLinear

    m, k, n = case.shape
    layer = ExactLinear(k, n, case.act_bits, bits=case.w_bits,
                        out_dtype=torch_dtype(case.out_format), backend=backend, device=device)
    layer.load_state_dict({
        "weight_packed": torch.from_numpy(np.ascontiguousarray(case.weight_packed)),
        "weight_scale": bits_to_tensor(case.scale_bits, BFLOAT16),
        "weight_shape": torch.tensor([n, k], dtype=torch.int32)})
    return layer


def run(case: LinearCase, path: str) -> np.ndarray:
    """The output bit patterns [M, N] of `case` computed by `path`."""
    args = (case.x_bits, case.x_format, case.weight_packed, case.scale_bits)
    if path == "oracle":
        return np.array(oracle_linear(*args, **case.kwargs()), dtype=np.int64)
    if path == "reference":
        return reference_linear(*args, **case.kwargs())
    if path.startswith("simulated"):  # "simulated-dot32-acc64": the dataflow at those widths
        from .simulate import simulate

        widths = {part.rstrip("0123456789"): int(part[len(part.rstrip("0123456789")):])
                  for part in path.split("-")[1:]}
        return simulate(case, widths.get("dot"), widths.get("acc"))
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    device = triton_device() if path == "triton" else "cpu"
    if device is None:
        raise RuntimeError("the Triton path needs a GPU or TRITON_INTERPRET=1")
    layer = layer_for(case, path, device)
    x = bits_to_tensor(case.x_bits, case.x_format).to(device)
    return tensor_to_bits(layer(x))
