"""The production layers: `PackedInt4Linear` (Kimi's native int4 checkpoint, zero conversion) and
`ExactLinear` (ordinary weights quantized onto the same exact path, 4 or 8 bits).

Persistent state is exactly the checkpoint's keys: `weight_packed`, `weight_scale`,
`weight_shape`, and nothing else is held. Each forward reads the buffers as they are: the kernels
read `weight_packed` and `weight_scale` in place, and derive what they need of the scales as
they run (the C kernel per block of rows, the GPU's per program) or per forward (the slower
paths). So a write through any door (`param.data.copy_`, a numpy view, a reassigned attribute)
is seen at the next forward, with no copy to compare and nothing to invalidate.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from . import ops
from .contract import (
    BFLOAT16,
    DEFAULT_ACT_BITS,
    GROUP_SIZE,
    ContractTypeError,
    ContractValueError,
    FloatFormat,
    ShapeError,
    check_act_bits,
    check_in_features,
    check_weight_bits,
    float_format,
)
from .formats import (
    bits_to_tensor,
    check_finite_tensor,
    float_bits,
    pack_weights,
    torch_dtype,
    zero_word,
)
from .kernels import REGISTRY, Kernel, Plan, Weights
from .kernels.certificate import Certificate, certify  # noqa: F401 (the layer's API)
from .kernels.registry import by_name
from .kernels.wide import WIDE

BACKENDS = ("auto", "cpu", "triton")


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


class ExactLayer(nn.Module):
    """y = RNE(2**e_r * sum_g s[n,g] * sum_k qa[r,k] * q[n,k]) (docs/SPEC.md), bit for bit: the
    base of PackedInt4Linear and ExactLinear.

    Its kernel inputs, public for callers of many layers at once (exactness.moe, exactness.kimi,
    a serving stack): `expected_buffers()` (each buffer's shape and dtypes), `checked_buffers()`,
    `weights()` (the live buffers as a kernel reads them), `certificate`, `checked_input(x,
    device)` (x as [M, K] and the output's format), `family(x)` (the kernels that take x) and
    `plan(x)`; `no_backward` wraps an output computed from them."""

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
                             _shape_seen=(None, 0))  # the GPU weight_shape last checked
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

    def expected_buffers(self) -> dict:
        """{buffer name: (its shape, the dtypes it may have)}."""
        n, k = self.out_features, self.in_features
        return {"weight_packed": ((n, k * self.bits // 32), (torch.int32,)),
                "weight_scale": ((n, k // GROUP_SIZE), (torch.bfloat16,)),
                "weight_shape": ((2,), (torch.int32, torch.int64))}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        for name, (shape, dtypes) in self.expected_buffers().items():
            key = prefix + name
            if key in state_dict:  # (a missing key the base class reports)
                check_buffer(key, state_dict[key], shape, dtypes)
        shape_key = prefix + "weight_shape"
        if shape_key in state_dict:
            self._check_shape(state_dict[shape_key], shape_key)
        scale_key = prefix + "weight_scale"
        if scale_key in state_dict:
            check_finite_tensor(state_dict[scale_key], scale_key)
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
        for name, (shape, dtypes) in self.expected_buffers().items():
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
        if traced(shape):  # its values cannot be read: checked at the next eager forward
            pass
        elif not (shape.is_cuda or self.backend == "triton"):
            self._check_shape(shape, "weight_shape")
        elif self._shape_seen[0] is not shape or self._shape_seen[1] != shape._version:
            # for the GPU its values are read once per tensor and in-place op (torch's version
            # counter), not every forward: that read waits for the device, and no kernel reads
            # them. (A write through .data, which bumps no version, is not seen here.) The tensor
            # itself is kept, not its id, which a new tensor may reuse.
            self._check_shape(shape, "weight_shape")
            self._shape_seen = (shape, shape._version)
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

    def weights(self) -> Weights:
        """What a kernel reads besides x, for one forward: the live buffers (checked readable,
        never copied), the widths, and the scales' certificate on first ask."""
        packed, scale = self._readable_buffers()
        check_weight_bits(self.bits)
        check_act_bits(self.act_bits)
        return Weights(packed, scale, self.out_features, self.in_features, self.bits,
                       self.act_bits)

    @property
    def certificate(self) -> Certificate:
        """The scales' certificate as they are now (derived on each call: nothing is kept)."""
        return self.weights().certificate

    def process_weights_after_loading(self) -> None:
        """vLLM's hook, called after its weight loaders write the buffers: checks them as a
        forward would (readable; a strict layer refuses a non-finite scale) and builds the
        kernels a forward on their device takes. Nothing derived is kept, and no layout
        replaces the checkpoint's: every kernel reads the buffers in place or per forward."""
        weights = self.weights()
        if self.strict:
            check_finite_tensor(weights.scale, "weight_scale")
        device = weights.packed.device
        family = "triton" if self.backend == "triton" or device.type == "cuda" else "cpu"
        for rows in (1, 128):  # decode and prefill may take two kernels: each built and checked
            ops.planned(family, device, rows, weights, self.kernel).kernel.available(device)

    def prepared(self, kernel: str | Kernel):
        """What `kernel` derives for one forward of these weights (by name or kernel): the C
        kernel's in-place view, a slower path's layout. Not kept."""
        kernel = by_name(REGISTRY, kernel) if isinstance(kernel, str) else kernel
        return kernel.prepare(self.weights())

    def derived_nbytes(self) -> int:
        """Bytes held between forwards besides the buffers: none (the kernels read the buffers
        in place; what a forward derives, `prepared(kernel).nbytes`, goes with it)."""
        return 0

    # ----------------------------------------------------------------- forward

    def family(self, x: torch.Tensor) -> str:
        """"triton" or "cpu": the family of kernels a forward of x takes."""
        if self.backend == "triton" or (self.backend == "auto" and x.is_cuda):
            return "triton"
        if x.is_cuda:
            raise ContractValueError("backend='cpu' needs x on the CPU")
        return "cpu"

    def plan(self, x: torch.Tensor) -> Plan:
        """The kernel a forward of x takes, and why (print it to read the reasons), with the slow
        rows the scales have now; an x the forward refuses gets its typed error here too."""
        weights = self.weights()
        x2, _ = self.checked_input(x, weights.packed.device)
        chosen = ops.planned(self.family(x2), x2.device, x2.shape[0], weights, self.kernel)
        slow = int(weights.certificate.slow_rows.numel()) if chosen.kernel is not WIDE else 0
        return dataclasses.replace(chosen, slow_rows=slow)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Check the buffers and x, then one `exactness::linear` op (exactness/ops.py): on a GPU
        it reads nothing back, so a CUDA graph captures it and torch.compile traces it whole.
        `out_dtype`: this call's output format (default: the layer's out_dtype, else x's)."""
        if torch.jit.is_tracing():
            raise ContractValueError(
                "the exact layers cannot be traced by torch.jit.trace: their kernels write the "
                "output where the tracer does not see it, so a trace would replay uninitialised "
                "memory; call the layer eagerly")
        weights = self.weights()  # before x: a bad buffer is named even for an empty x
        x2, out_format = self.checked_input(x, weights.packed.device, out_dtype)
        if x2.shape[0] == 0:
            return torch.empty((*x.shape[:-1], self.out_features),
                               dtype=torch_dtype(out_format), device=x.device)
        if self.strict:  # v1's rule: a non-finite x or scale raises (a read of the device)
            check_finite_tensor(x2, "x")
            check_finite_tensor(weights.scale, "weight_scale")
        # the op's dispatch costs about 0.3 ms a call on a 2-core CPU, a fifth of a Kimi
        # projection at M = 1 (docs/PERFORMANCE.md): a plain eager CPU forward calls the op's
        # body; a GPU, a trace, a capture or torch.compile takes the op
        call = ops.forward if plainly_on_the_cpu(x2) else ops.linear
        y = call(x2.detach(), weights.packed, weights.scale, self.in_features, self.bits,
                 self.act_bits, torch_dtype(out_format), self.family(x2), self.kernel)
        if x.requires_grad and torch.is_grad_enabled():
            y = no_backward(x, y)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def checked_input(self, x: torch.Tensor, device: torch.device,
                      out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, FloatFormat]:
        """x as [M, K] and the output's format (`out_dtype`, else the layer's, else x's), or a
        typed error (the buffers are on `device`)."""
        if not isinstance(x, torch.Tensor):
            raise ContractTypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.device != device:
            raise ContractValueError(f"x is on {x.device}, the layer's buffers on {device}: "
                                     f"move one (layer.to(x.device))")
        float_format(x.dtype)
        out_format = float_format(out_dtype or self.out_dtype or x.dtype)
        k = self.in_features
        if x.dim() == 0 or x.shape[-1] != k:
            raise ShapeError(f"x.shape[-1] must be in_features={k}, got shape {tuple(x.shape)}")
        return (x if x.dim() == 2 else x.reshape(-1, k)), out_format  # (a reshape: ~30 us cold)


def plainly_on_the_cpu(t: torch.Tensor) -> bool:
    """Whether t is a plain CPU tensor that nothing traces: no torch.compile, jit trace, fake or
    subclass tensor, or dispatch mode (make_fx's) sees the forward."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return (t.device.type == "cpu" and type(t) is torch.Tensor and not traced(t)
            and not torch.jit.is_tracing() and _get_current_dispatch_mode() is None)


def traced(t: torch.Tensor) -> bool:
    """Whether t's values cannot be read: torch.compile is tracing, or t is a fake tensor (a
    make_fx trace, FakeTensorMode)."""
    return torch.compiler.is_compiling() or isinstance(t, FakeTensor)


def no_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y, handed on as a function of x: a backward through it raises (_NoBackward)."""
    return _NoBackward.apply(x, y)


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


class PackedInt4Linear(ExactLayer):
    """Kimi K2's routed-expert projection: int4 pack-quantized weights, group 32, bf16 scales."""

    def __init__(self, in_features: int, out_features: int, act_bits: int = DEFAULT_ACT_BITS, *,
                 out_dtype: torch.dtype | None = None, backend: str = "auto",
                 kernel: str | None = None, strict: bool = False, device=None):
        super().__init__(in_features, out_features, act_bits, bits=4, out_dtype=out_dtype,
                         backend=backend, kernel=kernel, strict=strict, device=device)


class ExactLinear(ExactLayer):
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
