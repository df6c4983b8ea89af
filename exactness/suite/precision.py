"""`python -m exactness precision`: how much more precise is the exact path than bf16, measured.

Ground truth: the exact rational product of the bf16 input with the dequantized weights
(q * scale, exactly), computed in integers (truth.true_product). Every path is compared with it,
element by element.

Definitions (t = truth, y = a path's output, over all rows and outputs with t != 0):
- rel: |y - t| / |t|, mean and max;
- ulp: |y - t| in units of the output format's ulp at t (so 0.5 is a correctly rounded output);
- norm: ||y - t||_2 / ||t||_2 over the whole output;
- rounded: the share of outputs that are RNE(t) bit for bit (correctly rounded);
- ratio: the bf16 path's error / the path's error, per metric.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..contract import BFLOAT16, FLOAT32, GROUP_SIZE, FloatFormat, float_format
from ..formats import float_bits, pack_weights, tensor_to_bits, unpack_weights
from ..modules import PackedInt4Linear
from .truth import correctly_rounded_bits, true_product, ulp_errors

# --------------------------------------------------------------------------- data


def qat_layer(k: int, n: int, seed: int) -> PackedInt4Linear:
    """QAT-like int4 weights: Gaussian weights, per-group scale amax / 7 in bf16, q = round."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    scale = (w.abs().view(n, k // GROUP_SIZE, GROUP_SIZE).amax(-1) / 7).bfloat16()
    q = torch.round(w / scale.float().repeat_interleave(GROUP_SIZE, 1)).clamp(-8, 7)
    layer = PackedInt4Linear(k, n, backend="cpu")
    layer.load_state_dict({"weight_packed": torch.from_numpy(pack_weights(q.long().numpy(), 4)),
                           "weight_scale": scale, "weight_shape": torch.tensor([n, k])})
    return layer


def activations(kind: str, m: int, k: int, seed: int) -> torch.Tensor:
    """'gaussian': N(0, 1); 'heavy': Student-t (3 dof) with 8 outlier channels scaled by 50."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(m, k, generator=g).bfloat16()
    t = torch.distributions.StudentT(3.0)
    torch.manual_seed(seed)
    x = t.sample((m, k))
    x[:, torch.randperm(k, generator=g)[:8]] *= 50
    return x.bfloat16()


# --------------------------------------------------------------------------- the truth


def exact_truth(x: torch.Tensor, layer: PackedInt4Linear) -> tuple[np.ndarray, np.ndarray]:
    """(integers T[r, n], exponents E[r, n]) with y_true = T * 2**E exactly (truth.py)."""
    q = unpack_weights(layer.weight_packed.numpy(), layer.bits, layer.in_features)
    return true_product(tensor_to_bits(x), float_format(x.dtype), q,
                        float_bits(layer.weight_scale).numpy())


# --------------------------------------------------------------------------- paths


def dequantize(weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype
               ) -> torch.Tensor:
    """q * scale [N, K] from a checkpoint's int4 tensors, exact in fp32, then in `dtype`."""
    q = torch.from_numpy(unpack_weights(weight_packed.numpy(), 4)).float()
    return (q * weight_scale.float().repeat_interleave(GROUP_SIZE, 1)).to(dtype)


