"""Z3 proofs of the accumulator bounds of the kernel dataflow (exactness/dataflow.py)."""
