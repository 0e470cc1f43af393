"""Example-based and multi-process tests; a package so that helpers import as `tests.*`."""
