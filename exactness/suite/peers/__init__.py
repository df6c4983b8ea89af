"""The suite run on what this project did not write.

- `properties`: the properties (the claim, batch invariance, determinism, non-finite rows, tails)
  searched on any kernel with Hypothesis, verdicts in Alive2's words;
- `command`: `python -m exactness check KERNEL`, and the replay of its counterexamples;
- `kernels`: others' int4 kernels as factories (compressed-tensors, torch's), `make peers`;
- `kimi_check`: `python -m exactness kimi DIR`, a Kimi checkpoint on disk checked.
"""

from .command import replay
from .properties import CheckError, Claim, Report, check, load_kernel

__all__ = ["CheckError", "Claim", "Report", "check", "load_kernel", "replay"]
