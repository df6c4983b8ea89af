"""The production layers: `PackedInt4Linear` (Kimi's native int4 checkpoint, zero conversion) and
`ExactLinear` (ordinary weights quantized onto the same exact path, 4 or 8 bits).

Persistent state is exactly the checkpoint's keys: `weight_packed`, `weight_scale`,
`weight_shape`. Everything derived from them (the certificate, each kernel's layout) is derived
from a private copy of the buffers, which each forward compares with the buffers bit for bit: a
write through any door (`param.data.copy_`, a numpy view, a reassigned attribute) is seen at the
next forward, never computed past. The derived data is never saved.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from . import dataflow
from .contract import (
    BFLOAT16,
    DEFAULT_ACT_BITS,
    GROUP_SIZE,
    ContractTypeError,
    ContractValueError,
    FloatFormat,
    NonFiniteError,
    ShapeError,
    check_act_bits,
    check_in_features,
    check_weight_bits,
    float_format,
)
from .formats import (
    bits_to_tensor,
    check_finite,
    finite_mask,
    float_bits,
    pack_weights,
    split_scales,
    zero_word,
)
from .kernels import REGISTRY, Kernel, Plan, Weights, plan, triton_exact
from .kernels.registry import ENV, by_name
from .kernels.wide import WIDE, linear_rows

BACKENDS = ("auto", "cpu", "triton")


@dataclass
class Certificate:
    """What the fast paths need of the scales, and which weight rows they hold exactly.

    A row is fast when its scale-exponent spread is within dataflow.certified_spread (the int64
    combine and the folded weights' digits both hold it); other rows take the exact reference
    path.
    """

    emin: torch.Tensor  # [N] int64: least exponent of the row's nonzero scales (0 if none)
    spread: torch.Tensor  # [N] int64
    factor: torch.Tensor  # [N, G] int32: ms << (es - emin), 0 on slow rows (dataflow step 3)
    fast: torch.Tensor  # [N] bool
    spread_limit: int
    slow_rows: torch.Tensor  # [N_slow] int64, the rows not fast (found once, not per forward)
    fast_spread: int  # the largest spread of a fast row (0 if none): the folded digits it needs
    # [N_nan] int64 (CPU): rows holding a non-finite scale, written in place after loading. Their
    # scales count as 0 here, and their outputs are the canonical NaN (contract v1.2, section 2)
    nan_rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    def summary(self) -> dict:
        return {"rows": int(self.fast.numel()), "fast_rows": int(self.fast.sum()),
                "slow_rows": int((~self.fast).sum()), "max_spread": int(self.spread.max()),
                "spread_limit": self.spread_limit, "nan_rows": int(self.nan_rows.numel())}


def certify(weight_scale: torch.Tensor, k: int, w_bits: int, act_bits: int) -> Certificate:
    bits = float_bits(weight_scale)
    finite = finite_mask(bits, BFLOAT16)
    ms, shift, emin, spread = split_scales(torch.where(finite, bits, 0))
    limit = dataflow.certified_spread(k, w_bits, act_bits)
    fast = spread <= limit
    # an int32 for every certified spread (proved: scale-factor)
    keep = fast[:, None]
    factor = torch.where(keep, ms.to(torch.int64) << torch.where(keep, shift, 0), 0)
    return Certificate(emin, spread, factor.to(torch.int32), fast, limit,
                       torch.nonzero(~fast).flatten().cpu(),
                       int(torch.where(fast, spread, 0).max()) if spread.numel() else 0,
                       torch.nonzero(~finite.all(dim=1)).flatten().cpu())


@dataclass
class Derived:
    """What a forward reads besides x, derived from one private copy of the buffers (`weights`
    holds the copies, so no write to the buffers reaches a kernel mid-forward), kept until the
    buffers or the widths differ from it."""

    weights: Weights
    widths: tuple  # (bits, act_bits, strict) it was derived for
    layouts: dict = field(default_factory=dict)  # each kernel layout's prepared data
    plans: dict = field(default_factory=dict)  # forward's plans by (family, device, rows, ...)

    def holds(self, packed: torch.Tensor, scale: torch.Tensor, widths: tuple) -> bool:
        return (widths == self.widths and same_bits(packed, self.weights.packed)
                and same_bits(scale, self.weights.scale))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b hold the same bits (not values: -0.0 and +0.0 differ, a NaN equals
    itself), compared as int64 words where the size allows (the fastest compare)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    flat_a, flat_b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if flat_a.numel() % 8 == 0:
        flat_a, flat_b = flat_a.view(torch.int64), flat_b.view(torch.int64)
    return torch.equal(flat_a, flat_b)


def check_buffer(name: str, t, shape: tuple, dtypes: tuple) -> None:
    """A typed error unless `t` is a tensor a kernel can read as the buffer `name`."""
    if not isinstance(t, torch.Tensor):
        raise ContractTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ContractTypeError(f"{name}: dtype {t.dtype}, expected one of {dtypes}")
    if tuple(t.shape) != shape:
        raise ShapeError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
    if t.device.type not in ("cpu", "cuda"):
        raise ContractValueError(f"{name} is on {t.device}: the kernels read the CPU or a CUDA "
                                 f"device")
    if not t.is_contiguous():
        raise ContractValueError(f"{name} must be contiguous (the kernels read it row by row), "
                                 f"got strides {t.stride()}")


_DERIVING = threading.Lock()  # one derivation at a time: first use from many threads


class _PackedExactLinear(nn.Module):
    """y = RNE(2**e_r * sum_g s[n,g] * sum_k qa[r,k] * q[n,k]) (docs/SPEC.md), bit for bit."""

    def __init__(self, in_features: int, out_features: int, act_bits: int = DEFAULT_ACT_BITS,
                 *, bits: int = 4, out_dtype: torch.dtype | None = None,
                 backend: str = "auto", kernel: str | None = None, strict: bool = False,
                 device=None):
        super().__init__()
        check_in_features(in_features)
        if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features <= 0:
            raise ShapeError(f"out_features must be a positive integer, got {out_features!r}")
        check_act_bits(act_bits)
        check_weight_bits(bits)
        if out_dtype is not None:
            float_format(out_dtype)
        if backend not in BACKENDS:
            raise ContractValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if kernel is not None:
            by_name(REGISTRY, kernel)  # a typed error now, for a name no kernel has
        if not isinstance(strict, bool):
            raise ContractTypeError(f"strict must be True or False, got {strict!r}")
        # plain attributes in one step: nn.Module's __setattr__ costs a few us each, and a Kimi
        # K2 builds 69,120 of these layers (bench/bench_construction.py)
        self.__dict__.update(in_features=in_features, out_features=out_features,
                             act_bits=act_bits, bits=bits, out_dtype=out_dtype, backend=backend,
                             kernel=kernel,  # None: the plan picks (or EXACTNESS_KERNEL)
                             strict=strict,  # a non-finite x or scale raises (v1's rule)
                             _derived=None)
        n, k = out_features, in_features
        # zero weights until a checkpoint loads: one fill, nothing on device="meta"
        self.register_buffer("weight_packed", torch.full(
            (n, k * bits // 32), zero_word(bits), dtype=torch.int32, device=device))
        self.register_buffer("weight_scale",
                             torch.zeros((n, k // GROUP_SIZE), dtype=torch.bfloat16, device=device))
        self.register_buffer("weight_shape", torch.tensor([n, k], dtype=torch.int64, device=device))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, act_bits={self.act_bits}, backend={self.backend}"
                + (f", kernel={self.kernel}" if self.kernel else "")
                + (", strict=True" if self.strict else ""))

    # ----------------------------------------------------------------- loading

    def _expected(self) -> dict:
        n, k = self.out_features, self.in_features
        return {"weight_packed": ((n, k * self.bits // 32), (torch.int32,)),
                "weight_scale": ((n, k // GROUP_SIZE), (torch.bfloat16,)),
                "weight_shape": ((2,), (torch.int32, torch.int64))}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        for name, (shape, dtypes) in self._expected().items():
            key = prefix + name
            if key in state_dict:  # (a missing key the base class reports)
                check_buffer(key, state_dict[key], shape, dtypes)
        shape_key = prefix + "weight_shape"
        if shape_key in state_dict:
            self._check_shape(state_dict[shape_key], shape_key)
        scale_key = prefix + "weight_scale"
        if scale_key in state_dict:
            check_finite(float_bits(state_dict[scale_key]), BFLOAT16, scale_key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _check_shape(self, weight_shape: torch.Tensor, name: str) -> None:
        got = [int(v) for v in weight_shape.tolist()]
        if got != [self.out_features, self.in_features]:
            raise ShapeError(f"{name}: {got}, but the layer is "
                             f"[{self.out_features}, {self.in_features}]")

    def checked_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight_packed, weight_scale, weight_shape) as they are now, or a typed error if a
        kernel could not read them (reassigned with another shape, dtype, device or strides).
        weight_shape's values are not read here (on a GPU that would wait for the device)."""
        for name, (shape, dtypes) in self._expected().items():
            check_buffer(name, getattr(self, name), shape, dtypes)  # a Parameter now, maybe
        packed, scale, shape = self.weight_packed, self.weight_scale, self.weight_shape
        if not packed.device == scale.device == shape.device:
            raise ContractValueError(f"weight_packed is on {packed.device}, weight_scale on "
                                     f"{scale.device}, weight_shape on {shape.device}: a kernel "
                                     f"reads them on one device")
        return packed, scale, shape

    def _readable_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight_packed, weight_scale) as they are now, or a typed error if a kernel could not
        read them (checked_buffers), or weight_shape disagrees with the layer's shape."""
        packed, scale, shape = self.checked_buffers()
        self._check_shape(shape, "weight_shape")
        return packed, scale

    # ----------------------------------------------------------------- derived data

    def _apply(self, fn, recurse=True):
        # The buffers are the checkpoint's format: a cast of the model (half(), float(),
        # to(dtype), type()) would change every output's bits (the bf16 scales) or garble the
        # packed words, so they keep their dtypes; a move to another device moves them.
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, buffer in before.items():
            if self._buffers[name].dtype != buffer.dtype:
                self._buffers[name] = buffer.to(self._buffers[name].device)
        return self

    def __getstate__(self) -> dict:
        # derived data is a cache (the CPU kernels' hold ctypes pointers, which cannot be
        # pickled): a copy or a pickle rebuilds it from the buffers on first use
        return {**self.__dict__, "_derived": None}

    @property
    def certificate(self) -> Certificate:
        return self._derive().weights.certificate

    def _derive(self) -> Derived:
        """The derived data of the buffers as they are now: kept if they hold the same bits as
        its copies (the cost of a compare of the buffers' bytes), else derived again."""
        packed, scale = self._readable_buffers()
        widths = (self.bits, self.act_bits, self.strict)  # what the derivation depends on
        derived = self._derived
        if derived is not None and derived.holds(packed, scale, widths):
            return derived
        with _DERIVING:
            derived = self._derived
            if derived is not None and derived.holds(packed, scale, widths):
                return derived  # another thread derived it meanwhile
            check_weight_bits(self.bits)
            check_act_bits(self.act_bits)
            if self.strict:  # else its rows' outputs are NaN (certify's nan_rows)
                check_finite(float_bits(scale), BFLOAT16, "weight_scale")
            packed, scale = packed.clone(), scale.clone()
            certificate = certify(scale, self.in_features, self.bits, self.act_bits)
            self._derived = Derived(Weights(packed, scale, self.out_features, self.in_features,
                                            self.bits, self.act_bits, certificate), widths)
            return self._derived

    def process_weights_after_loading(self) -> None:
        """Derives now what the first forward would (vLLM's hook, called after its weight
        loaders write the buffers): the certificate, a refusal of a non-finite scale, and the
        layout of the kernel a forward on the buffers' device takes."""
        derived = self._derive()
        device = derived.weights.packed.device
        family = "triton" if self.backend == "triton" or device.type == "cuda" else "cpu"
        for rows in (1, 128):  # decode and prefill may take kernels of two layouts
            chosen = self._plan(family, device, rows, derived)
            self._prepared(chosen.kernel, derived)

    def weights(self) -> Weights:
        """What a kernel reads besides x: copies of the buffers, the widths, the certificate."""
        return self._derive().weights

    def prepared(self, kernel: str | Kernel):
        """`kernel`'s derived data for these weights (by name or kernel), built on first use and
        shared by the kernels of one layout."""
        kernel = by_name(REGISTRY, kernel) if isinstance(kernel, str) else kernel
        return self._prepared(kernel, self._derive())

    @staticmethod
    def _prepared(kernel: Kernel, derived: Derived):
        if kernel.layout not in derived.layouts:
            derived.layouts[kernel.layout] = kernel.prepare(derived.weights)
        return derived.layouts[kernel.layout]

    def gpu_weights(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The Triton kernels' (factor, offset_sums, emin) on `device`, built on first use."""
        return triton_exact.gpu_weights(self.weights(), self.prepared(triton_exact.GROUP),
                                        device)

    def derived_nbytes(self) -> int:
        """Bytes of derived tensors held now: the buffers' copies, the certificate, each kernel's
        derived weights (a tensor the GPU's tuple shares with the certificate, on its device,
        counted once)."""
        derived = self._derive()
        cert, weights = derived.weights.certificate, derived.weights
        tensors = {t.data_ptr(): t for t in (weights.packed, weights.scale, cert.emin,
                                             cert.spread, cert.factor, cert.fast)}
        layouts = 0
        for layout in derived.layouts.values():
            if isinstance(layout, dict):  # the Triton kernels': a tuple per device
                tensors.update((t.data_ptr(), t) for per_device in layout.values()
                               for t in per_device)
            elif layout is not None:
                layouts += layout.nbytes
        return layouts + sum(t.numel() * t.element_size() for t in tensors.values())

    # ----------------------------------------------------------------- forward

    def _family(self, x: torch.Tensor) -> str:
        if self.backend == "triton" or (self.backend == "auto" and x.is_cuda):
            return "triton"
        if x.is_cuda:
            raise ContractValueError("backend='cpu' needs x on the CPU")
        return "cpu"

    def plan(self, x: torch.Tensor) -> Plan:
        """The kernel a forward of x takes, and why (print it to read the reasons); an x the
        forward refuses gets its typed error here too."""
        derived = self._derive()
        x2, _ = self._checked(x, derived.weights.packed.device)
        return self._plan(self._family(x2), x2.device, x2.shape[0], derived)

    def _plan(self, family: str, device: torch.device, rows: int, derived: Derived) -> Plan:
        # a plan depends on nothing else (the C kernel's and _int_mm's checks are the process's)
        key = (family, device, rows, self.kernel, os.environ.get(ENV))
        plans = derived.plans
        if key not in plans:
            if len(plans) > 64:  # many batch sizes: keep the cache small
                plans.clear()
            plans[key] = plan(REGISTRY, family, device, rows, derived.weights, self.kernel)
        return plans[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Check the buffers, plan, run, splice the slow rows."""
        if torch.jit.is_tracing():
            raise ContractValueError(
                "the exact layers cannot be traced by torch.jit.trace: their kernels write the "
                "output where the tracer does not see it, so a trace would replay uninitialised "
                "memory; call the layer eagerly")
        derived = self._derive()  # before x: a bad buffer is named even for an empty x
        x2, out_format = self._checked(x, derived.weights.packed.device)
        if x2.shape[0] == 0:
            return torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype
                               if self.out_dtype is None else self.out_dtype, device=x.device)
        weights = derived.weights
        family = self._family(x2)
        chosen = self._plan(family, x2.device, x2.shape[0], derived)
        prepared = self._prepared(chosen.kernel, derived)
        bad_rows = None
        if family == "triton":  # on the device: nothing read back (contract v1.2)
            x2, bad_rows = self._finite_rows(x2)
        try:  # the CPU kernels find a non-finite x as they quantize: no pass of its own
            y = chosen.kernel.run(x2, weights, prepared, out_format)
        except NonFiniteError:
            if self.strict or bad_rows is not None:
                raise
            x2, bad_rows = self._finite_rows(x2)
            y = chosen.kernel.run(x2, weights, prepared, out_format)
        slow = weights.certificate.slow_rows
        if slow.numel() and chosen.kernel is not WIDE:  # spreads no fast kernel holds
            y[:, slow.to(x.device)] = linear_rows(x2, weights, slow, out_format,
                                                  self._prepared(WIDE, derived))
        if bad_rows is not None:
            y = y.masked_fill_(bad_rows[:, None], float("nan"))
        if weights.certificate.nan_rows.numel():
            y = y.index_fill_(1, weights.certificate.nan_rows.to(y.device), float("nan"))
        if x.requires_grad and torch.is_grad_enabled():
            y = _NoBackward.apply(x, y)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _finite_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x with every row that holds a non-finite value zeroed, those rows' mask), computed
        on x's device; a strict layer raises NonFiniteError instead (one read of the device).
        A forward then gives those rows the canonical NaN (contract v1.2, section 3)."""
        bad = ~torch.isfinite(x).all(dim=1)
        if self.strict and bool(bad.any()):
            check_finite(float_bits(x), float_format(x.dtype), "x")  # raises: count, index
        return x.masked_fill(bad[:, None], 0), bad

    def _checked(self, x: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, FloatFormat]:
        """x as [M, K] and the output's format, or a typed error (the buffers are on `device`)."""
        if not isinstance(x, torch.Tensor):
            raise ContractTypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.device != device:
            raise ContractValueError(f"x is on {x.device}, the layer's buffers on {device}: "
                                     f"move one (layer.to(x.device))")
        float_format(x.dtype)
        out_format = float_format(self.out_dtype or x.dtype)
        k = self.in_features
        if x.dim() == 0 or x.shape[-1] != k:
            raise ShapeError(f"x.shape[-1] must be in_features={k}, got shape {tuple(x.shape)}")
        return (x if x.dim() == 2 else x.reshape(-1, k)), out_format  # (a reshape: ~30 us cold)


class _NoBackward(torch.autograd.Function):
    """Hands the layer's output on; a backward through it raises. Without it a graph would be
    cut silently here: gradients upstream of the layer would be missing, not refused."""

    @staticmethod
    def forward(ctx, x, y):
        return y

    @staticmethod
    def backward(ctx, grad):
        raise ContractValueError(
            "the exact layers define no gradient: x required grad, and a backward reached "
            "PackedInt4Linear/ExactLinear (run them under torch.no_grad(), or detach x)")


class PackedInt4Linear(_PackedExactLinear):
    """Kimi K2's routed-expert projection: int4 pack-quantized weights, group 32, bf16 scales."""

    def __init__(self, in_features: int, out_features: int, act_bits: int = DEFAULT_ACT_BITS, *,
                 out_dtype: torch.dtype | None = None, backend: str = "auto",
                 kernel: str | None = None, strict: bool = False, device=None):
        super().__init__(in_features, out_features, act_bits, bits=4, out_dtype=out_dtype,
                         backend=backend, kernel=kernel, strict=strict, device=device)


class ExactLinear(_PackedExactLinear):
    """The exact path for ordinary weights, 4 or 8 bits (ExactLinear.from_weight)."""

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bits: int = 4, group_size: int = GROUP_SIZE,
                    act_bits: int = DEFAULT_ACT_BITS, *, out_dtype: torch.dtype | None = None,
                    backend: str = "auto", kernel: str | None = None,
                    strict: bool = False) -> ExactLinear:
        """Quantize `weight` [N, K] group-wise (docs/SPEC.md section 6) onto the exact path."""
        from .quantize import quantize_weight

        if group_size != GROUP_SIZE:
            raise ContractValueError(f"group_size must be {GROUP_SIZE}, got {group_size!r}")
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ShapeError("weight must be a 2-D tensor [out_features, in_features]")
        n, k = weight.shape
        check_in_features(k, "weight.shape[1] (in_features)")
        q, scale_bits = quantize_weight(float_bits(weight.detach().cpu()).numpy(),
                                        float_format(weight.dtype), bits)
        layer = cls(k, n, act_bits, bits=bits, out_dtype=out_dtype, backend=backend, kernel=kernel,
                    strict=strict, device=weight.device)
        layer.load_state_dict({
            "weight_packed": torch.from_numpy(pack_weights(q, bits)),
            "weight_scale": bits_to_tensor(scale_bits, BFLOAT16),
            "weight_shape": torch.tensor([n, k])})
        return layer
