"""The doctests' one-rank world: each doctest of ``src/`` runs inside a gloo process group of one
rank (``group`` in its namespace), made for it and destroyed after, so that a docstring shows the
call it documents, not the setup of a world. A doctest about starting worlds (its examples call
one of :data:`STARTS_A_WORLD`) gets none: it starts its own."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

STARTS_A_WORLD = ("process_group(", "run_ranks(", "fake_world(")


@pytest.fixture(autouse=True)
def _doctest_world(
    request: pytest.FixtureRequest, doctest_namespace: dict[str, Any]
) -> Iterator[None]:
    item = request.node
    if not isinstance(item, pytest.DoctestItem) or item.dtest is None:
        yield
        return
    import torch
    import torch.distributed as dist

    doctest_namespace["torch"] = torch
    source = "".join(example.source for example in item.dtest.examples)
    if any(call in source for call in STARTS_A_WORLD):
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/world", rank=0, world_size=1)
        doctest_namespace["group"] = dist.group.WORLD
        try:
            yield
        finally:
            dist.destroy_process_group()
