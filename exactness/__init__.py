"""exactness: exact int4 linear layers for Kimi K2 native checkpoints, and their verifier.

Dataflow of the package: contract -> formats -> reference | kernels -> modules -> kimi.
"""

from .contract import (
    ContractTypeError,
    ContractValueError,
    ExactnessError,
    NonFiniteError,
    ShapeError,
)
from .modules import ExactLinear, PackedInt4Linear
from .reference import oracle_linear, reference_linear

__all__ = [
    "ExactLinear",
    "PackedInt4Linear",
    "ContractTypeError",
    "ContractValueError",
    "ExactnessError",
    "NonFiniteError",
    "ShapeError",
    "oracle_linear",
    "reference_linear",
]
__version__ = "0.1.0"
