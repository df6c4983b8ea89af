"""The suite that verifies the product: the oracle and the numpy reference, Hypothesis
strategies, counterexample files, planted mutants, the dataflow simulator, `make verify` and the
CI gate. The product (exactness minus this package) never imports it; proofs/ sits beside it."""
