"""The Triton interpreter made faster for the suite, its arithmetic untouched.

- `speedups`: the ten ways, installed together (`install`);
- `values`: the types and operands each operation builds, shared;
- `replay`: a launch on the bytes an earlier one read replays its writes;
- `store`: those launches kept on disk, named by content, for the next process;
- `tables`: tables of addresses (the grouped kernels' experts) in a replayed launch.

exactness.suite.device installs it where the Triton kernels are interpreted.
"""

from .replay import tally
from .speedups import install, installed, uninstall

__all__ = ["install", "installed", "tally", "uninstall"]
