"""exactness: exact int4 linear layers for Kimi K2 native checkpoints, and their verifier.

Dataflow of the package: contract -> formats -> quantize -> kernels -> modules -> kimi. The
suite that verifies it (exactness.suite, proofs/) is never imported from here.
"""

from .contract import (
    ContractTypeError,
    ContractValueError,
    ExactnessError,
    NonFiniteError,
    ShapeError,
)
from .kernels import REGISTRY, KernelUnavailableError
from .modules import ExactLayer, ExactLinear, PackedInt4Linear

__all__ = [
    "ExactLinear",
    "PackedInt4Linear",
    "ExactLayer",
    "ContractTypeError",
    "ContractValueError",
    "ExactnessError",
    "NonFiniteError",
    "ShapeError",
    "KernelUnavailableError",
    "REGISTRY",
]
__version__ = "0.1.0"
