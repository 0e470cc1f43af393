"""The package's public names: each one resolves, from the module the lazy table names."""

from __future__ import annotations

import importlib

import zero_functional


def test_every_public_name_resolves_to_the_object_its_module_defines() -> None:
    for name in zero_functional.__all__:
        value = getattr(zero_functional, name)
        module = importlib.import_module(zero_functional._HOME[name])
        assert value is getattr(module, name), name
    assert sorted(zero_functional._HOME) == sorted(zero_functional.__all__)
