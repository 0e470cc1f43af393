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

import functools
import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch

# imported here, not by torch.optim.Optimizer under our __init__: that import leaves a cycle
# holding every frame on the stack, so this optimizer and its group past destroy (issue 20)
import torch._dynamo  # noqa: F401
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from zero_functional import comm
from zero_functional._validate import prefix_sums
from zero_functional.amp import refuse_scaler_step, scaler_verdict, unscaled
from zero_functional.checks import (
    agreement_verdict,
    check_devices,
    check_inputs,
    check_params,
    check_unfrozen,
    fingerprint,
    param_tensors,
)
from zero_functional.functional import (
    functional_spec,
    supports_group,
    update_kind,
)
from zero_functional.grad_norm import clip_, norm_dtype, pieces_norm
from zero_functional.main_params import (
    MAIN_KEY,
    check_main_params_dtype,
    main_dtype_for,
    step_through_main_,
)
from zero_functional.ownership import (
    Ownership,
    PartitionName,
    Transfer,
    check_splittable,
    piece_view,
)
from zero_functional.param_sync import ParamSync
from zero_functional.partition import Segment
from zero_functional.plans import choose_param_gather, ownership_for, plan_moves
from zero_functional.state_dict import (
    PARTIAL_KEY,
    check_shard_state,
    join_states,
    merge_shards,
    not_consolidated_message,
    placed,
    slice_state,
    to_cpu,
    validated_state,
)
from zero_functional.steppers import (
    LocalView,
    RealStepper,
    choose_stepper,
    hyperparameters,
    state_schema,
)

__all__ = ["PARTIAL_KEY", "ZeroRedundancyOptimizer", "not_consolidated_message"]

logger = logging.getLogger(__name__)

StateDict = dict[str, Any]


