"""The kernel interface, and the plan that picks a kernel for a forward.

A kernel is one way to compute the layer's output bits. It answers four calls:
- `available(device)`: does it run here at all (the CPU's features, a compiler, Triton)?
- `eligible(rows, weights)`: does it hold these inputs exactly (widths, shapes)?
- `prepare(weights)`: the data it derives from the buffers, built once per layer and kept;
- `run(x, weights, prepared, out_format)`: y [M, N] in `out_format`, x [M, K] 2-D.

The first two return a `Fit`: true or false, and why. A kernel computes every weight row the
certificate calls fast; the layer splices the other rows in from the `wide` kernel. `Weights`
holds the layer's live buffers, never a copy, and `prepare` runs per forward: nothing a kernel
derives outlives the forward, so a write to the buffers is seen at the next one.

A grouped kernel (`grouped` true) also computes one projection of every routed expert of an MoE
layer in one call (exactness.moe): `run_grouped(x, routing, experts, bits, act_bits, out_format,
gather)`. What it reads of the experts (`reads`) is each routed expert's `Weights` and prepared
data, after its layer's checks on the host ("layers"), or every expert's live buffers through a
table on the device ("buffers").

`plan` picks the first kernel of the registry (kernels/__init__.py, fastest first) that runs
here, holds the inputs, and is preferred at this many rows. A forced kernel (`kernel=` or
`EXACTNESS_KERNEL`) that cannot run raises `KernelUnavailableError`: never a silent substitute.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .. import dataflow
from ..contract import ContractValueError, FloatFormat
from ..formats import unpack_weights
from .certificate import Certificate, certify

ENV = "EXACTNESS_KERNEL"


class KernelUnavailableError(ContractValueError):
    """A kernel was asked for by name, but it does not run here or does not hold the inputs."""


def capturing(x: torch.Tensor) -> bool:
    """Whether x's stream is being captured into a CUDA graph."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class Fit:
    ok: bool
    why: str

    def __bool__(self) -> bool:
        return self.ok


class FallbackWarning(UserWarning):
    """A faster kernel is not used here, and why."""


@functools.cache
def warn_fallback(kernel: str, why: str, instead: str = "a slower exact CPU kernel runs instead",
                  stacklevel: int = 3) -> None:
    """Says once per process and reason that `kernel` is not used, why, and what runs instead:
    the one warning of every fallback (the C kernels, AMX, the grouped MoE call)."""
    warnings.warn(f"{kernel} is not used: {why}; {instead}", FallbackWarning,
                  stacklevel=stacklevel)


def yes(why: str) -> Fit:
    return Fit(True, why)


def no(why: str) -> Fit:
    return Fit(False, why)


def int8_limbs_hold(act_bits: int, carried: int) -> Fit:
    """Whether an int8 kernel that carries at most `carried` int8 limbs of an activation (its
    `act_limbs`) holds `act_bits`-bit activations (32 bits need four)."""
    limbs = dataflow.act_limbs(act_bits)
    if limbs > carried:
        return no(f"act_bits {act_bits} needs {limbs} int8 limbs, it carries at most {carried}")
    return yes(f"act_bits {act_bits} in {limbs} int8 limb(s)")


