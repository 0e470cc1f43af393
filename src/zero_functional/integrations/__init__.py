"""Glue for training frameworks; importing this package imports none of them (each name is
imported on first use, PEP 562).

Accelerate's ``save_state`` and the Transformers ``Trainer`` save the optimizer's
``state_dict()`` on one process: :func:`.accelerate.register` and :class:`ZeroTrainerCallback`
consolidate a ZeRO optimizer's state there first. Lightning and Fabric need nothing (they call
``consolidate_state_dict`` on every rank); ``torch.distributed.checkpoint`` takes
:func:`zero_functional.checkpoint.stateful`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zero_functional.integrations import accelerate, transformers
    from zero_functional.integrations.transformers import ZeroTrainerCallback

__all__ = ["ZeroTrainerCallback", "accelerate", "transformers"]


def __getattr__(name: str) -> Any:
    """Import a submodule, or a public name's module, on first use.

    Example:
        >>> import zero_functional.integrations as integrations
        >>> integrations.accelerate.__name__, integrations.__all__
        ('zero_functional.integrations.accelerate', ['ZeroTrainerCallback', 'accelerate', 'transformers'])
    """
    if name in ("accelerate", "transformers"):
        return importlib.import_module(f"{__name__}.{name}")
    if name == "ZeroTrainerCallback":
        return importlib.import_module(f"{__name__}.transformers").ZeroTrainerCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
