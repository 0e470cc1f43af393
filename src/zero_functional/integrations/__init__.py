"""Glue for training frameworks; importing this package imports none of them.

* Hugging Face Accelerate: :func:`zero_functional.integrations.accelerate.register` makes
  ``accelerator.save_state`` consolidate each ZeRO optimizer on the main process first.
* Hugging Face Transformers: :class:`ZeroTrainerCallback` (in ``Trainer(callbacks=[...])``)
  does the same before each checkpoint the ``Trainer`` saves.
* PyTorch Lightning and Lightning Fabric need nothing: their strategies call
  ``consolidate_state_dict`` on every rank before they save an optimizer that has one.
* ``torch.distributed.checkpoint``: :func:`zero_functional.checkpoint.stateful`.

Each name is imported from its module on first use (PEP 562), and that module imports its
framework only then.

Example:
    >>> import zero_functional.integrations
    >>> zero_functional.integrations.__all__
    ['ZeroTrainerCallback', 'accelerate', 'transformers']
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zero_functional.integrations import accelerate, transformers
    from zero_functional.integrations.transformers import ZeroTrainerCallback

__all__ = ["ZeroTrainerCallback", "accelerate", "transformers"]

_HOME = {"ZeroTrainerCallback": "zero_functional.integrations.transformers"}


def __getattr__(name: str) -> Any:
    """Import a submodule, or a public name's module, on first use.

    Example:
        >>> import zero_functional.integrations as integrations
        >>> integrations.accelerate.__name__
        'zero_functional.integrations.accelerate'
    """
    if name in ("accelerate", "transformers"):
        return importlib.import_module(f"{__name__}.{name}")
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
