"""The quantization's stage: activations split into int8 limbs that recombine exactly."""

from __future__ import annotations

import z3

from exactness import dataflow
from exactness.contract import act_qmax

from .terms import Obligation, in_range


def limb_split(a_bits: int) -> Obligation:
    """qa in [-Qa, Qa] -> its int8 limbs (dataflow.activation_limbs: the digits of
    qa - limb_offset, taken in int64) are int8 and recombine."""
    qmax = act_qmax(a_bits)
    limbs, offset = dataflow.act_limbs(a_bits), dataflow.limb_offset(a_bits)

    def build():
        qa = z3.BitVec("qa", 64)
        if limbs == 1:
            return in_range(qa, -qmax, qmax), in_range(qa, -128, 127), {"qa": qa}
        rest, digits = qa - offset, []
        for _ in range(limbs):
            low = ((rest + 128) & 255) - 128
            digits.append(low)
            rest = (rest - low) >> dataflow.LIMB_BITS
        post = z3.And(*[in_range(d, -128, 127) for d in digits], rest == 0,
                      sum(d << (dataflow.LIMB_BITS * i) for i, d in enumerate(digits)) + offset
                      == qa)
        return in_range(qa, -qmax, qmax), post, {"qa": qa}

    return Obligation(f"limb-split-a{a_bits}", "activation limbs are int8 and sum back to qa",
                      build, a_bits=a_bits)
