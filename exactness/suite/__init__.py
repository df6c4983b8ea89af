"""The suite that verifies the product. The product (exactness minus this package) never imports
it; proofs/ sits beside it.

At the top, the oracle's side and what every room compares with: `reference` (the pure-integer
oracle and the numpy reference), `truth` (the correctly rounded product), `strategies`
(Hypothesis), `cases`, `simulate` (the dataflow simulator), `paths` (every production path, run
on a case), `device` (where the Triton kernels run), `counterexamples` (files that replay),
`precision` (the precision report) and `triton_aot` (the kernels compiled for sm_90).

The rooms, each importing the others only through their faces (`__init__.py`):
- `gate/`: `make verify`, the CI gate, the Hypothesis profiles, replays;
- `mutants/`: planted bugs, and mutmut's score;
- `peers/`: the suite run on kernels and checkpoints this project did not write;
- `interpreter/`: the Triton interpreter made faster, launches replayed and stored.
"""
