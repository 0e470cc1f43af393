"""A model and its ZeRO optimizer as one ``torch.distributed.checkpoint`` ``Stateful``
(torchtitan's style): DCP writes each rank's pieces of the state, as ``ShardedTensor`` s, and
reshards them at load, at any world size and under either partition."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharded_tensor.shard import Shard
from torch.optim import Optimizer

from zero_functional import comm
from zero_functional.checkpoint.format import check_groups
from zero_functional.checkpoint.source import Source, source
from zero_functional.checkpoint.storage import box_views
from zero_functional.core.param_table import module_of
from zero_functional.core.piece_state import is_elementwise
from zero_functional.ema import MODULE_PREFIX, N_AVERAGED_KEY, ShardedEMA
from zero_functional.functional import update_kind
from zero_functional.optimizer import ZeroRedundancyOptimizer
from zero_functional.shell.steppers import hyperparameters, probe_state


def _sharded(src: Source, k: int, local: Tensor) -> ShardedTensor:
    """``local`` (this rank's flat piece of parameter ``k``, or of a tensor of its shape) as a
    ShardedTensor whose shards are the row-major boxes of every holder's piece: what DCP writes
    and reshards."""
    assert src.ownership is not None
    shape, device, me = src.table.params[k].shape, str(local.device), comm.rank_or_zero(src.group)
    metas: list[ShardMetadata] = []
    shards: list[Shard] = []
    for rank, piece in src.ownership.holders(k):
        placement = f"rank:{comm.global_rank(comm.default_group(src.group), rank)}/{device}"
        mine = rank == me
        # another rank's piece: only its boxes (a meta tensor has no memory)
        flat = local if mine else torch.empty(piece.numel, dtype=local.dtype, device="meta")
        for (offsets, sizes), view in box_views(shape, piece.start, piece.stop, flat):
            metas.append(ShardMetadata(list(offsets), list(sizes), placement))
            if mine:
                shards.append(Shard(view, metas[-1]))
    properties = TensorProperties(dtype=local.dtype, pin_memory=local.is_pinned())
    metadata = ShardedTensorMetadata(metas, shape, properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=src.group
    )


def _piece_of(value: ShardedTensor) -> Tensor:
    """This rank's shards of ``value``, concatenated: its piece, flat."""
    return torch.cat([s.tensor.reshape(-1) for s in value.local_shards()])


class ZeroStateful:
    """A model and its :class:`~zero_functional.optimizer.ZeroRedundancyOptimizer` as one
    ``torch.distributed.checkpoint`` ``Stateful``; made by :func:`stateful`.

    ``state_dict()`` has the layout of torch's
    ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``::

        {"model": model.state_dict(),          # replicated: DCP writes each tensor once
         "optimizer": {"state": {name: {"exp_avg": ShardedTensor, "step": tensor, ...}},
                       "param_groups": [{"lr": ..., "params": [name, ...]}, ...]}}

    An elementwise value is a ``ShardedTensor`` in its parameter's shape whose local shards
    are this rank's pieces (row-major boxes): each element is written once, by its owner, and
    read into the loading rank's pieces. Before the first step the template is the keys one
    step of the group's class makes, as zeros (``step`` 0), which load as a fresh optimizer's.
    ``dcp.load`` writes into the model and the state given; :meth:`load_state_dict` installs that.
    """

    def __init__(
        self, model: nn.Module, optimizer: ZeroRedundancyOptimizer, ema: ShardedEMA | None = None
    ) -> None:
        src = source(optimizer) if isinstance(optimizer, Optimizer) else None
        if src is None or src.ownership is None:
            raise TypeError(
                f"stateful() takes a zero_functional ZeroRedundancyOptimizer, got "
                f"{type(optimizer).__name__}: for a plain torch.optim optimizer use "
                "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)"
            )
        if src.replicate_group is not None:  # every replica would offer the same shards
            raise ValueError(
                "stateful() does not take an optimizer sharded over a device_mesh yet: its "
                "replicas would each write the same shards; use zero_functional.checkpoint."
                "save/load, which the first replica writes and every rank reads"
            )
        if ema is not None and ema.optimizer is not optimizer:
            raise ValueError("stateful(ema=...) takes the ShardedEMA of the optimizer it is given")
        if (blockwise := src.blockwise()) is not None:  # DCP would cut its codes in the shape
            raise ValueError(
                f"stateful() does not take an optimizer whose state is block-wise quantized "
                f"({blockwise}): use zero_functional.checkpoint.save/load, which store its "
                "codes and scales on its blocks and reshard them at any world size"
            )
        self.model, self.optimizer, self.ema = model, optimizer, ema
        self._names = src.names(model)  # checks that the parameters are the model's
        self._flat: dict[tuple[str, str], tuple[ShardedTensor, Tensor]] = {}

    def state_dict(self) -> dict[str, Any]:
        """The model's state and the optimizer's groups and this rank's state; no copies."""
        src = source(self.optimizer)
        src.finish()  # the model's parameters are read (or written) next
        out = {
            "model": module_of(self.model).state_dict(),
            "optimizer": {
                "state": self._optimizer_state(src),
                "param_groups": [
                    {**hyperparameters(g), "params": names}
                    for g, names in zip(src.optimizer.param_groups, src.group_names(self._names))
                ],
            },
        }
        if self.ema is not None:  # in AveragedModel's layout, each average sharded
            averages: dict[str, Any] = {
                MODULE_PREFIX + self._names[k]: _sharded(src, k, flat)
                for k, flat in self.ema.pieces.items()
            }
            averages[N_AVERAGED_KEY] = torch.tensor(self.ema.n_averaged(), dtype=torch.long)
            out["ema"] = averages
        return out

    def _optimizer_state(self, src: Source) -> dict[str, dict[str, Any]]:
        held = src.state()
        probes: dict[tuple[int, tuple[int, ...]], Any] = {}
        self._flat = {}
        out: dict[str, dict[str, Any]] = {}
        for k, piece in src.pieces.items():
            p = src.table.params[k]
            values, fresh, probed = held.get(k), k not in held, piece.numel
            if fresh and p.requires_grad:  # not stepped yet: the keys one step makes, as zeros
                g = src.table.group_of(k)
                cls = src.classes[g]  # a per-tensor class (Muon) is probed in the whole shape
                shape = (2,) if update_kind(cls) == "elementwise" else tuple(p.shape)
                if (g, shape) not in probes:
                    probes[g, shape] = probe_state(cls, src.optimizer.param_groups[g], {}, shape)
                values, probed = probes[g, shape], math.prod(shape)
            if values is None:
                continue
            entry: dict[str, Any] = {}
            for key, v in values.items():
                if isinstance(v, Tensor) and is_elementwise(v, probed):
                    if fresh:
                        dtype = p.dtype if v.is_floating_point() or v.is_complex() else v.dtype
                        flat = torch.zeros(piece.numel, dtype=dtype, device=p.device)
                    else:
                        flat = v.detach().reshape(-1)
                    self._flat[self._names[k], key] = (_sharded(src, k, flat), flat)
                    entry[key] = self._flat[self._names[k], key][0]
                elif isinstance(v, Tensor):
                    entry[key] = torch.zeros_like(v) if fresh else v
                else:
                    entry[key] = None if fresh else v
            out[self._names[k]] = entry
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Install what ``dcp.load`` read into :meth:`state_dict`'s dict, on every rank; a
        :class:`CheckpointError` if its groups list other parameters (another model)."""
        src = source(self.optimizer)
        module_of(self.model).load_state_dict(state_dict["model"])
        saved = state_dict["optimizer"]
        groups = check_groups(saved["param_groups"], src.group_names(self._names))
        index = {name: k for k, name in enumerate(self._names)}
        state: dict[int, dict[str, Any]] = {}
        for name, entry in saved["state"].items():
            k = index[name]
            piece, p = src.pieces[k], src.table.params[k]
            values = state[k] = dict(entry)
            for key, v in entry.items():
                if isinstance(v, ShardedTensor):
                    made = self._flat.get((name, key))
                    # the buffer DCP read into, through the shards' views
                    flat = made[1] if made is not None and made[0] is v else _piece_of(v)
                    values[key] = flat.view(p.shape) if piece.is_whole else flat
        self._flat = {}
        src.install(state, groups)
        if self.ema is not None:
            saved_ema = state_dict["ema"]
            averages = {
                index[key[len(MODULE_PREFIX) :]]: _piece_of(v)
                for key, v in saved_ema.items()
                if isinstance(v, ShardedTensor)
            }
            self.ema.load_pieces(averages, int(saved_ema[N_AVERAGED_KEY]))


def stateful(
    model: nn.Module, optimizer: ZeroRedundancyOptimizer, ema: ShardedEMA | None = None
) -> ZeroStateful:
    """A ``torch.distributed.checkpoint`` ``Stateful`` of ``model`` (or the DDP around it) and
    its ZeRO ``optimizer`` (:class:`ZeroStateful`), with its ``ema`` under ``"ema"`` in
    ``AveragedModel``'s layout; ``dcp.save``/``dcp.load`` it on every rank.

    Raises:
        TypeError: ``optimizer`` is not a ZeroRedundancyOptimizer.
        ValueError: It is sharded over a ``device_mesh``, or a class of its quantizes its state
            in blocks (torchao's low-bit AdamWs): use :func:`~zero_functional.checkpoint.save`.
        CheckpointError: Its parameters are not the model's.

    Example:
        >>> import tempfile, torch.distributed.checkpoint as dcp, zero_functional as zf
        >>> model = torch.nn.Linear(2, 1)
        >>> zero = zf.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam)
        >>> _ = dcp.save({"app": stateful(model, zero)}, checkpoint_id=tempfile.mkdtemp())
    """
    return ZeroStateful(model, optimizer, ema)
