"""Planted bugs: the suite shows that each of its checks can fail.

- `catalogue`, `catalogue_c_and_moe`: the bugs, as data (a snippet, its replacement, the tests
  that must fail);
- `targets`: where they are planted (functions, C files) and their killers' test ids;
- `run`: planting one in memory (`applied`) and judging it, `python -m exactness mutants`;
- `mutmut_score`: mutmut's independent score of the product's arithmetic, triaged.
"""

from .catalogue import CATALOGUE
from .run import applied, from_env, mutated_function, run_tests
from .targets import Mutant

__all__ = ["CATALOGUE", "Mutant", "applied", "from_env", "mutated_function", "run_tests"]
