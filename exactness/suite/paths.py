"""Every way the project computes the contract, behind one call: `run(case, path)` -> bit patterns.

Paths: "oracle" (Python integers), "reference" (numpy int64), "cpu" and "triton" (the layer on
that backend, as its plan picks), and every registered kernel by name (the layer with that
kernel forced: exactness.kernels.REGISTRY). "triton" runs on a GPU, or on CPU under
TRITON_INTERPRET=1.

A case with routing (a grouped projection's) runs on a grouped kernel as an MoE layer runs it
(exactness.moe.projection: one expert's layer per expert, the rows routed to them), and on
every other path as one layer of all the experts' weights, each row's routed outputs kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from ..contract import BFLOAT16, GROUP_SIZE
from ..formats import bits_to_tensor, tensor_to_bits, torch_dtype
from ..kernels import REGISTRY
from ..kernels.registry import by_name
from ..kernels.triton import layer as triton_layer
from .cases import LinearCase
from .device import triton_torch_device
from .reference import oracle_linear, reference_linear

BACKENDS = ("cpu", "triton")
PATHS = ("oracle", "reference", *BACKENDS, *(kernel.name for kernel in REGISTRY))


def triton_device() -> str | None:
    """Where the Triton kernels can run here: 'cuda', 'cpu' (interpreter), or None (the one
    device of the suite: exactness.suite.device)."""
    return triton_torch_device()


def device_of(path: str) -> str | None:
    """The device a layer path runs on here (None: it cannot run here)."""
    family = path if path in BACKENDS else by_name(REGISTRY, path).family
    return triton_device() if family == "triton" else "cpu"


def unavailable(path: str) -> tuple[str, bool] | None:
    """None where `path` runs here; else (why not, whether that is a failure). It is one where
    this machine has what the path needs but the path was refused: the C kernel's paths on a CPU
    with AVX-512 VNNI and a C compiler, where its build or its self-check failed. A check of it
    would then pass by skipping, on the machine where it matters."""
    if path in available_paths():
        return None
    kernel = next((k for k in REGISTRY if k.name == path), None)
    device = device_of(path)
    if kernel is None or device is None:
        return f"{path} does not run here: Triton needs a GPU or EXACTNESS_DEVICE=interpret", False
    why = kernel.available(torch.device(device)).why
    return f"{path} does not run here: {why}", expected_here(kernel.name)


def expected_here(kernel: str) -> bool:
    """Whether the C kernel `kernel` must run here: a C compiler is on PATH and every C build it
    rests on is expected (CBuild.expected). The AMX kernel rests on two: the AVX-512 build's
    and its own tiles'; the others on their build of the C kernel."""
    import shutil

    from ..kernels.cpu import amx, vnni_library

    found = by_name(REGISTRY, kernel)
    if found.layout != "vnni":
        return False
    avx512, avx2, tiles = _c_builds()
    builds = ((avx512, tiles) if kernel == amx.AMX.name
              else (avx2,) if found.build is vnni_library.AVX2 else (avx512,))
    return (all(build.expected() for build in builds)
            and shutil.which(os.environ.get("CC", "cc")) is not None)


class CBuild(NamedTuple):
    """One C build the suite checks on every CPU, and the switch that turns it on or emulates it."""

    what: str
    variable: str  # its switch: EXACTNESS_NATIVE or EXACTNESS_AMX
    modes: dict
    mode: Callable[[], str]  # the switch's value
    missing: Callable[[], list[str]]  # the CPU features it lacks here
    emulable: bool = True  # whether its switch's "emulate" builds it without those features

    def expected(self) -> bool:
        """Whether it must run here: its switch is on, and the CPU has its features or the
        switch emulates them."""
        emulated = self.emulable and self.mode() == "emulate"
        return self.mode() != "0" and (emulated or not self.missing())


def _c_builds() -> tuple[CBuild, CBuild, CBuild]:
    """The C kernel's AVX-512 build, its AVX2 build (never emulated: every x86-64 CPU this
    project runs on has AVX2), then the AMX tiles', which rest on the AVX-512 build."""
    from ..kernels.cpu import amx_library, vnni_library

    avx512, avx2 = vnni_library.AVX512, vnni_library.AVX2
    return (CBuild("the C kernel (AVX-512 VNNI)", "EXACTNESS_NATIVE", vnni_library.MODES,
                   vnni_library.mode, avx512.missing_features),
            CBuild("the C kernel (AVX2)", "EXACTNESS_NATIVE", vnni_library.MODES,
                   vnni_library.mode, avx2.missing_features, emulable=False),
            CBuild("the AMX kernel's tiles", "EXACTNESS_AMX", amx_library.MODES, amx_library.mode,
                   amx_library.missing_features))


def emulate_the_c_kernel_where_missing() -> str:
    """The suite checks the C kernels on every CPU: each C build (_c_builds) emulated where the
    CPU lacks its features, unless its switch is set (EXACTNESS_NATIVE=emulate for AVX-512
    VNNI, EXACTNESS_AMX=emulate for AMX-INT8). Says which builds it checks."""
    said = []
    for build in _c_builds():
        lacks = build.missing()
        if lacks and build.emulable and build.variable not in os.environ:
            os.environ[build.variable] = "emulate"
        if build.mode() == "0" and not said:  # the first build off turns the others off too
            return f"{build.what}: off (every C build, the AMX kernel with them)"
        if build.mode() == "emulate" and build.emulable:
            why = f": the CPU lacks {', '.join(lacks)}" if lacks else ""
            said.append(f"{build.what} emulated ({build.variable}=emulate{why})")
        elif lacks:
            said.append(f"{build.what}: off, the CPU lacks {', '.join(lacks)}")
        else:
            said.append(f"{build.what}: {build.modes['1']}")
    return "; ".join(said)


