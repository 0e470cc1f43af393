"""ZeroRedundancyOptimizer: the thin stateful shell over the pure core.

A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``. Which rank owns what is one
value, an :class:`~zero_functional.ownership.Ownership`, built by the pure core from the
``partition`` option (``"sorted_greedy"``, torch's whole-tensor assignment and the default; or
``"flat"``, an even split in which a parameter may straddle ranks) or, in overlap mode, from
DDP's buckets. The shell holds exactly one; :meth:`ZeroRedundancyOptimizer.reshard` is the only
code that moves state when it changes. SGD, Adam and AdamW run the functional core directly
(fused kernels where torch has them); any other ``torch.optim`` class runs as a real instance of
that class over this rank's parameters or pieces (:mod:`zero_functional.steppers`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from zero_functional import comm
from zero_functional._validate import prefix_sums
from zero_functional.buckets import bucket_layout, views
from zero_functional.checks import (
    check_devices,
    check_hyperparameter_types,
    check_params,
    check_update_kind,
    fingerprint,
    param_tensors,
)
from zero_functional.collectives import buffer_runs, choose_collectives, choose_param_gather
from zero_functional.functional import (
    functional_spec,
    group_indices,
    supports_group,
    update_kind,
)
from zero_functional.ownership import (
    Ownership,
    PartitionName,
    Run,
    check_partition,
    check_splittable,
    flat_ownership,
    piece_view,
    sorted_greedy_ownership,
)
from zero_functional.param_sync import ParamSync
from zero_functional.partition import Segment
from zero_functional.state_dict import (
    check_hyperparameters,
    check_param_state,
    join_states,
    slice_state,
    validated_state,
)
from zero_functional.steppers import (
    FunctionalStepper,
    RealStepper,
    ShadowStepper,
    Stepper,
    hyperparameters,
    state_schema,
)

__all__ = ["PARTIAL_KEY", "ZeroRedundancyOptimizer", "not_consolidated_message"]

logger = logging.getLogger(__name__)

StateDict = dict[str, Any]

FLAT_ALIGN_BYTES = 16
"""Under ``partition="flat"`` range bounds fall on multiples of 16 bytes (4 fp32 elements), so
every shard starts where vectorised kernels and NCCL like it."""


PARTIAL_KEY = "zero_partial"
"""The key that marks a rank's :meth:`ZeroRedundancyOptimizer.state_dict` after consolidation
onto another rank: full ``param_groups``, no state; ``load_state_dict`` refuses it."""


def not_consolidated_message(rank: int) -> str:
    """What ``state_dict()`` says when the state changed since the last consolidation: torch's
    words, then the fix for the training framework in use (judged by what is imported).

    Example:
        >>> not_consolidated_message(1).startswith(
        ...     "Optimizer state has not been consolidated on this rank")
        True
    """
    message = (
        "Optimizer state has not been consolidated on this rank. Please call "
        f"`consolidate_state_dict(to={rank})` on all ranks beforehand if you meant to save the "
        "global state (after the last step: every step changes the state)."
    )
    if "transformers.trainer" in sys.modules:
        message += (
            " With the Transformers Trainer, pass "
            "callbacks=[zero_functional.integrations.ZeroTrainerCallback()], which "
            "consolidates on every rank before each save."
        )
    elif "accelerate" in sys.modules:
        message += (
            " With Accelerate, call zero_functional.integrations.accelerate.register("
            "accelerator, optimizer) once after prepare(): save_state then consolidates on "
            "every rank first."
        )
    else:
        message += (
            " Lightning and Fabric consolidate by themselves; for torch.distributed.checkpoint "
            "use zero_functional.checkpoint.stateful(model, optimizer)."
        )
    return message


class _ZeroJoinHook(JoinHook):
    """Shadows the step's collectives on a rank that has run out of inputs."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


@dataclass
class _Buffer:
    """A bucket view: ``params`` alias ``tensor``; ``runs`` say who broadcasts which part."""

    tensor: Tensor
    runs: tuple[Run, ...]
    chunk: int | None  # the even shard size when reduce_scatter/all_gather can take it
    params: list[Tensor]


