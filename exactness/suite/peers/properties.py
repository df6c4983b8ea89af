"""The suite run on a kernel this project did not write (`python -m exactness check`:
check_command.py): a kernel built through a factory, its claim (exact, or w4a16 within some ulp)
and the properties claim, batch-invariant, deterministic, non-finite and tails, each searched by
Hypothesis and given its own verdict; a refutation is a counterexample file that replays."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, given, settings, target
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from ...contract import ACT_BITS, BFLOAT16, GROUP_SIZE, ExactnessError, FloatFormat, float_format
from ...formats import bits_to_tensor, finite_mask, tensor_to_bits
from .. import counterexamples
from ..cases import LinearCase
from ..reference import reference_linear
from ..strategies import (
    KIMI_SHAPES,
    SCALE_KINDS,
    activation_bits,
    packed_weights,
    scale_bits,
)
from ..truth import true_product, ulp_errors

CLAIMS = ("exact", "w4a16")
NON_FINITE = ("nan", "refuse", "propagate")
PROPERTIES = ("claim", "batch-invariant", "deterministic", "non-finite", "tails")
TAILS = ((3, 96, 7), (1, 32, 1), (5, 160, 19), (17, 224, 33), (2, 7168, 5))  # (M, K, N)
ULP_BINS = (0.5, 1, 2, 4, 16, 256, np.inf)  # the distribution: shares at most each bound


class CheckError(ExactnessError, ValueError):
    """A KERNEL that cannot be loaded, or options that do not fit together."""


@dataclass(frozen=True)
class Claim:
    name: str = "exact"  # CLAIMS
    act_bits: int = 16  # exact: the contract's activation width
    max_ulp: float | None = None  # w4a16: refuted past this many ulps
    non_finite: str | None = None  # NON_FINITE; None: nan for exact, propagate for w4a16

    def __post_init__(self):
        if self.name not in CLAIMS:
            raise CheckError(f"--claim must be one of {', '.join(CLAIMS)}, got {self.name!r}")
        if self.act_bits not in ACT_BITS:
            raise CheckError(f"--act-bits must be one of {ACT_BITS}, got {self.act_bits}")
        if self.non_finite not in (None, *NON_FINITE):
            raise CheckError(f"--non-finite must be one of {', '.join(NON_FINITE)}, got "
                             f"{self.non_finite!r}")
        if self.max_ulp is not None and not self.max_ulp >= 0:
            raise CheckError(f"--max-ulp must be a number >= 0, got {self.max_ulp}")

    @property
    def on_non_finite(self) -> str:
        return self.non_finite or ("nan" if self.name == "exact" else "propagate")


@dataclass
class Verdict:
    prop: str
    verdict: str  # passed | refuted | unknown
    inputs: int = 0
    detail: str = ""
    file: Path | None = None


@dataclass
class Report:
    kernel: str
    claim: Claim
    verdicts: list[Verdict] = field(default_factory=list)
    worst_ulp: float | None = None  # w4a16: the largest error found
    where: str = ""  # and where it was
    within: dict[float, int] = field(default_factory=dict)  # ULP_BINS bound -> outputs within
    outputs: int = 0  # outputs measured

    @property
    def ok(self) -> bool:
        return all(v.verdict == "passed" for v in self.verdicts)


# --------------------------------------------------------------------------- the kernel


def load_kernel(spec: str) -> Callable:
    """The factory KERNEL names: MODULE:FACTORY, or a registered kernel's name."""
    if ":" not in spec:
        return registered(spec)
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CheckError(f"KERNEL {spec!r}: cannot import {module_name!r} ({e})") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CheckError(f"KERNEL {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def registered(name: str) -> Callable:
    """A factory of the layer with the registered kernel `name` forced: the project's kernels
    are checked as an outside one is."""
    from ...kernels import REGISTRY
    from ...kernels.registry import by_name
    from ..paths import device_of

    try:
        kernel = by_name(REGISTRY, name)
    except ExactnessError as e:
        raise CheckError(f"KERNEL {name!r} is no MODULE:FACTORY and {e}") from e

    def factory(weight_packed, weight_scale, weight_shape, act_bits: int = 16):
        device = device_of(name) or "cpu"
        layer = exact_layer(weight_packed, weight_scale, weight_shape, act_bits, kernel=name,
                            device=device,
                            backend="triton" if kernel.family == "triton" else "auto")
        return lambda x: layer(x.to(device)).cpu()

    fit = kernel.available(torch.device(device_of(name) or "cpu"))
    factory.cannot_run = None if fit else fit.why  # then nothing is checked: unknown, not refuted
    return factory


def exact_layer(weight_packed, weight_scale, weight_shape, act_bits: int, **options):
    """An ExactLinear holding the checkpoint's three tensors (`options`: its keywords)."""
    from ...modules import ExactLinear

    n, k = (int(v) for v in weight_shape)
    layer = ExactLinear(k, n, act_bits, **options)
    layer.load_state_dict({"weight_packed": weight_packed, "weight_scale": weight_scale,
                           "weight_shape": weight_shape})
    return layer


def build(factory: Callable, case: LinearCase, claim: Claim, prop: str = "claim") -> Callable:
    """The kernel of `case`'s weights, as the checkpoint holds them; a factory that refuses
    them is refuted (its tile's N multiple is --n-multiple; tails tries the rest)."""
    n, k = case.shape[2], case.shape[1]
    tensors = (torch.from_numpy(np.ascontiguousarray(case.weight_packed, dtype=np.int32)),
               bits_to_tensor(case.scale_bits, BFLOAT16),
               torch.tensor([n, k], dtype=torch.int64))
    try:
        return factory(*tensors, act_bits=claim.act_bits) if claim.name == "exact" else \
            factory(*tensors)
    except Exception as e:  # noqa: BLE001 (any refusal of a checkpoint's weights is the finding)
        raise Refuted(prop, case, f"the factory refused weights of N={n}, K={k}: "
                      f"{type(e).__name__}: {e}") from e


class Refuted(AssertionError):
    """A property failed on `case`: what, and the outputs to keep."""

    def __init__(self, prop: str, case: LinearCase, detail: str, expected=None, actual=None,
                 extra: dict | None = None):
        super().__init__(detail)
        self.prop, self.case, self.detail = prop, case, detail
        self.expected, self.actual, self.extra = expected, actual, extra or {}


def call(fn: Callable, x_bits: np.ndarray, case: LinearCase, prop: str
         ) -> tuple[np.ndarray, FloatFormat]:
    """(y's bit patterns [M, N], y's format) of fn(x); a kernel that raises on finite input, or
    returns something else than [M, N] floats, is refuted."""
    m, n = x_bits.shape[0], case.shape[2]
    try:
        y = fn(bits_to_tensor(x_bits, case.x_format))
    except Exception as e:  # noqa: BLE001 (any refusal of a finite input is the finding)
        raise Refuted(prop, case, f"raised on a finite input of M={m}, K={case.shape[1]}, "
                      f"N={n}: {type(e).__name__}: {e}") from e
    if not isinstance(y, torch.Tensor) or y.shape != (m, n) or y.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        got = f"{type(y).__name__} {getattr(y, 'shape', '')} {getattr(y, 'dtype', '')}"
        raise Refuted(prop, case, f"returned {got}, not [{m}, {n}] bf16, fp16 or fp32")
    return tensor_to_bits(y.detach().cpu()), float_format(y.dtype)


# --------------------------------------------------------------------------- the properties


def check_claim(fn: Callable, case: LinearCase, claim: Claim, report: Report,
                prop: str = "claim") -> None:
    got, fmt = call(fn, case.x_bits, case, prop)
    case = replace(case, out_format=fmt)
    if claim.name == "exact":
        want = reference_linear(case.x_bits, case.x_format, case.weight_packed, case.scale_bits,
                                act_bits=claim.act_bits, out_format=case.out_format,
                                w_bits=case.w_bits)
        if (got != want).any():
            r, c = (int(i) for i in np.argwhere(got != want)[0])
            raise Refuted(prop, case, f"{int((got != want).sum())} of {want.size} outputs "
                          f"differ from the contract's; the first at (row, out) ({r}, {c})",
                          want, got)
        return
    t, e = true_product(case.x_bits, case.x_format, case.q, case.scale_bits)
    errors = ulp_errors(got, t, e, case.out_format)
    worst = float(errors.max())
    if currently_in_test_context():  # a search, not a replay
        target(min(worst, 1e300), label="ulp error")
    for bound in ULP_BINS:
        report.within[bound] = report.within.get(bound, 0) + int((errors <= bound).sum())
    report.outputs += errors.size
    r, c = (int(i) for i in np.unravel_index(np.argmax(errors), errors.shape))
    if report.worst_ulp is None or worst > report.worst_ulp:
        report.worst_ulp = worst
        report.where = f"{case!r}, output ({r}, {c})"
    if claim.max_ulp is not None and worst > claim.max_ulp:
        raise Refuted(prop, case, f"{worst:.4g} ulps at (row, out) ({r}, {c}), past --max-ulp "
                      f"{claim.max_ulp}", None, got, {"ulp_error": worst})


def check_batch_invariant(fn: Callable, case: LinearCase, claim: Claim, report: Report) -> None:
    prop = "batch-invariant"
    whole = call(fn, case.x_bits, case, prop)[0]
    backwards = call(fn, case.x_bits[::-1].copy(), case, prop)[0][::-1]
    others = case.x_bits ^ case.x_format.sign_bit  # every row negated: other data, same size
    for r in range(case.shape[0]):
        alone = call(fn, case.x_bits[r:r + 1], case, prop)[0][0]
        among = others.copy()
        among[r] = case.x_bits[r]
        among = call(fn, among, case, prop)[0][r]
        for name, other in (("in its batch", whole[r]), ("in the batch reversed", backwards[r]),
                            ("among other rows", among)):
            if (alone != other).any():
                raise Refuted(prop, case, f"row {r}'s bits alone differ from its bits {name} of "
                              f"{case.shape[0]} rows", None, np.stack([alone, other]), {"row": r})


def check_deterministic(fn: Callable, case: LinearCase, claim: Claim, report: Report,
                        factory: Callable) -> None:
    prop = "deterministic"
    first = call(fn, case.x_bits, case, prop)[0]
    for name, again in (("a second call", fn),
                        ("a kernel built again", build(factory, case, claim, prop))):
        other = call(again, case.x_bits, case, prop)[0]
        if (first != other).any():
            raise Refuted(prop, case, f"{name} gave other bits on the same input", first, other)


def check_non_finite(fn: Callable, case: LinearCase, claim: Claim, poison: tuple[int, int, int]
                     ) -> None:
    """x with poison (row, column, pattern): an inf or NaN."""
    prop = "non-finite"
    r, c, pattern = poison
    clean = call(fn, case.x_bits, case, prop)[0]
    x = case.x_bits.copy()
    x[r, c] = pattern
    extra = {"poison": [r, c, f"{pattern:x}"]}
    what = f"x[{r}, {c}] = {pattern:#x}"
    try:
        y = fn(bits_to_tensor(x, case.x_format))
    except Exception as e:  # noqa: BLE001
        if claim.on_non_finite == "refuse":
            return
        raise Refuted(prop, case, f"{what} was refused ({type(e).__name__}: {e}); "
                      f"--non-finite {claim.on_non_finite} says it passes through",
                      extra=extra) from e
    if claim.on_non_finite == "refuse":
        raise Refuted(prop, case, f"{what} was not refused: the kernel returned outputs",
                      extra=extra)
    got = tensor_to_bits(y.detach().cpu())
    fmt = float_format(y.dtype)
    if finite_mask(got[r], fmt).any():
        raise Refuted(prop, case, f"{what}: row {r} has finite outputs", None, got, extra)
    if claim.on_non_finite == "nan" and (got[r] != fmt.nan_bits).any():
        raise Refuted(prop, case, f"{what}: row {r} is not all the canonical NaN "
                      f"({fmt.nan_bits:#x})", None, got, extra)
    others = [i for i in range(case.shape[0]) if i != r]
    if (got[others] != clean[others]).any():
        raise Refuted(prop, case, f"{what} changed the bits of other rows", clean, got, extra)


# --------------------------------------------------------------------------- inputs


@st.composite
def inputs(draw, claim: Claim, *, rows=(1, 4), max_k: int = 256, max_n: int = 24,
           n_multiple: int = 1, kimi: bool = False, x_format: FloatFormat = BFLOAT16,
           scales: str | None = None, shape: tuple[int, int, int] | None = None) -> LinearCase:
    """A checkpoint's projection and an input: the suite's weights, scales and activations."""
    if shape is not None:
        m, k, n = shape
    else:
        m = draw(st.integers(*rows))
        if kimi and draw(st.integers(0, 3)) == 0:
            k, n = draw(st.sampled_from(KIMI_SHAPES))
        else:
            k = GROUP_SIZE * draw(st.integers(1, max_k // GROUP_SIZE))
            n = n_multiple * draw(st.integers(1, max(1, max_n // n_multiple)))
    q, packed = draw(packed_weights(n, k, 4))
    act_bits = claim.act_bits if claim.name == "exact" else 16
    return LinearCase(draw(activation_bits(m, k, x_format, act_bits)), x_format, q, packed,
                      draw(scale_bits(n, k // GROUP_SIZE, scales)), act_bits, BFLOAT16, 4)


def _search(prop: str, strategy, examples: int, body: Callable, write: Callable) -> Verdict:
    """body(case, data) over `examples` inputs: passed, refuted (shrunk, and written) or
    unknown."""
    seen = [0]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), print_blob=False,
              phases=[p for p in Phase if p != Phase.explain])
    @given(strategy, st.data())
    def run(case, data):
        seen[0] += 1
        body(case, data)

    try:
        run()
    except Refuted as r:
        return Verdict(prop, "refuted", seen[0], r.detail, write(r))
    return Verdict(prop, "passed" if seen[0] else "unknown", seen[0])


def write(r: Refuted, kernel: str, claim: Claim, directory: Path | str | None = None) -> Path:
    """The counterexample file of a refutation: the usual format, naming the kernel, the claim
    and the property, which `repro --kernel` replays."""
    doc = {"kernel": kernel, "property": r.prop, "claim": claim.name, "max_ulp": claim.max_ulp,
           "non_finite": claim.on_non_finite, **r.extra}
    return counterexamples.write(r.case, path="kernel", expected=r.expected, actual=r.actual,
                                 source="check", note=r.detail, extra=doc, directory=directory)


def check(kernel: str, claim: Claim | None = None, *, examples: int = 30, kimi: bool = False,
          n_multiple: int = 1, scales: str | None = None, x_format: str = "bfloat16",
          properties=PROPERTIES, directory: Path | str | None = None) -> Report:
    """Every property of `kernel` (a KERNEL spec) under `claim`: the Report of their verdicts."""
    claim = claim or Claim()
    if scales is not None and scales not in SCALE_KINDS:
        raise CheckError(f"--scales must be one of {', '.join(SCALE_KINDS)}, got {scales!r}")
    unknown = set(properties) - set(PROPERTIES)
    if unknown:
        raise CheckError(f"no property {sorted(unknown)}; there are {', '.join(PROPERTIES)}")
    fmt = float_format(x_format)
    factory = load_kernel(kernel)
    report = Report(kernel, claim)
    why = getattr(factory, "cannot_run", None)  # a registered kernel's, on this machine
    if why is not None:
        report.verdicts += [Verdict(prop, "unknown", 0, f"it cannot run here: {why}")
                            for prop in properties]
        return report
    common = dict(n_multiple=n_multiple, x_format=fmt, scales=scales)

    def fn(case, prop):
        return build(factory, case, claim, prop)

    def claimed(case, data):
        check_claim(fn(case, "claim"), case, claim, report)

    def batch(case, data):
        check_batch_invariant(fn(case, "batch-invariant"), case, claim, report)

    def deterministic(case, data):
        check_deterministic(fn(case, "deterministic"), case, claim, report, factory)

    def non_finite(case, data):
        check_non_finite(fn(case, "non-finite"), case, claim, data.draw(_poisons(case, fmt)))

    def tails(case, data):
        check_claim(fn(case, "tails"), case, claim, report, "tails")

    bodies = {
        "claim": (inputs(claim, kimi=kimi, **common), claimed),
        "batch-invariant": (inputs(claim, rows=(2, 8), **common), batch),
        "deterministic": (inputs(claim, rows=(1, 8), kimi=kimi, **common), deterministic),
        "non-finite": (inputs(claim, rows=(2, 4), **common), non_finite),
        "tails": (st.sampled_from(TAILS).flatmap(lambda s: inputs(claim, shape=s, **common)),
                  tails),
    }
    for prop in properties:
        strategy, body = bodies[prop]
        count = len(TAILS) * 2 if prop == "tails" else examples
        report.verdicts.append(_search(prop, strategy, count, body,
                                       lambda r: write(r, kernel, claim, directory)))
    return report


def _poisons(case: LinearCase, fmt: FloatFormat):
    m, k = case.x_bits.shape
    kinds = (fmt.inf_bits, fmt.inf_bits | fmt.sign_bit, fmt.inf_bits | 1 << (fmt.mant_bits - 1))
    return st.tuples(st.integers(0, m - 1), st.integers(0, k - 1), st.sampled_from(kinds))