def refused_here() -> list[str]:
    """Why each path that should run here does not (unavailable): [] on a sound machine."""
    from ..kernels import REGISTRY as kernels

    return [why for why, failure in filter(None, map(unavailable, (k.name for k in kernels)))
            if failure]


def require(path: str) -> None:
    """In a test: skip, saying why, where `path` cannot run here; fail where it should
    (unavailable)."""
    import pytest

    missing = unavailable(path)
    if missing is not None:
        why, failure = missing
        if failure:
            pytest.fail(f"{why}: the C kernel was refused where it should run")
        pytest.skip(why)


def available_paths(case: LinearCase | None = None) -> list[str]:
    """The paths that run here; with `case`, only the backends and kernels that hold its inputs
    (a backend none of whose kernels does raises KernelUnavailableError: tests check that)."""
    paths = ["oracle", "reference", *(b for b in BACKENDS if device_of(b) is not None
                                      and (case is None or backend_holds(case, b)))]
    weights = None if case is None else layer_for(case, "cpu").weights()
    for kernel in REGISTRY:
        device = device_of(kernel.name)
        if device is None or not kernel.available(torch.device(device)):
            continue
        if weights is not None and not kernel.eligible(case.shape[0], weights):
            continue
        paths.append(kernel.name)
    return paths


def backend_holds(case: LinearCase, backend: str) -> bool:
    """Whether some kernel of `backend` holds `case` here (its layer's plan)."""
    from ..kernels import KernelUnavailableError

    device = device_of(backend)
    x = torch.zeros(case.shape[:2], dtype=torch_dtype(case.x_format), device=device)
    try:
        layer_for(case, backend, device).plan(x)
    except KernelUnavailableError:
        return False
    return True


def held_act_bits(path: str) -> tuple[int, ...]:
    """The activation widths `path` holds: every one, but a kernel's own `eligible` may refuse
    some (the int8 kernels: 32 bits)."""
    from ..contract import ACT_BITS
    from ..modules import ExactLinear

    if path not in PATHS or path in ("oracle", "reference", "cpu"):
        return ACT_BITS
    kernel = triton_layer.GROUP if path == "triton" else by_name(REGISTRY, path)
    return tuple(a for a in ACT_BITS
                 if kernel.eligible(1, ExactLinear(GROUP_SIZE, 1, a).weights()))


def grouped_paths() -> list[str]:
    """The grouped kernels that run here (they hold every case)."""
    return [k.name for k in REGISTRY if k.grouped and k.name in available_paths()]


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
    """The output bit patterns [M, N] of `case` computed by `path` ([M, top_k * N / experts]
    with routing)."""
    if case.routing is not None:
        kernel = next((k for k in REGISTRY if k.name == path), None)
        if kernel is not None and kernel.grouped:
            return run_grouped(case, kernel)
        return routed_outputs(run(replace(case, routing=None, experts=1, parts=1), path), case)
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
        raise RuntimeError(f"the {path} path needs a GPU or EXACTNESS_DEVICE=interpret")
    layer = layer_for(case, path, device)
    x = bits_to_tensor(case.x_bits, case.x_format).to(device)
    return tensor_to_bits(layer(x))


def routed_outputs(y: np.ndarray, case: LinearCase) -> np.ndarray:
    """Each row's routed outputs [M, top_k * N / experts] of all the experts' outputs y [M, N]:
    slot s of row t is its expert's block of y, zeros for no expert."""
    m, top_k = case.routing.shape
    per = case.shape[2] // case.experts
    blocks = np.concatenate([y, np.zeros((m, per), y.dtype)], axis=1).reshape(m, -1, per)
    return blocks[np.arange(m)[:, None], case.routing].reshape(m, top_k * per)


def run_grouped(case: LinearCase, kernel) -> np.ndarray:
    """`case`'s routed outputs by the grouped kernel `kernel`, as an MoE layer runs it: each
    expert's parts layers of their own on the kernel's backend, one grouped call
    (moe.projection)."""
    from ..kernels.routing import route
    from ..moe import projection

    m, k, n = case.shape
    per = n // case.experts
    device = device_of(kernel.name)

    def layer(rows: slice):
        return layer_for(replace(case, q=case.q[rows], weight_packed=case.weight_packed[rows],
                                 scale_bits=case.scale_bits[rows], routing=None, experts=1,
                                 parts=1), kernel.family, device)

    size = per // case.parts
    layers = [[layer(slice(e * per + p * size, e * per + (p + 1) * size))
               for p in range(case.parts)] for e in range(case.experts)]
    routing = route(torch.from_numpy(case.routing).to(device), case.experts)
    x = bits_to_tensor(case.x_bits, case.x_format).to(device)
    y = tensor_to_bits(projection(layers, x, routing, gather=True, kernel=kernel))
    out = np.zeros((m, case.routing.shape[1] * per), dtype=np.int64)
    pairs = routing.pair[:int(routing.routed)].cpu().numpy()
    for row, pair in enumerate(pairs):
        t, slot = divmod(int(pair), case.routing.shape[1])
        out[t, slot * per:(slot + 1) * per] = y[row]
    return out