class LocalView:
    """torch's ``optim`` attribute: this rank's share as a local optimizer would show it.

    ``param_groups`` hold, per group, the hyperparameters and the parameters this rank owns
    (all or part of); ``state`` is this rank's state. For an optimizer class that runs as a
    real instance over whole parameters, ``ZeroRedundancyOptimizer.optim`` is that instance.
    """

    def __init__(self, param_groups: list[dict[str, Any]], state: Mapping[Tensor, Any]) -> None:
        self.param_groups = param_groups
        self.state = state


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Shards any ``torch.optim`` optimizer's state across the ranks of a process group.

    Each rank owns what the ownership value gives it, keeps optimizer state for that only,
    updates it, then every rank receives every other rank's updated parameters.

    Args:
        params: Tensors or parameter-group dicts, as ``torch.optim`` accepts.
        optimizer_class: Any ``torch.optim.Optimizer`` subclass; SGD, Adam and AdamW run the
            functional core (fused kernels where torch has them), others as real instances.
        process_group: The group to shard over (default: the world).
        parameters_as_bucket_view: Make parameters views into one contiguous buffer per
            owner (``"sorted_greedy"``) or per (device, dtype) (``"flat"``), so the parameter
            sync moves buffers without copies.
        overlap_with_ddp: Run the step inside DDP's backward through a hook from
            :mod:`zero_functional.hooks`; ``step()`` then only warns.
        partition: ``"sorted_greedy"`` (torch's: whole tensors, largest first to the least
            loaded rank) or ``"flat"`` (each (device, dtype) group, and in overlap mode each
            DDP bucket, split into ``world_size`` even ranges; a parameter may straddle ranks;
            needs an elementwise optimizer, see
            :data:`~zero_functional.functional.OPTIMIZER_KINDS`).
        overlap_param_gather: Opt-in (Megatron-LM's option of that name): let ``step()`` (or,
            in overlap mode, backward) return once the all-gather of the updated parameters
            has started; each module's next forward waits for its own parameters,
            ``module.state_dict()`` and this package's readers finish it first, and a
            parameter read elsewhere before :meth:`finish_param_sync` is an error that names
            it (:mod:`zero_functional.param_sync`). Default
            (:func:`~zero_functional.collectives.choose_param_gather`): off in every mode,
            torch's contract: parameters are final when ``step()`` (overlap mode: backward)
            returns.
        compile: Run SGD, Adam and AdamW through ``torch.compile`` (one graph per group):
            ``None`` (default) only where it measures faster than the eager kernels (nowhere
            on CPU, where torch's fused Adam wins; see ``benchmarks/bench_kernels.py``),
            ``True`` wherever it applies (eager, with one warning, where compiling fails),
            ``False`` never.
        timeout: Seconds any collective of this optimizer may wait (default: the process
            group's timeout). A collective that fails or times out raises
            :class:`~zero_functional.comm.CollectiveError` naming the call, this rank and what
            the other ranks were doing.
        **defaults: Hyperparameters for ``optimizer_class``.

    Example:
        >>> # under torch.distributed, on every rank:
        >>> # zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        >>> # loss.backward(); zero.step()
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
        **defaults: Any,
    ) -> None:
        self._initialized = False
        self.timeout = timeout
        self._compile = compile
        # Every check is local; its verdict, and each rank's fingerprint, are then exchanged so
        # that a problem on one rank is an error on every rank rather than a hang on the others.
        problem: Exception | None = None
        items: list[Any] = []
        try:
            items = check_params(params)
            if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
                raise TypeError(
                    "optimizer_class must be a torch.optim.Optimizer subclass, got "
                    f"{optimizer_class!r}"
                )
            self.partition: PartitionName = check_partition(partition)
            check_update_kind(optimizer_class, self.partition, overlap_with_ddp)
            check_hyperparameter_types(optimizer_class, defaults)
            if self.partition == "flat":
                check_splittable(param_tensors(items))
            # The class's full defaults (betas, eps, ...), validated with torch's own messages,
            # so that param_groups carry every key torch's ZeroRedundancyOptimizer would show.
            probe = optimizer_class([torch.nn.Parameter(torch.zeros(1))], **defaults)
        except (TypeError, ValueError, RuntimeError) as e:
            problem = e
        try:
            self.process_group = comm.default_group(process_group)
        except RuntimeError:
            if problem is not None:  # no process group to tell: the input's own error first
                raise problem from None
            raise
        self.world_size = comm.group_size(self.process_group)
        self.rank = comm.group_rank(self.process_group)
        self.global_rank = comm.global_rank(self.process_group, self.rank)
        if problem is None:
            try:
                check_devices(param_tensors(items), comm.backend(self.process_group))
            except ValueError as e:
                problem = e
        self._agree("ZeroRedundancyOptimizer()", problem, items)
        self.optimizer_class = optimizer_class
        self._user_defaults = dict(defaults)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._overlap_with_ddp = overlap_with_ddp
        self._all_state_dicts: list[StateDict] = []
        # state_dict() needs no collective: it compares how often this rank's state changed
        # (steps and loads) with when it was last consolidated
        self._updates = 0
        self._consolidated_at: int | None = None
        self._buffers: list[_Buffer] = []
        self.overlap_param_gather = (
            choose_param_gather(overlap_with_ddp)
            if overlap_param_gather is None
            else bool(overlap_param_gather)
        )
        Optimizer.__init__(self, items, dict(probe.defaults))
        Joinable.__init__(self)
        self._param_sync = ParamSync(self._params(), self._call, self.overlap_param_gather)
        self._default_device: torch.device = self.param_groups[0]["params"][0].device
        spec = functional_spec(optimizer_class)
        if spec is not None and not all(supports_group(spec, g) for g in self.param_groups):
            spec = None
        if overlap_with_ddp and parameters_as_bucket_view:
            logger.warning(
                "parameters_as_bucket_view=True is ignored when overlap_with_ddp=True: "
                "parameters are grouped by DDP's gradient buckets instead"
            )
        self._spec = spec
        self._probe = probe
        self._set_ownership(self._computed_ownership())
        self._initialized = True

    # ------------------------------------------------------------------ ownership

    @property
    def overlap_with_ddp(self) -> bool:
        """Whether the step runs inside DDP's backward (through a hook of :mod:`.hooks`)."""
        return self._overlap_with_ddp

    @property
    def ownership(self) -> Ownership:
        """Which rank owns which pieces of which parameters (global indices, state-dict order)."""
        return self._ownership

    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _computed_ownership(self) -> Ownership:
        """The ownership the ``partition`` option gives the current parameter groups."""
        if self.partition == "sorted_greedy":
            numels = [[p.numel() for p in g["params"]] for g in self.param_groups]
            return sorted_greedy_ownership(numels, self.world_size)
        params = self._params()
        keys = [(str(p.device), p.dtype) for p in params]
        align: dict[Hashable, int] = {
            k: max(1, FLAT_ALIGN_BYTES // p.element_size()) for k, p in zip(keys, params)
        }
        return flat_ownership([p.numel() for p in params], self.world_size, keys=keys, align=align)

    def _index_groups(self) -> None:
        """Where each group's parameters start in the global order, and each one's group."""
        self._group_starts = prefix_sums([len(g["params"]) for g in self.param_groups])
        self._group_of = [g for g, grp in enumerate(self.param_groups) for _ in grp["params"]]

    def _set_ownership(self, ownership: Ownership) -> None:
        """Adopt ``ownership`` and everything derived from it (no state moves here)."""
        self._ownership = ownership
        self._index_groups()
        params = self._params()
        self._own: dict[int, Segment] = {s.param: s for s in ownership.owned(self.rank)}
        self._stepper: Stepper | RealStepper
        if self._spec is not None:
            self._stepper = FunctionalStepper(self._spec, self._compile)
        elif ownership.is_whole and not self._overlap_with_ddp:
            owned = [
                [p for i, p in enumerate(g["params"]) if start + i in self._own]
                for g, start in zip(self.param_groups, self._group_starts)
            ]
            self._stepper = RealStepper(
                self.optimizer_class, self.param_groups, owned, self.state, self._user_defaults
            )
        else:
            self._stepper = ShadowStepper(self._probe, self._user_defaults)
        self._trainable = [p.requires_grad for p in params]
        self._built_trainable = list(self._trainable)
        self._build_buffers()

    def reshard(self, ownership: Ownership) -> None:
        """Move this optimizer's state to ``ownership``; call it on every rank (collective).

        The one place state moves between ranks: each stretch of each parameter whose owner
        changes travels from its old owner to its new one (point to point, in an order every
        rank shares); pieces that change bounds on the same rank are cut or joined locally.
        Overlap mode calls it when DDP's buckets become known or change.

        Raises:
            ValueError: ``ownership`` is over other parameters or another world size.
        """
        self._reshard(self._ownership, ownership)

    def _reshard(self, old: Ownership, ownership: Ownership) -> None:
        """:meth:`reshard` from ``old``, this rank's state being held as ``old`` says."""
        moves = old.transfers(ownership)  # validates before anything changes
        params = self._params()
        me = self.rank
        outgoing: dict[int, dict[tuple[int, int, int], dict[str, Any]]] = {}
        kept: dict[tuple[int, int, int], dict[str, Any]] = {}
        for t in moves:
            if me != t.src:
                continue
            held = old.piece(me, t.param)
            state = self.state.get(params[t.param])
            if held is None or not state:
                continue
            part = slice_state(state, (held.start, held.stop), (t.start, t.stop))
            if t.dst == me:
                kept[(t.param, t.start, t.stop)] = part
            else:
                outgoing.setdefault(t.dst, {})[(t.param, t.start, t.stop)] = part
        pairs = sorted({(t.src, t.dst) for t in moves if t.src != t.dst})
        with self._call("reshard()"):
            received = comm.exchange_objects(
                outgoing, pairs, self.process_group, self._collective_device()
            )
        for payload in received.values():
            kept.update(cast(dict[tuple[int, int, int], dict[str, Any]], payload))
        for t in moves:  # every piece this rank held is replaced (or dropped)
            if t.src == me:
                self.state.pop(params[t.param], None)
        arrived: dict[int, list[tuple[tuple[int, int], dict[str, Any]]]] = {}
        for t in moves:  # in transfer order, which is each parameter's element order
            got = kept.get((t.param, t.start, t.stop)) if t.dst == me else None
            if got is not None:
                arrived.setdefault(t.param, []).append(((t.start, t.stop), got))
        for seg in ownership.owned(me):
            p = params[seg.param]
            parts = arrived.get(seg.param)
            if not parts:
                continue
            whole = seg.start == 0 and seg.stop == p.numel()
            joined = join_states(parts, tuple(p.shape) if whole else None)
            group = self.param_groups[self._group_of[seg.param]]
            self.state[p] = {k: self._placed(k, v, p, group, copy=False) for k, v in joined.items()}
        self._set_ownership(ownership)

    def _build_buffers(self) -> None:
        """With ``parameters_as_bucket_view``, make parameters views of contiguous buffers."""
        if hasattr(self, "_param_sync"):
            self._param_sync.finish()  # the old views may still be being written
        self._buffers = []
        params = self._params()
        # without bucket views, step() sends each piece of each trainable parameter
        self._sends = [
            (k, rank, seg)
            for k, p in enumerate(params)
            if p.requires_grad
            for rank, seg in self._ownership.holders(k)
        ]
        if not self.parameters_as_bucket_view or self._overlap_with_ddp:
            return
        by_key: dict[tuple[Any, ...], list[int]] = {}
        if self._ownership.is_whole:
            # torch's buckets: per owner and (device, dtype), trainable parameters only
            for p in params:
                if not p.requires_grad and p.data._base is not None:
                    p.data = p.data.detach().clone()  # leave a bucket without losing the value
            for k, p in enumerate(params):
                if p.requires_grad:
                    key = (self._ownership.owner(k), str(p.device), str(p.dtype))
                    by_key.setdefault(key, []).append(k)
        else:
            # the flat split's groups: every parameter of a (device, dtype), in index order
            for k, p in enumerate(params):
                by_key.setdefault((str(p.device), str(p.dtype)), []).append(k)
        even = choose_collectives(comm.backend(self.process_group), self.world_size, even=True) == (
            "reduce_scatter+all_gather"
        )
        for _, members in sorted(by_key.items(), key=lambda kv: kv[0]):
            ps = [params[k] for k in members]
            runs, chunk = buffer_runs(self._ownership, members, even=even)
            total = sum(p.numel() for p in ps)
            size = chunk * self.world_size if chunk is not None else total
            layout = bucket_layout([p.numel() for p in ps])
            # one parameter at a time: each old tensor is freed as soon as its slot is filled,
            # so building the views costs one buffer (its pages touched as they are filled),
            # not the buffer plus a flattened copy plus every old parameter
            buffer = torch.empty(size, dtype=ps[0].dtype, device=ps[0].device)
            buffer[total:].zero_()  # the even shards' padding
            for p, view in zip(ps, views(buffer, layout, [p.shape for p in ps])):
                view.copy_(p.detach())
                p.data = view
            self._buffers.append(_Buffer(buffer, runs, chunk, ps))

    # ------------------------------------------------------------------ the step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group and recompute the ownership; call it on every rank.

        Under ``"sorted_greedy"`` parameters already present keep their owner (greedy loads
        carry over from group to group), so no state moves; under ``"flat"`` the split changes
        and :meth:`reshard` moves the state that changes owner.

        Raises:
            RuntimeError: The ranks' parameters now differ (shapes, dtypes or devices).
        """
        if getattr(self, "_initialized", False) and self._overlap_with_ddp:
            raise RuntimeError(
                "ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single parameter "
                "group; build it with all parameters instead of calling add_param_group"
            )
        if not getattr(self, "_initialized", False):
            super().add_param_group(param_group)
            return
        problem: Exception | None = None
        try:
            check_params([param_group])
            check_devices(param_tensors([param_group]), comm.backend(self.process_group))
            if self.partition == "flat":
                check_splittable(param_tensors([param_group]))
        except (TypeError, ValueError, RuntimeError) as e:
            problem = e
        self._agree("add_param_group()", problem, [*self.param_groups, param_group])
        super().add_param_group(param_group)
        self._index_groups()
        self._param_sync.set_params(self._params())
        new = self._computed_ownership()
        self._reshard(self._ownership.extended(new), new)

    def _agree(self, call: str, problem: Exception | None, items: Sequence[Any]) -> None:
        """Raise the same error on every rank if any rank's checks failed or the ranks' parameters
        differ (shapes, dtypes, devices); collective, one small gather of objects."""
        mine = (type(problem).__name__, str(problem)) if problem is not None else fingerprint(items)
        with self._call(call):
            everyone = comm.all_gather_objects(mine, self.process_group)
        failed = {r: v for r, v in enumerate(everyone) if isinstance(v, tuple)}
        if problem is not None:
            raise problem
        if failed:
            kinds = {"TypeError": TypeError, "ValueError": ValueError}
            name, message = next(iter(failed.values()))
            raise kinds.get(name, RuntimeError)(
                f"{call} failed on rank(s) {sorted(failed)}: {message}"
            )
        prints = [cast(list[int], v) for v in everyone]
        if any(theirs != prints[0] for theirs in prints):
            lines = "; ".join(
                f"rank {r}: {v[1]} parameters in {v[0]} groups, {v[2]} elements, fingerprint "
                f"{v[3]:x}"
                for r, v in enumerate(prints)
            )
            raise RuntimeError(
                f"{call}: ranks disagree on the parameters (shapes, dtypes or devices) ({lines}): "
                "build the optimizer, and call add_param_group, on every rank with the same "
                "parameters in the same order"
            )

    def _call(self, name: str) -> AbstractContextManager[None]:
        """The context that names this optimizer's collectives when they fail (comm.call)."""
        return comm.call(name, self.process_group, timeout=self.timeout)

    def _collective_device(self) -> torch.device:
        return comm.collective_device(self.process_group, self._default_device)

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Update this rank's pieces, then sync every piece to every rank.

        Args:
            closure: Re-evaluates the model and returns the loss.
            **kwargs: Passed to ``optimizer_class.step`` where it runs as a real instance over
                whole parameters.

        Returns:
            The closure's loss, if a closure was given.
        """
        if self._overlap_with_ddp:
            if "grad_scaler" in kwargs or getattr(self, "found_inf", None) is not None:
                raise RuntimeError(
                    "scaler.step(zero) cannot work with overlap_with_ddp=True: the step already "
                    "ran inside backward, on the scaled gradients. Pass the scaler to the hook "
                    "instead, hook_with_zero_step(allreduce_hook, ddp, zero, "
                    "grad_scaler=scaler), and call only scaler.scale(loss).backward() and "
                    "scaler.update()"
                )
            logger.warning(
                "step() should not be included in the training loop when overlap_with_ddp=True"
            )
            return None
        Join.notify_join_context(self)
        self.finish_param_sync()
        if self.check_trainable():
            self._build_buffers()
        self._updates += 1
        grads: dict[int, Tensor] | None = None
        if isinstance(self._stepper, RealStepper):
            loss = self._stepper.step(self.param_groups, closure, **kwargs)
        else:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            grads = self._owned_grads()
        with self._call("step()"):
            self._sync_params(grads)
        return loss

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # compat: GradScaler.step(opt) hands such an optimizer its found_inf instead of
        # deciding itself; in overlap mode, step() then refuses (the step already ran)
        return self._overlap_with_ddp

    def check_trainable(self) -> bool:
        """Whether any parameter's ``requires_grad`` changed since the ownership was built.

        Freezing is followed (the frozen parameter is no longer synced); unfreezing a
        parameter that was frozen is an error: DDP, built while it was frozen, never reduces
        its gradient, and overlap mode never updates it. ``step()`` and the hooks call this.

        Raises:
            RuntimeError: A parameter frozen before now requires gradients; names it.
        """
        trainable = [p.requires_grad for p in self._params()]
        if trainable == self._trainable:
            return False
        woke = [
            k for k, (was, now) in enumerate(zip(self._built_trainable, trainable)) if now > was
        ]
        if woke:
            shapes = ", ".join(f"{k} {tuple(self._params()[k].shape)}" for k in woke[:8])
            more = f" and {len(woke) - 8} more" if len(woke) > 8 else ""
            raise RuntimeError(
                f"parameter(s) {shapes}{more} (global index, shape) were frozen "
                "(requires_grad=False) when this optimizer and DDP were built and now require "
                "gradients: DDP does not average their gradients and overlap mode never "
                "updates them, so they would train wrongly. Rebuild DDP and the "
                "ZeroRedundancyOptimizer after unfreezing (or build both with the parameters "
                "trainable and give them lr=0 until they should train)"
            )
        self._trainable = trainable
        return True

    def _owned_segment(self, k: Hashable, what: str) -> Segment:
        """The piece of parameter ``k`` this rank owns; ``ValueError`` naming ``what`` if none."""
        seg = self._own.get(k) if isinstance(k, int) else None
        if seg is None:
            raise ValueError(
                f"{what} for parameter {k!r}, of which rank {self.rank} owns no piece: pass "
                f"the {what} of the pieces ownership.owned(rank) lists"
            )
        return seg

    def _owned_grads(self) -> dict[int, Tensor]:
        params = self._params()
        out: dict[int, Tensor] = {}
        for k, seg in self._own.items():
            grad = params[k].grad
            if grad is not None:
                out[k] = piece_view(grad, seg)
        return out

    def update_owned(self, grads: Mapping[int, Tensor]) -> None:
        """Update this rank's pieces of the parameters in ``grads`` with those gradients.

        The hooks of :mod:`zero_functional.hooks` call it with gradients taken from DDP's
        buckets; ``step()`` with the ``.grad`` of the parameters. Hyperparameters are read from
        ``param_groups`` now, so schedulers apply.

        Args:
            grads: Global parameter index -> the gradient of the piece this rank owns (the
                piece's elements, in any shape that holds them).

        Raises:
            ValueError: This rank owns no piece of a parameter in ``grads``.
        """
        if isinstance(self._stepper, RealStepper):
            raise RuntimeError(
                "update_owned needs an optimizer that runs on pieces; this one runs "
                f"{self.optimizer_class.__name__} over whole parameters: call step()"
            )
        self.finish_param_sync()
        self._updates += 1
        params = self._params()
        by_group: dict[int, tuple[list[Tensor], list[Tensor], list[dict[str, Any]]]] = {}
        for k, grad in grads.items():
            seg = self._owned_segment(k, "gradients")
            if grad.is_sparse:
                raise RuntimeError(
                    f"{self.optimizer_class.__name__} does not support sparse gradients"
                )
            p = params[k]
            view = piece_view(p, seg)
            ps, gs, ss = by_group.setdefault(self._group_of[k], ([], [], []))
            ps.append(view)
            gs.append(grad.view_as(view))
            ss.append(self.state[p])
        for g, (ps, gs, ss) in sorted(by_group.items()):
            self._stepper.step_pieces(self.param_groups[g], ps, gs, ss)

    def _sync_params(self, grads: Mapping[int, Tensor] | None = None) -> None:
        """Update this rank's pieces with ``grads`` (if given) and give every rank every owner's
        updated pieces: now, or, with ``overlap_param_gather``, started now and waited for by
        the next forward. Without bucket views the update is pipelined: each owned unit is
        updated just before its broadcast is issued, while earlier units are on the wire."""
        params = self._params()
        if self.world_size == 1 or self._buffers:
            if grads is not None:
                self.update_owned(grads)
            if self.world_size == 1:
                return
        units: list[tuple[comm.Pending, list[Tensor]]] = []
        if self._buffers:
            for b in self._buffers:
                pending = comm.start_broadcast(b.tensor, b.runs, self.process_group, chunk=b.chunk)
                units.append((pending, b.params))
        else:
            index = [k for k, _, _ in self._sends]
            owners = [rank for _, rank, _ in self._sends]
            tensors = [piece_view(params[k], seg) for k, _, seg in self._sends]
            if grads is not None:
                todo = dict(grads)

                def before(covered: list[int]) -> None:
                    mine = {index[i]: todo.pop(index[i]) for i in covered if index[i] in todo}
                    if mine:
                        self.update_owned(mine)

            started = comm.start_sync_units(
                tensors, owners, self.process_group, before=before if grads is not None else None
            )
            if grads is not None and todo:  # owned pieces of frozen parameters (not synced)
                self.update_owned(todo)
            units = [(pending, [params[index[i]] for i in covered]) for pending, covered in started]
        self._param_sync.defer(units)

    def defer_param_sync(self, units: Sequence[tuple[comm.Pending, Sequence[Tensor]]]) -> None:
        """Hand over parameter all-gathers in flight (a pending collective and the parameters
        it writes): with ``overlap_param_gather``, each is waited for by the forward of the
        module that reads its parameters (see :mod:`zero_functional.param_sync`); without it,
        now. The hooks of :mod:`zero_functional.hooks` hand their all-gathers here.
        """
        self._param_sync.defer(units)

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight (a no-op when none is).

        Only ``overlap_param_gather=True`` (opt-in) leaves any in flight: ``step()``, or in
        overlap mode backward, then returns once the all-gather of the updated parameters has
        started. Each module's forward, ``module.state_dict()``, the next ``step()`` and
        :mod:`zero_functional.checkpoint` wait for it by themselves; call this before any other
        read of the parameters (a comparison across ranks, an EMA update, a parameter read
        directly in the loss before its module's forward ran).
        """
        self._param_sync.finish()

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over all parameters, from the pieces each rank owns.

        Each rank takes the norm of the gradient pieces it owns (the only ones that hold
        reduced values after :func:`~zero_functional.hooks.reduce_scatter_hook`), one
        all-gather of a scalar per rank brings every rank's norm, and the total is the norm of
        those norms, as torch's is the norm of the tensors' norms; every gradient is then
        scaled by ``max_norm / (total_norm + 1e-6)`` where that is below 1. On one rank the
        result is torch's bit for bit; on several, grouping the norms by rank (and by piece,
        where the flat partition splits a tensor) may change its last bit. Call it between backward and ``step()``, on
        every rank.

        Args:
            max_norm: Largest allowed norm.
            norm_type: ``p`` of the p-norm (``inf`` for the largest absolute value).
            error_if_nonfinite: Raise if the total norm is nan or inf.

        Returns:
            The total norm of the gradients (before clipping), the same on every rank.
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
        grads = [p.grad for p in self._params() if p.grad is not None]
        device = grads[0].device if grads else self._default_device
        with torch.no_grad():
            # torch's arithmetic, step by step: each piece's norm (the foreach kernel, per
            # device and dtype), the norm of those norms on each rank, then the norm of the
            # ranks' norms. One rank owning whole tensors gives torch's total bit for bit.
            pieces = [g.detach() for g in self._owned_grads().values()]
            norms = [
                n.to(device)
                for idx in group_indices(pieces).values()
                for n in torch._foreach_norm([pieces[i] for i in idx], norm_type)
            ]
            # every rank gathers in one dtype: float32, or float64 where any gradient is
            wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
            local = (
                torch.linalg.vector_norm(torch.stack(norms), norm_type).to(wide)
                if norms
                else torch.zeros((), device=device, dtype=wide)
            )
            with self._call("clip_grad_norm_()"):
                ranks = comm.all_gather_scalar(local, self.process_group)
            total: Tensor = torch.linalg.vector_norm(ranks, norm_type)
            if error_if_nonfinite and not torch.isfinite(total):
                raise RuntimeError(
                    f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                    "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
                )
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for (dev, _), idx in group_indices(grads).items():
                torch._foreach_mul_([grads[i] for i in idx], coef.to(dev))
        return total

    # ------------------------------------------------------------------ join

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that lets ``Join([ddp, zero])`` train on uneven inputs (kwargs unused).

        Raises:
            RuntimeError: In overlap mode, where the step runs inside DDP's backward and a
                joined rank, which runs no backward, cannot shadow it.
        """
        if self._overlap_with_ddp:
            raise RuntimeError(
                "Join does not work with overlap_with_ddp=True: the step runs inside DDP's "
                "backward, which a rank that ran out of inputs no longer runs, so the ranks' "
                "parameters would differ. For uneven inputs, step after backward "
                "(overlap_with_ddp=False, optionally with reduce_scatter_hook), or give every "
                "rank the same number of batches"
            )
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the first parameter."""
        return self._default_device

    @property
    def join_process_group(self) -> comm.ProcessGroup:
        """The process group this optimizer shards over."""
        return self.process_group

    # ------------------------------------------------------------------ state dicts

    @property
    def optim(self) -> Optimizer | LocalView:
        """This rank's share, as torch's attribute of that name shows it.

        ``optim.param_groups`` lists per group the parameters this rank owns (all or part of)
        with the group's hyperparameters; ``optim.state`` is this rank's state (its pieces').
        """
        if isinstance(self._stepper, RealStepper):
            return self._stepper.local
        params = self._params()
        groups = [
            {
                **hyperparameters(g),
                "params": [
                    params[start + i] for i in range(len(g["params"])) if start + i in self._own
                ],
            }
            for g, start in zip(self.param_groups, self._group_starts)
        ]
        return LocalView(groups, self.state)

    def _local_state(self) -> dict[int, tuple[tuple[int, int], dict[str, Any]]]:
        """This rank's state per owned piece, keyed by global index, copied to the CPU."""
        out: dict[int, tuple[tuple[int, int], dict[str, Any]]] = {}
        params = self._params()
        for k, seg in self._own.items():
            s = self.state.get(params[k])
            if s:
                out[k] = (
                    (seg.start, seg.stop),
                    {
                        key: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v
                        for key, v in s.items()
                    },
                )
        return out

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's state on rank ``to``; call it on every rank.

        Shards travel one at a time, each moved to the CPU on arrival, so rank ``to`` never holds
        more than one other rank's shard in device memory.
        """
        with self._call(f"consolidate_state_dict(to={to})"):
            gathered = comm.gather_objects(
                {"state": self._local_state()}, to, self.process_group, self._collective_device()
            )
        self._all_state_dicts = (
            [cast(StateDict, x) for x in gathered] if gathered is not None else []
        )
        self._consolidated_at = self._updates

    def state_dict(self) -> StateDict:
        """torch's format: ``state`` keyed by global parameter index, ``param_groups``; local.

        Each parameter's state is in its own shape, joined from the pieces of every rank that
        holds one, so the dict loads into torch's ``ZeroRedundancyOptimizer``, a plain
        ``optimizer_class`` and this class under either partition at any world size. What a
        rank gets depends only on what it has done (no collective runs here, so frameworks may
        call it on one rank or on all):

        * before any step or load: empty ``state``, full ``param_groups``;
        * after :meth:`consolidate_state_dict` ``(to)`` and before the next step: rank ``to``
          gets the full dict; every other rank gets empty ``state``, full ``param_groups`` and
          ``PARTIAL_KEY: True``, which :meth:`load_state_dict` refuses;
        * otherwise, an error naming the fix.

        Raises:
            RuntimeError: The state changed since the last :meth:`consolidate_state_dict`
                (or none ran).
        """
        groups = [
            {**hyperparameters(g), "params": list(range(start, start + len(g["params"])))}
            for g, start in zip(self.param_groups, self._group_starts)
        ]
        if self._updates == 0 and not self._all_state_dicts:
            return {"state": {}, "param_groups": groups}
        if self._consolidated_at != self._updates:
            raise RuntimeError(not_consolidated_message(self.rank))
        if not self._all_state_dicts:
            return {"state": {}, "param_groups": groups, PARTIAL_KEY: True}
        parts: dict[int, list[tuple[tuple[int, int], dict[str, Any]]]] = {}
        for shard in self._all_state_dicts:
            for k, (rng, s) in shard["state"].items():
                parts.setdefault(k, []).append((rng, s))
        params = self._params()
        state: dict[int, Any] = {}
        for k in sorted(parts):
            pieces = sorted(parts[k], key=lambda rs: rs[0])
            covered = sum(b - a for (a, b), _ in pieces)
            if covered != params[k].numel():
                raise RuntimeError(
                    f"parameter {k} has state for {covered} of its {params[k].numel()} "
                    "elements: some ranks stepped it and others did not"
                )
            state[k] = join_states(pieces, tuple(params[k].shape))
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the pieces of a consolidated (or plain ``torch.optim``) state dict this rank owns.

        Works at any world size and under either partition (the state is keyed by global
        index, in each parameter's shape); never changes the caller's dict; checks everything
        (structure, hyperparameter kinds, every state value's type, dtype and shape against
        the optimizer class's own state) before changing anything. Local, as torch's is: no
        collective runs, so it may be called on some ranks only; every rank given the same
        dict reaches the same verdict.

        Raises:
            ValueError: A partial dict (``PARTIAL_KEY``: a rank's :meth:`state_dict` after
                consolidation onto another rank), or a dict that does not fit.
            TypeError: A value of the wrong type.
        """
        if isinstance(state_dict, Mapping) and state_dict.get(PARTIAL_KEY):
            raise ValueError(
                "this state dict is partial: it comes from a rank's state_dict() after "
                "consolidate_state_dict(to=...) sent the state to another rank, so it holds no "
                "optimizer state; load the dict that rank `to` saved instead"
            )
        state = validated_state(state_dict, self.param_groups, self._schemas())
        params = self._params()
        pieces = {
            k: slice_state(value, (0, params[k].numel()), (self._own[k].start, self._own[k].stop))
            for k, value in state.items()
            if k in self._own
        }
        self._install(pieces, state_dict["param_groups"], copy=False, loaded=bool(state))

    def shard_state(self) -> dict[int, tuple[Segment, dict[str, Any]]]:
        """This rank's state: per global index of a parameter it owns a piece of (and has state
        for), the piece and the piece's state dict (the optimizer's own tensors, not copies;
        elementwise ones hold the piece's elements, in the parameter's shape when whole).

        What a sharded checkpoint writes (:mod:`zero_functional.checkpoint`).
        """
        params = self._params()
        return {
            k: (seg, self.state[params[k]])
            for k, seg in sorted(self._own.items())
            if self.state.get(params[k])
        }

    def load_shard_state(
        self,
        state: Mapping[int, Mapping[str, Any]],
        param_groups: Sequence[Mapping[str, Any]],
        *,
        copy: bool = True,
    ) -> None:
        """Install the state of this rank's pieces, as :meth:`shard_state` gives it; collective.

        Checks everything first (each key a parameter this rank owns a piece of, each value's
        type, dtype and shape against the piece and the optimizer class's own state, the
        groups' hyperparameters), and a problem on any rank is an error on every rank with
        nothing changed. A sharded checkpoint reads each rank's pieces and calls this.

        Args:
            state: Global parameter index -> the state of this rank's piece of it.
            param_groups: The groups' hyperparameters (``params`` entries are ignored).
            copy: Copy the tensors (the default); ``False`` keeps the given ones where they
                are already on the parameter's device and of its dtype (a loader handing over
                tensors it made for this, which then need no second copy in memory).
        """
        problem: Exception | None = None
        try:
            if len(param_groups) != len(self.param_groups):
                raise ValueError(
                    f"the loaded state has {len(param_groups)} parameter groups, this optimizer "
                    f"has {len(self.param_groups)}: the state belongs to another model"
                )
            for i, (saved, group) in enumerate(zip(param_groups, self.param_groups)):
                check_hyperparameters(i, saved, group)
            schemas = self._schemas()
            params = self._params()
            for k, value in state.items():
                seg = self._owned_segment(k, "state")
                whole = seg.start == 0 and seg.stop == params[k].numel()
                check_param_state(
                    f"parameter {k} (this rank's piece [{seg.start}, {seg.stop}))",
                    value,
                    tuple(params[k].shape) if whole else (seg.stop - seg.start,),
                    is_complex=params[k].is_complex(),
                    schema=schemas[self._group_of[k]],
                )
        except (TypeError, ValueError) as e:
            problem = e
        self._agree("load_shard_state()", problem, self.param_groups)
        self._install(state, param_groups, copy=copy, loaded=True)

    def _schemas(self) -> list[dict[str, str] | None]:
        elementwise = update_kind(self.optimizer_class) == "elementwise"
        return [
            state_schema(self.optimizer_class, g, self._user_defaults) if elementwise else None
            for g in self.param_groups
        ]

    def _install(
        self,
        pieces: Mapping[int, Mapping[str, Any]],
        groups: Sequence[Mapping[str, Any]],
        *,
        copy: bool,
        loaded: bool,
    ) -> None:
        """Replace this rank's state by ``pieces`` (already checked) and the groups' values;
        ``loaded``: whether any rank's state changes (what :meth:`state_dict` must know)."""
        params = self._params()
        placed: dict[Tensor, dict[str, Any]] = {}
        for k, value in pieces.items():
            p = params[k]
            group = self.param_groups[self._group_of[k]]
            placed[p] = {key: self._placed(key, v, p, group, copy) for key, v in value.items()}
        for g, s in zip(self.param_groups, groups):
            g.update(hyperparameters(s))
        self.state.clear()  # in place: the real instance of RealStepper shares this mapping
        self.state.update(placed)
        if loaded:
            self._updates += 1

    def _placed(
        self, key: str, value: object, param: Tensor, group: Mapping[str, Any], copy: bool = True
    ) -> object:
        """Where a loaded or moved state value lives: torch's rule, except that the functional
        core (and any fused or capturable group) keeps ``step`` as float32 on the parameter's
        device, where the fused kernels need it (torch's CPU step: pytorch#124133)."""
        if not isinstance(value, Tensor):
            return value
        if key == "step":
            if self._spec is not None or group.get("fused") or group.get("capturable"):
                return value.detach().to(device=param.device, dtype=torch.float32, copy=copy)
            return value.detach().clone() if copy else value.detach()
        if value.is_floating_point():
            return value.detach().to(device=param.device, dtype=param.dtype, copy=copy)
        return value.detach().to(device=param.device, copy=copy)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter (all ranks' shards)."""
        super().zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return (
            f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank}/"
            f"{self.world_size}, partition={self.partition!r}, {len(self.param_groups)} groups, "
            f"functional={self._spec is not None})"
        )
