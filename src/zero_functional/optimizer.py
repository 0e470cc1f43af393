"""ZeroRedundancyOptimizer: the drop-in facade over one ownership, a local shard and its syncs.

It holds ``state`` and ``param_groups`` as torch's optimizer does and writes the step's loop
itself: per unit of each bucket sync, update this rank's pieces, then start the unit's gather.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch

# imported here, not by torch.optim.Optimizer under our __init__: that import leaves a cycle
# holding every frame on the stack, so this optimizer and its group past destroy_process_group
import torch._dynamo  # noqa: F401
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from zero_functional import comm
from zero_functional.core.checks import check_new_group, warn_ignored_bucket_view
from zero_functional.core.classes import param_blocks
from zero_functional.core.consolidation import PARTIAL_KEY, not_consolidated_message
from zero_functional.core.grad_norm import clip_, local_norm, total_norm
from zero_functional.core.load_checks import validated_state
from zero_functional.core.ownership import Ownership, PartitionName, Transfer
from zero_functional.core.param_table import ParamTable
from zero_functional.core.partition import Piece
from zero_functional.core.plans import (
    choose_collectives,
    overlap_ownership,
    ownership_of,
    reshard_rounds,
)
from zero_functional.functional import functional_spec, supports_group
from zero_functional.shell.agreement import agree, agreed_inputs, check_averaged
from zero_functional.shell.amp import refuse_scaler_step
from zero_functional.shell.bucket_sync import step_syncs
from zero_functional.shell.classes import add_group, pinned_owners
from zero_functional.shell.local_shard import LocalShard, RemainderTies, Resharded, Stepped, Updated
from zero_functional.shell.param_window import ParamWindow
from zero_functional.shell.steppers import LocalView, Stepper, choose_stepper, state_schemas

__all__ = ["PARTIAL_KEY", "ZeroRedundancyOptimizer", "not_consolidated_message"]

logger = logging.getLogger(__name__)

StateDict = dict[str, Any]


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Shards any ``torch.optim`` optimizer's state, and its update, across a process group.

    Args:
        optimizer_class: Any ``torch.optim.Optimizer`` subclass (SGD, Adam and AdamW run the
            functional core, others as real instances).
        parameters_as_bucket_view: Parameters become views into one buffer per owner
            (``"sorted_greedy"``) or per (device, dtype) (``"flat"``), gathered in place.
        overlap_with_ddp: The step runs inside DDP's backward (:mod:`zero_functional.hooks`).
        partition: ``"sorted_greedy"`` (torch's: whole tensors, largest first to the least loaded
            rank) or ``"flat"`` (each (device, dtype) group, or DDP bucket, split evenly).
        overlap_param_gather: Opt-in: return once the all-gather has started; the model's next
            call waits for it (:mod:`zero_functional.shell.param_window`).
        compile: ``torch.compile`` the functional core: where faster (``None``), always, never.
        main_params_dtype: Step bf16/fp16 parameters through fp32 copies of the owned pieces.
        gather_dtype: The all-gather carries each piece's change (main copy - parameter) in this
            format (:mod:`~zero_functional.comm.codec`), which every rank adds: parameters equal
            everywhere, within half a quantum of the owner's fp32 main copy (implied).
        store_param_remainders: Keep bf16 parameters' fp32 main copies as int16 remainders.
        device_mesh: Instead of ``process_group``, a 2-D mesh named ``("replicate", "shard")``.
        timeout: Seconds any collective may wait (default: the group's).

    Attributes:
        shard: This rank's pieces, their state and their update (a ``LocalShard``).
        param_table: The parameters in global index order, with their groups and buffer keys.
        param_window: The parameter all-gathers in flight, and who waits for them.
        collectives: The strategy of this optimizer's buffers, chosen once from its group.
        replicate_group: Under a device mesh, the group the shards are replicated over.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> zero = ZeroRedundancyOptimizer([w], torch.optim.SGD, lr=0.5)  # on every rank
        >>> w.grad = torch.ones(2)
        >>> zero.step()
        >>> w.tolist()
        [0.5, 0.5]
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        process_group: comm.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        partition: PartitionName = "sorted_greedy",
        timeout: float | None = None,
        overlap_param_gather: bool | None = None,
        compile: bool | None = None,
        main_params_dtype: torch.dtype | None = None,
        store_param_remainders: bool = False,
        device_mesh: Any = None,
        gather_dtype: torch.dtype | None = None,
        **defaults: Any,
    ) -> None:
        self._initialized = False
        process_group, self.replicate_group = comm.sharding_groups(process_group, device_mesh)
        self.timeout = timeout
        self.partition: PartitionName = partition
        args = (params, optimizer_class, process_group, partition, overlap_with_ddp, defaults)
        main = (main_params_dtype, store_param_remainders, gather_dtype)
        self.process_group, items, probe = agreed_inputs(*args, timeout, *main)
        self.gather_dtype = gather_dtype
        if gather_dtype is not None and main_params_dtype is None:
            main_params_dtype = torch.float32  # the owners' main copies the changes come from
        self.main_params_dtype = main_params_dtype
        self.world_size = comm.group_size(self.process_group)
        self.rank = comm.group_rank(self.process_group)
        self.global_rank = comm.global_rank(self.process_group, self.rank)
        self.optimizer_class = optimizer_class
        self._user_defaults = dict(defaults)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.overlap_with_ddp = overlap_with_ddp
        self.overlap_param_gather = bool(overlap_param_gather)  # off by default: param_window.py
        Optimizer.__init__(self, items, dict(probe.defaults))
        Joinable.__init__(self)
        self.param_table = ParamTable.of(self.param_groups)
        # not the bound self._call, which would make a cycle through this optimizer
        call = functools.partial(comm.call, group=self.process_group, timeout=self.timeout)
        self.param_window = ParamWindow(self.param_table, call, self.overlap_param_gather)
        backend = comm.backend(self.process_group)
        self.collectives = choose_collectives(backend, self.world_size, even=True)
        gather_codec = comm.check_wire_dtype(gather_dtype) if self.world_size > 1 else None
        self._wire = comm.Wire(self.process_group, gather_codec=gather_codec)
        self._default_device: torch.device = self.param_table.params[0].device
        spec = functional_spec(optimizer_class)
        spec = spec if spec and all(supports_group(spec, g) for g in self.param_groups) else None
        warn_ignored_bucket_view(overlap_with_ddp, parameters_as_bucket_view)
        self._spec = spec
        self._stepper_for = functools.partial(choose_stepper, spec, compile, probe)
        ownership = self.ownership_of()
        self.shard = LocalShard(
            ownership,
            self.rank,
            self.param_table,
            self.param_groups,
            self.state,
            self._stepper(ownership),
            optimizer_class.__name__,
            main_params_dtype,
            RemainderTies() if store_param_remainders else None,
            changes_gathered=gather_codec is not None,
        )
        self._build_buffers()
        self._initialized = True

    @property
    def shard_group(self) -> comm.ProcessGroup:
        """The group the state is sharded over (``process_group``; a mesh's ``"shard"``)."""
        return self.process_group

    @property
    def gather_codec(self) -> comm.Codec | None:
        """The format parameters' changes cross in (``gather_dtype``; ``None`` at one rank)."""
        return self._wire.gather_codec

    @property
    def remainder_ties(self) -> int:
        """With ``store_param_remainders``: the bf16 elements this rank wrote that differ from
        ``main.to(torch.bfloat16)`` (exact ties, rounded away from zero); else 0."""
        ties = self.shard.remainders
        return 0 if ties is None else ties.total()

    @property
    def ownership(self) -> Ownership:
        """Which rank owns which pieces of which parameters (global indices, state-dict order)."""
        return self.shard.ownership

    def _stepper(self, ownership: Ownership) -> Stepper:
        """How this rank steps its pieces under ``ownership``."""
        owned = {s.param for s in ownership.owned(self.rank)}
        whole = ownership.is_whole and not self.overlap_with_ddp and self.main_params_dtype is None
        return self._stepper_for(whole, self.param_groups, owned, self.state, self._user_defaults)

    def ownership_of(
        self, buckets: Sequence[Sequence[int]] | None = None, *, shard_buckets: bool = False
    ) -> Ownership:
        """The ownership ``partition`` gives: after backward, or (overlap mode) of DDP's buckets."""
        table, world = self.param_table, self.world_size
        pinned = pinned_owners(self.param_groups, self.optimizer_class, table, world)
        blocks = param_blocks(self.param_groups, self.optimizer_class, self._user_defaults)
        if buckets is None:
            return ownership_of(self.partition, table, world, pinned, blocks)
        return overlap_ownership(
            buckets, self.partition, table, world, shard_buckets, pinned, blocks
        )

    def reshard(self, ownership: Ownership) -> None:
        """Move the state to ``ownership`` (same parameters and world size); collective. In the
        rounds of :func:`~.plans.reshard_rounds`, each round's old state dropped as it moves."""
        old, group = self.ownership, self.process_group
        rounds = reshard_rounds(old, ownership, self.rank)  # validates before anything changes
        self.shard.hooks.before()
        with self._call("reshard()"):
            device = self._collective_device()
            for plan in rounds:
                parts = self.shard.outgoing(plan, old)
                arrived = parts.pop(self.rank, {})
                for got in comm.exchange_objects(parts, plan.pairs, group, device).values():
                    arrived.update(cast(dict[Transfer, dict[str, Any]], got))
                self.shard.incoming(plan, ownership, arrived)
        self.shard.adopt(ownership, self._stepper(ownership))  # pieces and stepper: then syncs
        self._build_buffers()
        self.shard.hooks.resharded(old)

    def _build_buffers(self) -> None:
        bucket_view = self.parameters_as_bucket_view and not self.overlap_with_ddp
        args = (self.param_table, self.ownership, self.rank, self._wire, self.collectives)
        self._syncs = step_syncs(*args, self.param_window, bucket_view, self.changes())

    def changes(self) -> Callable[[Iterable[int]], Mapping[int, Tensor]] | None:
        """Where parameters' changes are gathered (``gather_dtype``): the owned main copies.

        Example:
            >>> w = torch.ones(2, requires_grad=True)
            >>> zero = ZeroRedundancyOptimizer([w], torch.optim.SGD, gather_dtype=torch.int8)
            >>> zero.changes() is None  # one rank: nothing crosses, the update writes w
            True
        """
        return self.shard.values if self.shard.changes_gathered else None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group and reshard to the new ownership; collective."""
        if not getattr(self, "_initialized", False):
            add_group(super().add_param_group, self.param_groups, param_group, self.optimizer_class)
            return
        if self.overlap_with_ddp:
            raise RuntimeError(
                "ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single parameter "
                "group; build it with all parameters instead of calling add_param_group"
            )
        backend, items = comm.backend(self.process_group), [*self.param_groups, param_group]
        modes = (self.optimizer_class, len(self.param_groups))
        check = lambda: check_new_group(param_group, backend, self.partition, *modes)  # noqa: E731
        agree("add_param_group()", check, items, self.process_group, timeout=self.timeout)
        add_group(super().add_param_group, self.param_groups, param_group, self.optimizer_class)
        self.param_table = ParamTable.of(self.param_groups)
        self.param_window.set_params(self.param_table)
        new = self.ownership_of()
        # from the old pieces, grown to the new parameters: only what changes owner moves
        self.shard.extend(self.ownership.extended(new), self.param_table)
        self.reshard(new)

    def _call(self, name: str) -> AbstractContextManager[None]:
        """The context that names this optimizer's collectives when they fail (comm.call)."""
        return comm.call(name, self.process_group, timeout=self.timeout)

    def _collective_device(self) -> torch.device:
        return comm.collective_device(self.process_group, self._default_device)

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Update this rank's pieces, then sync every piece to every rank; the closure's loss."""
        if self.overlap_with_ddp:
            refuse_scaler_step(self, kwargs)
            logger.warning(
                "step() should not be included in the training loop when overlap_with_ddp=True"
            )
            return None
        self.shard.check_updates()  # refused (inside ShardedEMA.swapped_into): before anything
        Join.notify_join_context(self)
        self.finish_param_sync()
        if self.check_trainable():
            self._build_buffers()
        self.shard.book.changed()
        found = getattr(self, "found_inf", None)  # scaler.step(self)'s verdict, with main copies
        if found is not None and float(found) > 0:  # non-finite on a rank: no change anywhere
            return None
        grad_scale = getattr(self, "grad_scale", None)  # the scale the gradients still carry
        loss, grads = self.shard.local_step(closure, grad_scale, **kwargs)
        todo = dict(grads or {})  # none: a real optimizer stepped its whole parameters
        with self._call("step()"):
            for sync in self._syncs:  # each unit updated just before it is sent
                for unit in sync.units:
                    if self.rank in unit.senders:
                        mine = {k: todo.pop(k) for k in unit.indices if k in todo}
                        if mine:
                            self.shard.update(mine)
                    sync.start_params(unit)
            if todo:  # owned pieces of frozen parameters (not sent), or a world of one
                self.shard.update(todo)
            for sync in self._syncs:
                sync.finish_params()
        self.shard.hooks.stepped()
        return loss

    def gather_params(self) -> None:
        """``step()``'s all-gather without an update (the owners' values, exact, where
        ``gather_dtype`` would send changes); collective, waited for."""
        self.finish_param_sync()
        with self._call("gather_params()"):
            for sync in self._syncs:
                sync.start_params(values=True)
                sync.finish_params()
            self.finish_param_sync()

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # compat: GradScaler.step(opt) then hands us its verdict: overlap mode refuses (the step
        # ran in backward); main copies unscale in their dtype (GradScaler refuses fp16 grads)
        return self.overlap_with_ddp or self.main_params_dtype is not None

    def check_trainable(self) -> bool:
        """Whether any ``requires_grad`` changed since the ownership was built (checked)."""
        changed = self.shard.check_trainable(self.overlap_with_ddp)
        grads, params = self.shard.unchecked_grads(), self.param_table.params
        check_averaged(grads, params, self.process_group, self.timeout)
        self.shard.averaged(grads)
        return changed

    def update_owned(self, grads: Mapping[int, Tensor]) -> None:
        """Update this rank's pieces with ``grads`` (global index -> the piece's gradient)."""
        self.shard.pieces_stepper()  # one that runs on whole parameters raises here, first
        self.finish_param_sync()
        self.shard.update(grads)

    def register_update_hook(
        self, updated: Updated, resharded: Resharded | None = None, stepped: Stepped | None = None
    ) -> RemovableHandle:
        """Run ``updated(values)`` after each update, ``resharded(old)`` after each reshard and
        ``stepped()`` once each step that updated has ended (in overlap mode, its backward)."""
        return self.shard.hooks.register(updated, resharded, stepped)

    def register_pre_update_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Run ``hook()`` before this rank's pieces, their state or the parameters next change
        (an update, a load, a reshard, a gather of other values into the parameters); the
        handle removes it. A snapshot holds them still this way until it has copied them.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
            >>> handle = zero.register_pre_update_hook(lambda: print("before the update"))
            >>> model(torch.ones(1, 2)).sum().backward(); zero.step()
            before the update
            >>> handle.remove()
        """
        return self.shard.hooks.register_before(hook)

    def finish_param_sync(self) -> None:
        """Wait for the all-gathers ``overlap_param_gather`` left in flight."""
        self.param_window.finish()

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` from the norms of owned pieces; collective."""
        grads = [p.grad for p in self.param_table.params if p.grad is not None]
        pieces = list(self.shard.grads().values())
        local = local_norm(grads, pieces, norm_type, self._default_device)
        with self._call("clip_grad_norm_()"):
            ranks = comm.all_gather_scalar(local, self.process_group)
        total = total_norm(ranks, norm_type, error_if_nonfinite)
        clip_([*grads, *self.shard.reduced.values()], total, max_norm)
        self.shard.round_reduced()
        return total

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that lets ``Join([ddp, zero])`` train on uneven inputs (not in overlap mode)."""
        if self.overlap_with_ddp:
            raise RuntimeError(
                "Join does not work with overlap_with_ddp=True: the step runs inside DDP's "
                "backward, which a rank that ran out of inputs no longer runs, so the ranks' "
                "parameters would differ. For uneven inputs, step after backward "
                "(overlap_with_ddp=False, optionally with reduce_scatter_hook), or give every "
                "rank the same number of batches"
            )
        return StepJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the first parameter."""
        return self._default_device

    @property
    def join_process_group(self) -> comm.ProcessGroup:
        """The group this optimizer shards over; under a device mesh, the world (as Join needs)."""
        return self.process_group if self.replicate_group is None else comm.default_group(None)

    @property
    def optim(self) -> Optimizer | LocalView:
        """This rank's share, as torch's attribute of that name shows it."""
        return self.shard.local_view()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's state on rank ``to`` (one shard at a time); collective."""
        with self._call(f"consolidate_state_dict(to={to})"):
            shard = {"state": self.shard.cpu_shard()}
            gathered = comm.gather_objects(shard, to, self.process_group, self._collective_device())
        self.shard.book.gathered([cast(StateDict, x)["state"] for x in gathered or []])

    def state_dict(self) -> StateDict:
        """torch's format, full on rank ``to`` after ``consolidate_state_dict(to)``; local."""
        return self.shard.book.state_dict(self.shard.saved_groups(), self.rank)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load this rank's pieces of a whole state dict (ours or ``torch.optim``'s); local."""
        if isinstance(state_dict, Mapping) and state_dict.get(PARTIAL_KEY):
            raise ValueError(
                "this state dict is partial: it comes from a rank's state_dict() after "
                "consolidate_state_dict(to=...) sent the state to another rank, so it holds no "
                "optimizer state; load the dict that rank `to` saved instead"
            )
        state = validated_state(state_dict, self.param_groups, self._schemas())
        self.shard.install(self.shard.cut(state), state_dict["param_groups"], copy=False)
        if state:
            self.shard.book.changed()

    def main_params(self) -> dict[Tensor, Tensor]:
        """This rank's main copies of its pieces, keyed by parameter (read-only)."""
        return self.shard.main_params()

    def shard_state(self) -> dict[int, tuple[Piece, dict[str, Any]]]:
        """This rank's state, as a sharded checkpoint writes it: global index -> (piece, state)."""
        return self.shard.shard_state()

    def load_shard_state(
        self,
        state: Mapping[int, Mapping[str, Any]],
        param_groups: Sequence[Mapping[str, Any]],
        *,
        copy: bool = True,
    ) -> None:
        """Install this rank's pieces' state (as :meth:`shard_state` gives it) and the groups'
        hyperparameters, checked first; collective. ``copy=False``: keep tensors that fit."""
        check = lambda: self.shard.check(state, param_groups, self._schemas())  # noqa: E731
        group, errors = self.process_group, (TypeError, ValueError)
        agree("load_shard_state()", check, self.param_groups, group, self.timeout, errors)
        self.shard.warn_without_main(state)
        self.shard.hooks.before()
        self.shard.install(state, param_groups, copy=copy)
        self.shard.book.changed()

    def _schemas(self) -> list[dict[str, str] | None]:
        return state_schemas(self.optimizer_class, self.param_groups, self._user_defaults)

    def __repr__(self) -> str:
        return (
            f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank}/"
            f"{self.world_size}, partition={self.partition!r}, {len(self.param_groups)} groups, "
            f"functional={self._spec is not None})"
        )


class StepJoinHook(JoinHook):
    """``Join([ddp, zero])``'s hook on a rank that ran out of inputs: it shadows one ``step()``,
    and so its collectives, per iteration of the others.

    Example:
        >>> zero = ZeroRedundancyOptimizer([torch.ones(1, requires_grad=True)], torch.optim.SGD)
        >>> StepJoinHook(zero).main_hook()  # a step without gradients: the collectives only
    """

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        """Shadow one ``step()``."""
        self.zero.step()
