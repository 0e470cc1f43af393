"""Hypothesis properties of the pure core; a package so that `tests.torch_reference` imports."""
