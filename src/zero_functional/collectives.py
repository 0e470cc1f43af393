"""The former name of :mod:`zero_functional.plans` (kept so that existing imports work)."""

from zero_functional.plans import (
    COLLECTIVES,
    Collectives,
    buffer_runs,
    bytes_sent,
    choose_collectives,
    choose_param_gather,
    even_chunk,
)

__all__ = [
    "COLLECTIVES",
    "Collectives",
    "buffer_runs",
    "bytes_sent",
    "choose_collectives",
    "choose_param_gather",
    "even_chunk",
]