class Weights:
    """What a kernel reads besides x, for one forward: the layer's live buffers (never a copy: a
    write through any door reaches the next forward), its widths, and the scales' certificate,
    derived from the live scales on first ask and dropped with the forward."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int, bits: int,
                 act_bits: int):
        self.packed = packed  # weight_packed [N, K * bits / 32] int32
        self.scale = scale  # weight_scale [N, K / 32] bf16
        self.n, self.k, self.bits, self.act_bits = n, k, bits, act_bits
        # (slow rows, NaN rows) as a kernel found them while it ran (the C kernel's flags), so
        # the layer derives no certificate of its own; None: from the certificate
        self.found: tuple[torch.Tensor, torch.Tensor] | None = None

    @functools.cached_property
    def certificate(self) -> Certificate:
        return certify(self.scale, self.k, self.bits, self.act_bits)

    def rows_apart(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slow rows, NaN rows) [int64], on the CPU: what the layer splices in after a kernel."""
        if self.found is not None:
            return self.found
        cert = self.certificate
        return cert.slow_rows.cpu(), cert.nan_rows.cpu()

    def q(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weights as integers [N, K] (or of `rows` only), unpacked on the CPU."""
        packed = self.packed.cpu() if rows is None else self.packed.cpu()[rows.cpu()]
        return torch.from_numpy(unpack_weights(packed.numpy(), self.bits, self.k))


class Kernel(Protocol):
    name: str  # what plan() reports, and what kernel= and EXACTNESS_KERNEL take
    family: str  # "cpu" or "triton": the backend it serves
    layout: str  # kernels of one layout share one prepared object per layer (and device)
    min_rows: int  # the plan prefers it from this many rows on (measured: docs/PERFORMANCE.md)
    auto: bool  # whether the plan may pick it unasked
    grouped: bool  # whether it also runs an MoE layer's experts in one call (run_grouped)
    act_limbs: int  # int8 kernels: the most int8 limbs of an activation it carries (else 0)

    def available(self, device: torch.device) -> Fit: ...

    def eligible(self, rows: int, weights: Weights) -> Fit: ...

    def prepare(self, weights: Weights) -> Any: ...

    def run(self, x: torch.Tensor, weights: Weights, prepared: Any,
            out_format: FloatFormat) -> torch.Tensor: ...


class GroupedKernel(Kernel, Protocol):
    """A kernel with `grouped = True`: one projection of every routed expert of an MoE layer in
    one call (exactness.moe)."""

    # "layers": each routed expert's (Weights, prepare()'s object) after its layer's checks on
    # the host, the prepared object saying found() (slow rows, NaN rows) after the call (the
    # CPU's); "buffers": every expert's live buffers, through a table on the device (the GPU's)
    reads: str
    auto_grouped: bool  # whether plan_grouped may pick it unasked (an emulated build: no)

    def run_grouped(self, x: torch.Tensor, routing, experts: list, bits: int, act_bits: int,
                    out_format: FloatFormat, gather: bool,
                    workspace=None) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass(frozen=True)
class Plan:
    kernel: Kernel
    why: str
    # weight rows spliced in from the wide kernel: layer.plan(x) counts them (the forward's
    # plan reads no scales)
    slow_rows: int = 0
    passed_over: tuple[tuple[str, str], ...] = field(default=())  # (kernel, why not)

    def __str__(self) -> str:
        lines = [f"{self.kernel.name}: {self.why}"]
        if self.slow_rows:
            lines.append(f"  + wide for {self.slow_rows} slow weight rows (scale spread)")
        lines += [f"  not {name}: {why}" for name, why in self.passed_over]
        return "\n".join(lines)


def by_name(kernels, name: str) -> Kernel:
    for kernel in kernels:
        if kernel.name == name:
            return kernel
    raise ContractValueError(f"no kernel named {name!r}; registered: "
                             f"{[k.name for k in kernels]}")


def refuse_unheld(kernel: str, act_bits: int, carried: int) -> None:
    """KernelUnavailableError where an int8 kernel carrying `carried` limbs is run on wider
    activations (a grouped kernel called directly, past plan_grouped)."""
    held = int8_limbs_hold(act_bits, carried)
    if not held:
        raise KernelUnavailableError(f"kernel {kernel!r} was run, but {held.why}")


def plan_grouped(kernels, family: str, device: torch.device, act_bits: int,
                 forced: str | None = None) -> Plan:
    """The grouped kernel an MoE layer's experts on `device` take (`forced`: that one, by name),
    or KernelUnavailableError saying why none runs. Every grouped kernel is an int8 kernel, so
    `act_bits` must fit its limbs (int8_limbs_hold of its `act_limbs`)."""
    if forced:
        kernel = by_name(kernels, forced)
        fit = kernel.available(device) if kernel.grouped else no("it is no grouped kernel")
        fit = fit and int8_limbs_hold(act_bits, kernel.act_limbs)
        if not fit:
            raise KernelUnavailableError(f"kernel {forced!r} was asked for ({ENV}=), but "
                                         f"{fit.why}")
        return Plan(kernel, f"asked for by {ENV}={forced}")
    passed = []
    for kernel in kernels:
        if not kernel.grouped or kernel.family != family:
            continue
        if not kernel.auto_grouped:
            passed.append((kernel.name, "emulated: run only when asked for by name"))
            continue
        fit = kernel.available(device)
        fit = fit and int8_limbs_hold(act_bits, kernel.act_limbs)
        if fit:
            return Plan(kernel, fit.why, passed_over=tuple(passed))
        passed.append((kernel.name, fit.why))
    raise KernelUnavailableError(f"no grouped {family} kernel runs here or holds this: "
                                 f"{'; '.join(f'{name}: {why}' for name, why in passed)}")


def plan(kernels, family: str, device: torch.device, rows: int, weights: Weights,
         forced: str | None = None) -> Plan:
    """The kernel a forward of `rows` rows on `device` takes, and why (see the module's doc)."""
    by = "kernel=" if forced else f"{ENV}="
    forced = forced or os.environ.get(ENV) or None
    if forced:
        kernel = by_name(kernels, forced)
        for fit in (kernel.available(device), kernel.eligible(rows, weights)):
            if not fit:
                raise KernelUnavailableError(f"kernel {forced!r} was asked for ({by}), but "
                                             f"{fit.why}")
        return Plan(kernel, f"asked for by {by}{forced}")
    passed = []
    for kernel in kernels:
        if not kernel.auto or kernel.family != family:
            continue
        if rows < kernel.min_rows:  # not asked whether it runs: no build where it is not wanted
            passed.append((kernel.name, f"preferred from {kernel.min_rows} rows on, x has {rows}"))
            continue
        fits = (kernel.available(device), kernel.eligible(rows, weights))
        bad = next((fit for fit in fits if not fit), None)
        if bad is None:
            return Plan(kernel, "; ".join(fit.why for fit in fits), passed_over=tuple(passed))
        passed.append((kernel.name, bad.why))
    raise KernelUnavailableError(f"no {family} kernel runs here: "
                                 f"{'; '.join(f'{name}: {why}' for name, why in passed)}")