def dequantized(layer: PackedInt4Linear, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(layer.weight_packed, layer.weight_scale, dtype)


def outputs(x: torch.Tensor, layer: PackedInt4Linear) -> dict[str, torch.Tensor]:
    w_bf16, w_fp32 = dequantized(layer, torch.bfloat16), dequantized(layer, torch.float32)
    out = {"bf16 (dequantize, bf16 matmul)": x @ w_bf16.t(),
           "fp32 (dequantize, fp32 matmul)": x.float() @ w_fp32.t()}
    for act_bits in (4, 8, 16, 32):
        layer.act_bits = act_bits  # (the layer derives its data again for the new width)
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            layer.out_dtype = dtype
            out[f"exact a{act_bits}, {name} out"] = layer(x)
    layer.act_bits, layer.out_dtype = 16, None
    return out


def amax_scale_output(x: torch.Tensor, layer: PackedInt4Linear, act_bits: int) -> torch.Tensor:
    """The exact path's arithmetic with the activation scale amax / Qa instead of a power of two
    (float64, fp32 out): what the power-of-two rule costs."""
    qmax = 2 ** (act_bits - 1) - 1
    xd = x.double()
    scale = xd.abs().amax(dim=1, keepdim=True) / qmax
    qa = torch.round(xd / torch.where(scale == 0, 1, scale))
    return ((qa * scale) @ dequantized(layer, torch.float64).t()).float()


# --------------------------------------------------------------------------- metrics


@dataclass
class Errors:
    rel_mean: float
    rel_max: float
    ulp_mean: float
    ulp_max: float
    norm: float
    rounded: float  # share of outputs correctly rounded
    rel: np.ndarray  # all relative errors, for the plot


def errors(y: torch.Tensor, truth: tuple, fmt: FloatFormat) -> Errors:
    t_int, t_exp = truth
    t = np.array([[math.ldexp(v, int(e)) for v, e in zip(row, erow, strict=True)]
                  for row, erow in zip(t_int, t_exp, strict=True)])  # float64 of the truth
    yv = y.double().numpy()
    nz = t != 0
    rel = np.abs(yv - t)[nz] / np.abs(t[nz])
    ulp = ulp_errors(tensor_to_bits(y), t_int, t_exp, fmt)[nz]
    return Errors(float(rel.mean()), float(rel.max()), float(ulp.mean()), float(ulp.max()),
                  float(np.linalg.norm(yv - t) / np.linalg.norm(t)),
                  float(rounded_bits(y, truth, fmt).mean()), rel)


def rounded_bits(y: torch.Tensor, truth: tuple, fmt: FloatFormat) -> np.ndarray:
    """Per output: whether y is RNE of the exact truth, bit for bit."""
    return tensor_to_bits(y) == correctly_rounded_bits(*truth, fmt)


def correctly_rounded(y: torch.Tensor, truth: tuple, fmt: FloatFormat) -> bool:
    """y is RNE of the exact truth, bit for bit (the exact path's promise)."""
    return bool(rounded_bits(y, truth, fmt).all())


# --------------------------------------------------------------------------- the report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactness precision", description=__doc__)
    parser.add_argument("--tokens", type=int, default=32, help="rows per distribution")
    parser.add_argument("--out", default="reports")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    rows, all_rel, cost = [], {}, []
    for shape, (k, n) in {"7168->2048": (7168, 2048), "2048->7168": (2048, 7168)}.items():
        layer = qat_layer(k, n, seed=k)
        for dist in ("gaussian", "heavy"):
            x = activations(dist, args.tokens, k, seed=n)
            truth = exact_truth(x, layer)
            ys = outputs(x, layer)
            base = None
            for path, y in ys.items():
                e = errors(y, truth, FLOAT32 if y.dtype == torch.float32 else BFLOAT16)
                base = base or e
                rows.append((shape, dist, path, e, base))
                all_rel.setdefault(path, []).append(e.rel)
            for act_bits in (8, 16):
                p2 = errors(ys[f"exact a{act_bits}, fp32 out"], truth, FLOAT32)
                amax = errors(amax_scale_output(x, layer, act_bits), truth, FLOAT32)
                cost.append((shape, dist, act_bits, p2.norm, amax.norm))
            print(f"  {shape} {dist}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    nbytes = representation(layer)
    report = render(rows, cost, nbytes, args, time.perf_counter() - start)
    (out / "precision.md").write_text(report)
    plot(all_rel, out / "precision.png")
    print(report)
    return 0


def representation(layer: PackedInt4Linear) -> list[tuple[str, float]]:
    weights = layer.in_features * layer.out_features
    layer(torch.zeros(1, layer.in_features, dtype=torch.bfloat16))  # build the derived data
    checkpoint = layer.weight_packed.numel() * 4 + layer.weight_scale.numel() * 2
    return [("packed int4 + bf16 scales (the checkpoint's tensors)", checkpoint / weights),
            ("what the layer holds besides them (the kernels read them in place)",
             layer.derived_nbytes() / weights),
            ("a bf16 weight", dequantized(layer, torch.bfloat16).element_size()),
            ("an fp32 weight", 4.0)]


def render(rows, cost, nbytes, args, seconds) -> str:
    lines = ["# Precision: the exact path against bf16, measured", "",
             f"Command: `python -m exactness precision --tokens {args.tokens}` "
             f"(`make precision`), {seconds:.0f} s on the project's 2-core machine.", "",
             "Data: QAT-like int4 layers at both Kimi expert shapes (Gaussian weights, "
             "per-group bf16 scale amax/7, q = round(w/scale)); bf16 activations, Gaussian N(0,1) "
             "and heavy-tailed (Student-t, 3 dof, 8 outlier channels x50), "
             f"{args.tokens} tokens each. Ground truth: the exact rational product of the bf16 "
             "input and q * scale, in integers (exactness/precision.py).", "",
             "Definitions: rel = |y - t| / |t| (mean, max); ulp = |y - t| in ulps of the output "
             "format at t; norm = ||y - t|| / ||t||; rounded = the share of outputs that are the "
             "correctly rounded truth, bit for bit; ratio = bf16 path's error / this path's.", "",
             "| shape | activations | path | rel mean | rel max | ulp mean | ulp max | norm | "
             "rounded | ratio rel mean | ratio norm |", "| --- " * 11 + "|"]
    for shape, dist, path, e, base in rows:
        lines.append(f"| {shape} | {dist} | {path} | {e.rel_mean:.3g} | {e.rel_max:.3g} | "
                     f"{e.ulp_mean:.3g} | {e.ulp_max:.3g} | {e.norm:.3g} | {e.rounded:.1%} | "
                     f"{_ratio(base.rel_mean, e.rel_mean)} | {_ratio(base.norm, e.norm)} |")
    near = [(abs(math.log(b.norm / e.norm / 950)), f"{path} ({shape}, {dist}): norm ratio "
             f"{b.norm / e.norm:.0f}") for shape, dist, path, e, b in rows if e.norm > 0] + [
        (abs(math.log(b.rel_mean / e.rel_mean / 950)), f"{path} ({shape}, {dist}): rel-mean "
         f"ratio {b.rel_mean / e.rel_mean:.0f}") for shape, dist, path, e, b in rows
        if e.rel_mean > 0]
    near.sort()
    lines += ["", "## Which definition gives ~950?", "",
              "The ratios closest to 950 in this run: " + "; ".join(n for _, n in near[:3]) + ".",
              "", "## What the power-of-two activation scale costs", "",
              "Output error (norm, fp32 out) of the exact path with the contract's power-of-two "
              "scale 2**e_r against the same arithmetic with the scale amax / Qa:", "",
              "| shape | activations | act_bits | 2**e_r | amax/Qa | cost |",
              "| --- | --- | --- | --- | --- | --- |"]
    for shape, dist, ab, p2, am in cost:
        lines.append(f"| {shape} | {dist} | {ab} | {p2:.3g} | {am:.3g} | {p2 / am:.2f}x |")
    lines += ["", "## Bytes per weight (measured from the live tensors, 2048->7168 layer)", "",
              "| representation | bytes / weight |", "| --- | --- |"]
    lines += [f"| {name} | {b:.4g} |" for name, b in nbytes]
    lines += ["", "![error distributions](precision.png)", ""]
    return "\n".join(lines)


def _ratio(base: float, error: float) -> str:
    """bf16's error over a path's: "exact" where the path has none at all."""
    return f"{base / error:.3g}" if error else "no error"


def plot(all_rel: dict, file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for path, rels in all_rel.items():
        rel = np.concatenate(rels)
        rel = rel[rel > 0]
        if rel.size:
            ax.hist(np.log10(rel), bins=80, histtype="step", label=path)
    ax.set_xlabel("log10 relative error against the exact product")
    ax.set_ylabel("outputs")
    ax.set_title("Error distribution per path (Kimi expert shapes, all activations)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(file, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
