"""Every way the project computes the contract, behind one call: `run(case, path)` -> bit patterns.

Paths: "oracle" (Python integers), "reference" (numpy int64), "cpu" and "triton" (the layer on
that backend, as its plan picks), and every registered kernel by name (the layer with that
kernel forced: exactness.kernels.REGISTRY). "triton" runs on a GPU, or on CPU under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..contract import BFLOAT16
from ..formats import bits_to_tensor, tensor_to_bits, torch_dtype
from ..kernels import REGISTRY, triton_exact
from ..kernels.registry import by_name
from .cases import LinearCase
from .reference import oracle_linear, reference_linear

BACKENDS = ("cpu", "triton")
PATHS = ("oracle", "reference", *BACKENDS, *(kernel.name for kernel in REGISTRY))


def triton_device() -> str | None:
    """Where the Triton kernels can run here: 'cuda', 'cpu' (interpreter), or None."""
    if not triton_exact.available():
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


def device_of(path: str) -> str | None:
    """The device a layer path runs on here (None: it cannot run here)."""
    family = path if path in BACKENDS else by_name(REGISTRY, path).family
    return triton_device() if family == "triton" else "cpu"


def available_paths(case: LinearCase | None = None) -> list[str]:
    """The paths that run here; with `case`, only the kernels that hold its inputs."""
    paths = ["oracle", "reference", *(b for b in BACKENDS if device_of(b) is not None)]
    weights = None if case is None else layer_for(case, "cpu").weights()
    for kernel in REGISTRY:
        device = device_of(kernel.name)
        if device is None or not kernel.available(torch.device(device)):
            continue
        if weights is not None and not kernel.eligible(case.shape[0], weights):
            continue
        paths.append(kernel.name)
    return paths


def layer_for(case: LinearCase, path: str, device: str = "cpu"):
    """The layer of `case`'s weights on `path`: a backend ("cpu", "triton") or a kernel name."""
    from ..modules import ExactLinear

    m, k, n = case.shape
    kernel = None if path in BACKENDS else path
    backend = path if path in BACKENDS else "auto"
    if kernel is not None and by_name(REGISTRY, kernel).family == "triton":
        backend = "triton"
    layer = ExactLinear(k, n, case.act_bits, bits=case.w_bits, backend=backend, kernel=kernel,
                        out_dtype=torch_dtype(case.out_format), device=device)
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
    device = device_of(path)
    if device is None:
        raise RuntimeError(f"the {path} path needs a GPU or TRITON_INTERPRET=1")
    layer = layer_for(case, path, device)
    x = bits_to_tensor(case.x_bits, case.x_format).to(device)
    return tensor_to_bits(layer(x))
