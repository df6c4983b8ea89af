"""The exact model's logits against an fp32 model with the same dequantized experts, beside the
bf16 model's (issue 21): transformers' tiny DeepseekV3 of tests/hf_checkpoints.py, its experts
int4 by compressed-tensors' compressor. Reports ||y - y_fp32|| / ||y_fp32|| for each.

    .venv/bin/python -m bench.hf_logits
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

from exactness import hf
from exactness.formats import unpack_weights
from exactness.kimi import ExactExperts
from tests.hf_checkpoints import tiny_model, write


def dequantized_into(model, exact) -> None:
    """model's fused experts := exact's int4 experts dequantized (q * s), in model's dtype."""
    for name, module in exact.named_modules():
        if not isinstance(module, ExactExperts):
            continue
        fused = model.get_submodule(name)
        w = {p: torch.stack([_weight(getattr(e, f"{p}_proj")) for e in module])
             for p in ("gate", "up", "down")}
        with torch.no_grad():
            fused.gate_up_proj.copy_(torch.cat([w["gate"], w["up"]], 1))
            fused.down_proj.copy_(w["down"])


def _weight(layer) -> torch.Tensor:
    q = torch.from_numpy(unpack_weights(layer.weight_packed.numpy(), 4)).double()
    return q * layer.weight_scale.double().repeat_interleave(32, 1)


def main() -> int:
    base = tiny_model()
    exact = hf.from_pretrained(write(Path(tempfile.mkdtemp()), base))
    fp32, bf16 = copy.deepcopy(base).float(), copy.deepcopy(base)
    dequantized_into(fp32, exact)
    dequantized_into(bf16, exact)  # the dequantized weights rounded to bf16
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        truth = fp32(ids).logits.double()
        for name, model in (("exact experts (bf16 elsewhere)", exact), ("bf16 dequantized", bf16)):
            y = model(ids).logits.double()
            print(f"{name}: ||y - y_fp32|| / ||y_fp32|| = "
                  f"{(y - truth).norm() / truth.norm():.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