class _ZeroJoinHook(JoinHook):
    """Shadows the step's collectives on a rank that has run out of inputs."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


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
            (:func:`~zero_functional.plans.choose_param_gather`): off in every mode,
            torch's contract: parameters are final when ``step()`` (overlap mode: backward)
            returns.
        main_params_dtype: ``torch.float32`` to update bf16/fp16 parameters through an fp32
            copy of the pieces this rank owns, with fp32 state (:mod:`.main_params`); the
            parameters receive the copy rounded to their dtype. ``None`` (default): state in
            the parameters' dtype, as torch's.
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
        main_params_dtype: torch.dtype | None = None,
        **defaults: Any,
    ) -> None:
        self._initialized = False
        self.timeout = timeout
        self._compile = compile
        # Every check is local; its verdict, and each rank's fingerprint, are then exchanged so
        # that a problem on one rank is an error on every rank rather than a hang on the others.
        problem: Exception | None = None
        items: list[Any] = []
        self._main_params_dtype: torch.dtype | None = None
        try:
            items, probe = check_inputs(
                params, optimizer_class, partition, overlap_with_ddp, defaults
            )
            self._main_params_dtype = check_main_params_dtype(main_params_dtype)
            if main_params_dtype is not None and update_kind(optimizer_class) != "elementwise":
                raise ValueError(
                    f"main_params_dtype needs an elementwise optimizer; "
                    f"{optimizer_class.__name__} couples its parameters"
                )
        except (TypeError, ValueError, RuntimeError) as e:
            problem = e
        self.partition: PartitionName = partition
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
        self.overlap_param_gather = (
            choose_param_gather(overlap_with_ddp)
            if overlap_param_gather is None
            else bool(overlap_param_gather)
        )
        Optimizer.__init__(self, items, dict(probe.defaults))
        Joinable.__init__(self)
        # not the bound self._call, which would make a cycle through this optimizer (#20)
        call = functools.partial(comm.call, group=self.process_group, timeout=self.timeout)
        self._param_sync = ParamSync(
            self._params(), self.process_group, call, self.overlap_param_gather
        )
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
    def main_params_dtype(self) -> torch.dtype | None:
        """The dtype of the main copies of narrower parameters (``None``: no main copies)."""
        return self._main_params_dtype

    @property
    def param_sync(self) -> ParamSync:
        """The owner of the parameters' storage and of the parameter all-gathers in flight."""
        return self._param_sync

    @property
    def ownership(self) -> Ownership:
        """Which rank owns which pieces of which parameters (global indices, state-dict order)."""
        return self._ownership

    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _computed_ownership(self) -> Ownership:
        """The ownership the ``partition`` option gives the current parameter groups."""
        return ownership_for(self.partition, self.param_groups, self.world_size)

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
        self._stepper = choose_stepper(
            self._spec,
            self._compile,
            self._probe,
            ownership.is_whole and not self._overlap_with_ddp and self._main_params_dtype is None,
            self.param_groups,
            self._own,
            self.state,
            self._user_defaults,
        )
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
        plan = plan_moves(old, ownership, self.rank)  # validates before anything changes
        params = self._params()
        parts: dict[int, dict[Transfer, dict[str, Any]]] = {}  # by destination rank
        for t in plan.sends:
            held, state = old.piece(self.rank, t.param), self.state.get(params[t.param])
            if held is not None and state:
                part = slice_state(state, (held.start, held.stop), (t.start, t.stop))
                parts.setdefault(t.dst, {})[t] = part
        kept = parts.pop(self.rank, {})
        with self._call("reshard()"):
            received = comm.exchange_objects(
                parts, list(plan.pairs), self.process_group, self._collective_device()
            )
        for payload in received.values():
            kept.update(cast(dict[Transfer, dict[str, Any]], payload))
        for k in plan.held:  # every piece this rank held is replaced (or dropped)
            self.state.pop(params[k], None)
        for k, moves in plan.receives.items():
            pieces = [((t.start, t.stop), kept[t]) for t in moves if t in kept]
            seg, p = ownership.piece(self.rank, k), params[k]
            if not pieces or seg is None:
                continue
            whole = seg.start == 0 and seg.stop == p.numel()
            joined = join_states(pieces, tuple(p.shape) if whole else None)
            group = self.param_groups[self._group_of[k]]
            self.state[p] = {
                key: self._placed(key, v, p, group, copy=False) for key, v in joined.items()
            }
        self._set_ownership(ownership)

    def _build_buffers(self) -> None:
        """Follow the ownership and ``requires_grad`` in the parameter sync (bucket views)."""
        bucket_view = self.parameters_as_bucket_view and not self._overlap_with_ddp
        self._param_sync.rebuild(self._ownership, bucket_view)

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
        error = agreement_verdict(call, problem, everyone)
        if error is not None:
            raise error

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
            refuse_scaler_step(self, kwargs)
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
            skip, grad_scale = scaler_verdict(self)  # scaler.step(self), main copies
            if skip:  # a non-finite gradient on every rank: no parameter changes anywhere
                return loss
            grads = self._owned_grads()
            if grad_scale is not None:
                params = self._params()
                dtypes = {
                    k: main_dtype_for(params[k].dtype, self._main_params_dtype) for k in grads
                }
                grads = unscaled(grads, dtypes, grad_scale)
        with self._call("step()"):
            self._param_sync.sync(grads, self.update_owned)
        return loss

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # compat: GradScaler.step(opt) hands such an optimizer its found_inf instead of
        # deciding itself; in overlap mode, step() then refuses (the step already ran); with
        # main copies step() unscales in their dtype (GradScaler refuses fp16 gradients)
        return self._overlap_with_ddp or self._main_params_dtype is not None

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
        check_unfrozen(self._built_trainable, trainable, [p.shape for p in self._params()])
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
        by_group: dict[int, tuple[list[Tensor], list[Tensor], list[dict[str, Any]], list[Any]]] = {}
        for k, grad in grads.items():
            seg = self._owned_segment(k, "gradients")
            if grad.is_sparse:
                raise RuntimeError(
                    f"{self.optimizer_class.__name__} does not support sparse gradients"
                )
            p = params[k]
            view = piece_view(p, seg)
            ps, gs, ss, ds = by_group.setdefault(self._group_of[k], ([], [], [], []))
            ps.append(view)
            gs.append(grad.view_as(view))
            ss.append(self.state[p])
            ds.append(main_dtype_for(p.dtype, self._main_params_dtype))
        for g, (ps, gs, ss, ds) in sorted(by_group.items()):
            step_through_main_(self._stepper.step_pieces, self.param_groups[g], ps, gs, ss, ds)

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
        local = pieces_norm(
            list(self._owned_grads().values()), norm_type, device, norm_dtype(grads)
        )
        with self._call("clip_grad_norm_()"):
            ranks = comm.all_gather_scalar(local, self.process_group)
        total: Tensor = torch.linalg.vector_norm(ranks, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
            )
        clip_(grads, total, max_norm)
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
        return LocalView.of(self.param_groups, self._own, self.state)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's state on rank ``to``; call it on every rank.

        Shards travel one at a time, each moved to the CPU on arrival, so rank ``to`` never holds
        more than one other rank's shard in device memory.
        """
        with self._call(f"consolidate_state_dict(to={to})"):
            gathered = comm.gather_objects(
                {
                    "state": {
                        k: ((seg.start, seg.stop), to_cpu(s))
                        for k, (seg, s) in self.shard_state().items()
                    }
                },
                to,
                self.process_group,
                self._collective_device(),
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
        shards = [shard["state"] for shard in self._all_state_dicts]
        state = merge_shards(shards, [tuple(p.shape) for p in self._params()])
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
        self._warn_without_main(pieces)
        self._install(pieces, state_dict["param_groups"], copy=False, loaded=bool(state))

    def main_params(self) -> dict[Tensor, Tensor]:
        """This rank's main copies (``main_params_dtype``), keyed by parameter: each the owned
        piece's elements (in the parameter's shape when whole). Views of the optimizer's own
        copies: read them, do not write them. A piece not stepped yet shows its parameter's
        values upcast (a new tensor); parameters that need no copy are absent.
        """
        params = self._params()
        out: dict[Tensor, Tensor] = {}
        for k, seg in sorted(self._own.items()):
            p = params[k]
            dtype = main_dtype_for(p.dtype, self._main_params_dtype)
            if dtype is not None:
                main = self.state.get(p, {}).get(MAIN_KEY)
                out[p] = main.detach() if main is not None else piece_view(p, seg).to(dtype)
        return out

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
            params = self._params()
            check_shard_state(
                state,
                param_groups,
                self.param_groups,
                {k: (self._owned_segment(k, "state"), params[k]) for k in state},
                [self._schemas()[self._group_of[k]] for k in range(len(params))],
            )
        except (TypeError, ValueError) as e:
            problem = e
        self._agree("load_shard_state()", problem, self.param_groups)
        self._warn_without_main(state)
        self._install(state, param_groups, copy=copy, loaded=True)

    def _warn_without_main(self, pieces: Mapping[int, Mapping[str, Any]]) -> None:
        params = self._params()
        if any(
            v and MAIN_KEY not in v and main_dtype_for(params[k].dtype, self._main_params_dtype)
            for k, v in pieces.items()
        ):
            logger.warning(
                "the loaded state has no %r for some low-precision parameters: their main "
                "copies start from the parameters' values (rounded to their dtype)",
                MAIN_KEY,
            )

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
        fp32_step = self._spec is not None or bool(group.get("fused") or group.get("capturable"))
        dtype = main_dtype_for(param.dtype, self._main_params_dtype)
        return placed(key, value, param, fp32_step=fp32_step, copy=copy, dtype=dtype)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter (all ranks' shards)."""
        super().zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return (
            f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank}/"
            f"{self.world_size}, partition={self.partition!r}, {len(self.param_groups)} groups, "
            f"functional={self._spec is not None})"
        )
