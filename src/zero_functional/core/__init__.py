"""The pure core: partitions, ownership, layouts, plans, piece state, checks.

Nothing here issues a collective or imports ``torch.distributed`` or :mod:`zero_functional.comm`
(``.ci/rules.py`` checks it): every function is a value in, a value out."""
