"""zero_functional: ZeRO stage-1 sharded optimizers with a pure functional core.

The public surface is what this module re-exports:

* the drop-in shell :class:`ZeroRedundancyOptimizer` and the DDP hooks
  :func:`hook_with_zero_step` / :func:`hook_with_zero_step_interleaved` (the step inside
  backward) and :func:`reduce_scatter_hook` (DDP's bytes when stepping after backward);
* the pure core: partitions (:func:`sorted_greedy`, :func:`flat`, :func:`balance_report`),
  bucket layouts, and functional optimizers (:func:`sgd`, :func:`adam`, :func:`adamw`);
* ownership, the one value that says which rank owns which pieces of which parameters
  (:class:`Ownership`, built by :func:`sorted_greedy_ownership`, :func:`flat_ownership`,
  :func:`bucket_ownership`), and the collectives policy (:func:`choose_collectives`);
* :class:`ShardedEMA`, the EMA of the weights each owner keeps for its own pieces;
* the functional ZeRO step for custom loops (:func:`shard_init`, :func:`shard_update`) with
  its collectives :func:`reduce_to_owners` and :func:`sync_params`.

Each name is imported from its module on first use (PEP 562), so that importing the package,
as ``zero-functional --help`` does, does not import torch. ``_MODULES`` is the one list of
what is public and where it lives; ``__all__`` is derived from it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

_MODULES: dict[str, tuple[str, ...]] = {
    "zero_functional.core.layout": (
        "BucketAssignment",
        "BucketLayout",
        "bucket_layout",
        "ddp_bucket_assignments",
        "flatten",
        "views",
    ),
    "zero_functional.core.plans": ("bytes_sent", "choose_collectives"),
    "zero_functional.comm": ("reduce_to_owners", "sync_params"),
    "zero_functional.functional": (
        "AdamState",
        "FunctionalOptimizer",
        "SGDState",
        "adam",
        "adamw",
        "functional_spec",
        "register_optimizer",
        "sgd",
    ),
    "zero_functional.hooks": (
        "hook_with_zero_step",
        "hook_with_zero_step_interleaved",
        "overlap_state",
        "reduce_scatter_hook",
    ),
    "zero_functional.optimizer": ("ZeroRedundancyOptimizer",),
    "zero_functional.ema": ("ShardedEMA",),
    "zero_functional.core.ownership": (
        "Ownership",
        "bucket_ownership",
        "flat_ownership",
        "piece_view",
        "piece_views",
        "sorted_greedy_ownership",
        "whole_ownership",
    ),
    "zero_functional.core.partition": (
        "BalanceReport",
        "FlatPartition",
        "Piece",
        "balance_report",
        "flat",
        "owners",
        "sorted_greedy",
        "sorted_greedy_groups",
    ),
    "zero_functional.core.sharded": ("ShardState", "shard_init", "shard_update"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_HOME)
__version__ = "0.1.0"

_MOVED: dict[str, str] = {
    "zero_functional._validate": "zero_functional.core._validate",
    "zero_functional.agreement": "zero_functional.shell.agreement",
    "zero_functional.amp": "zero_functional.shell.amp",
    "zero_functional.atomic_dir": "zero_functional.checkpoint.atomic_dir",
    "zero_functional.buckets": "zero_functional.core.layout",
    "zero_functional.checkpoint_format": "zero_functional.checkpoint.format",
    "zero_functional.checks": "zero_functional.core.checks",
    "zero_functional.cli": "zero_functional.app.cli",
    "zero_functional.collectives": "zero_functional.core.plans",
    "zero_functional.grad_norm": "zero_functional.core.grad_norm",
    "zero_functional.join": "zero_functional.shell.join",
    "zero_functional.launch": "zero_functional.app.launch",
    "zero_functional.local_shard": "zero_functional.shell.local_shard",
    "zero_functional.main_params": "zero_functional.core.main_params",
    "zero_functional.models": "zero_functional.app.models",
    "zero_functional.overlap": "zero_functional.shell.overlap",
    "zero_functional.ownership": "zero_functional.core.ownership",
    "zero_functional.param_table": "zero_functional.core.param_table",
    "zero_functional.partition": "zero_functional.core.partition",
    "zero_functional.plan_format": "zero_functional.app.plan_format",
    "zero_functional.plans": "zero_functional.core.plans",
    "zero_functional.sharded": "zero_functional.core.sharded",
    "zero_functional.simulate": "zero_functional.app.simulate",
    "zero_functional.state_dict": "zero_functional.core.piece_state",
    "zero_functional.steppers": "zero_functional.shell.steppers",
    "zero_functional.storage": "zero_functional.checkpoint.storage",
    "zero_functional.testing": "zero_functional.comm.testing",
    "zero_functional.train": "zero_functional.app.train",
    "zero_functional.train_checkpoint": "zero_functional.app.train",
}
"""The module paths before the folders of issue 29, and where each module lives now: an old
path imports the very module object of the new one (``import zero_functional.ownership``, ``from
zero_functional.launch import run_ranks``, ``monkeypatch.setattr("zero_functional.plans.x", ...)``
all keep working)."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`_MOVED` and hands back the module at its new path."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        """The module ran at its new path already."""


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use of the name.

    Example:
        >>> import zero_functional
        >>> zero_functional.flat([6, 3], 2).bounds
        ((0, 5), (5, 9))
    """
    if f"zero_functional.{name}" in _MOVED:  # a module at its old path
        return importlib.import_module(f"zero_functional.{name}")
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'zero_functional' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
