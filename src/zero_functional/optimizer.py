"""ZeroRedundancyOptimizer: the thin stateful shell over the pure core.

A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``. The partition is a value
computed once by :func:`zero_functional.partition.sorted_greedy_groups` (torch's algorithm, so
consolidated state dicts line up with torch's); SGD, Adam and AdamW run the functional core
directly (fused kernels where torch has them); any other ``torch.optim`` class runs as a local
optimizer over this rank's shard, as torch does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from itertools import accumulate
from typing import Any, cast

import torch
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from zero_functional import comm
from zero_functional.buckets import bucket_layout, flatten, views
from zero_functional.functional import (
    FunctionalSpec,
    functional_spec,
    group_hyperparams,
    supports_group,
)
from zero_functional.partition import owners as owner_of_each
from zero_functional.partition import sorted_greedy_groups

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)

StateDict = dict[str, Any]


def _check_params(params: object) -> list[Any]:
    """The parameters (or groups) as a list, after torch's checks and ours."""
    if isinstance(params, Tensor):
        raise TypeError(
            "params argument should be an iterable of Tensors or dicts, but got "
            f"{torch.typename(params)}; wrap it in a list: [tensor]"
        )
    try:
        items = list(cast(Iterable[Any], params))
    except TypeError as e:
        raise TypeError(
            f"params argument should be an iterable of Tensors or dicts, but got {type(params).__name__}"
        ) from e
    if not items:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(p, dict) for p in items):
        tensors: list[Any] = []
        for i, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"parameter group {i} has no 'params' key")
            ps = g["params"]
            tensors.extend([ps] if isinstance(ps, Tensor) else list(ps))
    elif all(isinstance(p, Tensor) for p in items):
        tensors = items
    else:
        bad = next(p for p in items if not isinstance(p, Tensor | dict))
        raise TypeError(
            "params must be all Tensors or all parameter-group dicts, but got a "
            f"{type(bad).__name__}"
        )
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"parameter {i} is a {type(t).__name__}, not a Tensor")
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(
                f"parameter {i} is sparse ({t.layout}); ZeroRedundancyOptimizer shards dense "
                "parameters only: keep sparse embeddings out of it and give them their own "
                "optimizer (e.g. torch.optim.SparseAdam)"
            )
        if not (t.is_floating_point() or t.is_complex()):
            dtypes = sorted({str(x.dtype).removeprefix("torch.") for x in tensors})
            raise ValueError(
                f"parameters have dtypes {', '.join(dtypes)}; parameter {i} is "
                f"{str(t.dtype).removeprefix('torch.')}, which "
                "no optimizer can update: pass only floating-point parameters, or freeze this "
                "one outside the optimizer"
            )
    return items


class _ZeroJoinHook(JoinHook):
    """Shadows the step's collectives on a rank that has run out of inputs."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Shards any ``torch.optim`` optimizer's state across the ranks of a process group.

    Each rank owns the parameters that :func:`~zero_functional.partition.sorted_greedy_groups`
    gives it, keeps optimizer state for those only, updates them, then every rank receives the
    updated parameters of every other rank (one broadcast per owner rank and dtype).

    Args:
        params: Tensors or parameter-group dicts, as ``torch.optim`` accepts.
        optimizer_class: Any ``torch.optim.Optimizer`` subclass; SGD, Adam and AdamW run the
            functional core (fused kernels where torch has them), others run locally per shard.
        process_group: The group to shard over (default: the world).
        parameters_as_bucket_view: Make each rank's parameters views into one contiguous buffer
            per (device, dtype), so the sync moves buffers without copies.
        overlap_with_ddp: Run the step inside DDP's backward through a hook from
            :mod:`zero_functional.hooks`; ``step()`` then only warns.
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
        **defaults: Any,
    ) -> None:
        items = _check_params(params)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
            )
        self._initialized = False
        self.optimizer_class = optimizer_class
        self._user_defaults = dict(defaults)
        # The class's full defaults (betas, eps, ...), validated with torch's own messages, so that
        # param_groups carry every key torch's ZeroRedundancyOptimizer would show.
        probe = optimizer_class([torch.nn.Parameter(torch.zeros(1))], **defaults)
        full_defaults = dict(probe.defaults)
        self.process_group = comm.default_group(process_group)
        self.world_size = comm.group_size(self.process_group)
        self.rank = comm.group_rank(self.process_group)
        self.global_rank = comm.global_rank(self.process_group, self.rank)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._overlap_with_ddp = overlap_with_ddp
        self._all_state_dicts: list[StateDict] = []
        self._buckets: list[tuple[int, Tensor]] = []
        self._local: Optimizer | None = None
        self._overlap: object | None = None  # set by a zero_functional.hooks hook
        self._overlap_ready = False
        Optimizer.__init__(self, items, full_defaults)
        Joinable.__init__(self)
        self._default_device: torch.device = self.param_groups[0]["params"][0].device
        self._spec: FunctionalSpec | None = functional_spec(optimizer_class)
        if self._spec is not None and not all(
            supports_group(self._spec, g) for g in self.param_groups
        ):
            self._spec = None
        if overlap_with_ddp:
            if self._spec is None:
                from zero_functional.functional import SUPPORTED

                raise ValueError(
                    f"overlap_with_ddp=True needs an optimizer with a functional form; "
                    f"{optimizer_class.__name__} with these options has none. Supported: "
                    + ", ".join(c.__name__ for c in SUPPORTED)
                )
            if parameters_as_bucket_view:
                logger.warning(
                    "parameters_as_bucket_view=True is ignored when overlap_with_ddp=True: "
                    "parameters are grouped by DDP's gradient buckets instead"
                )
        self._repartition()
        self._initialized = True

    # ------------------------------------------------------------------ partition and layout

    def _repartition(self) -> None:
        """Recompute the partition value, this rank's local optimizer and the buckets."""
        numels = [[p.numel() for p in g["params"]] for g in self.param_groups]
        self._partition = sorted_greedy_groups(numels, self.world_size)
        self._group_starts = [0, *accumulate(len(g["params"]) for g in self.param_groups)]
        self._trainable = [p.requires_grad for p in self._all_params()]
        global_partition = [
            [start + i for start, part in zip(self._group_starts, self._partition) for i in part[r]]
            for r in range(self.world_size)
        ]
        self._owner_of: list[int] = list(owner_of_each(global_partition, self._group_starts[-1]))
        if self._spec is None and not self._overlap_with_ddp:
            self._rebuild_local_optimizer()
        self._build_buckets()

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _owned(self, group: int, rank: int | None = None) -> list[Tensor]:
        """The parameters of ``group`` that ``rank`` (default: this rank) owns."""
        ps = self.param_groups[group]["params"]
        return [ps[i] for i in self._partition[group][self.rank if rank is None else rank]]

    def _owners(self) -> list[int]:
        """Owning rank of each parameter, in global (state-dict) order."""
        return list(self._owner_of)

    def _rebuild_local_optimizer(self) -> None:
        """torch's behaviour for classes without a functional form: one optimizer per shard."""
        old = self._local
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": self._owned(i)}
            for i, g in enumerate(self.param_groups)
        ]
        self._local = self.optimizer_class(groups, **self._user_defaults)
        if old is not None:
            for p, s in old.state.items():
                self._local.state[p] = s
        self.state = self._local.state

    def _sync_groups(self, src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
        for s, d in zip(src, dst, strict=True):
            d.update({k: v for k, v in s.items() if k != "params"})

    def _shard_groups(self) -> list[tuple[int, list[Tensor]]]:
        """(owner, trainable params) per owner rank and (device, dtype): the sync's unit."""
        keyed: dict[tuple[int, str, str], list[Tensor]] = {}
        for p, owner in zip(self._all_params(), self._owners()):
            if p.requires_grad:
                keyed.setdefault((owner, str(p.device), str(p.dtype)), []).append(p)
        return [(key[0], ps) for key, ps in sorted(keyed.items(), key=lambda kv: kv[0])]

    def _build_buckets(self) -> None:
        """With ``parameters_as_bucket_view``, make parameters views of one buffer per shard."""
        self._buckets = []
        if not self.parameters_as_bucket_view or self._overlap_with_ddp:
            return
        for p in self._all_params():
            if not p.requires_grad and p.data._base is not None:
                p.data = p.data.detach().clone()  # leave a bucket without losing the value
        for owner, ps in self._shard_groups():
            buffer = flatten([p.detach() for p in ps])
            for p, view in zip(
                ps, views(buffer, bucket_layout([p.numel() for p in ps]), [p.shape for p in ps])
            ):
                p.data = view
            self._buckets.append((owner, buffer))

    # ------------------------------------------------------------------ the step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group and re-partition; must be called on every rank.

        Parameters already present keep their owner (greedy loads carry over from group to group),
        so no state moves. A rank that calls this alone makes the next ``step()`` raise on every
        rank instead of hanging.
        """
        if getattr(self, "_initialized", False) and self._overlap_with_ddp:
            raise RuntimeError(
                "ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single parameter "
                "group; build it with all parameters instead of calling add_param_group"
            )
        if getattr(self, "_initialized", False):
            _check_params([param_group])
        super().add_param_group(param_group)
        if getattr(self, "_initialized", False):
            self._repartition()

    def _check_consistent(self) -> None:
        shapes = [len(g["params"]) for g in self.param_groups]
        values = [len(shapes), sum(shapes), sum(p.numel() for p in self._all_params())]
        if not comm.all_agree(values, self.process_group, self._collective_device()):
            raise RuntimeError(
                f"ranks disagree on the parameters (this rank, {self.rank}, has "
                f"{values[1]} parameters in {values[0]} groups, {values[2]} elements): "
                "add_param_group must be called on every rank, with the same parameters"
            )

    def _collective_device(self) -> torch.device:
        return comm.collective_device(self.process_group, self._default_device)

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Update this rank's shard, then sync every shard to every rank.

        Args:
            closure: Re-evaluates the model and returns the loss.
            **kwargs: Passed to the local optimizer's ``step`` (non-functional classes).

        Returns:
            The closure's loss, if a closure was given.
        """
        if self._overlap_with_ddp:
            logger.warning(
                "step() should not be included in the training loop when overlap_with_ddp=True"
            )
            return None
        Join.notify_join_context(self)
        self._check_consistent()
        if [p.requires_grad for p in self._all_params()] != self._trainable:
            self._trainable = [p.requires_grad for p in self._all_params()]
            self._build_buckets()
        if self._local is not None:
            self._sync_groups(self.param_groups, self._local.param_groups)
            loss = (
                self._local.step(closure, **kwargs)
                if closure is not None
                else self._local.step(**kwargs)
            )
            self._sync_groups(self._local.param_groups, self.param_groups)
        else:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._functional_step()
        self._sync_params()
        return cast("float | None", loss)

    def _functional_step(self) -> None:
        for g in range(len(self.param_groups)):
            params = [p for p in self._owned(g) if p.grad is not None]
            self._update(g, params, [cast(Tensor, p.grad) for p in params])

    def _update(self, group: int, params: list[Tensor], grads: list[Tensor]) -> None:
        """The functional core's in-place update of ``params`` (all of ``group``) with ``grads``,
        hyperparameters read from ``param_groups`` now, so schedulers work."""
        spec = self._spec
        assert spec is not None
        if not params:
            return
        if any(gr.is_sparse for gr in grads):
            raise RuntimeError(f"{self.optimizer_class.__name__} does not support sparse gradients")
        hyper = group_hyperparams(spec, self.param_groups[group])
        fresh = [p for p in params if not self.state.get(p)]
        if fresh:
            for p, d in zip(fresh, spec.state_to_dicts(spec.init(fresh, **hyper))):
                self.state[p] = d
        state = spec.state_from_dicts([self.state[p] for p in params], params, **hyper)
        with torch.no_grad():
            spec.update_(params, grads, state, **hyper)
        for p, d in zip(params, spec.state_to_dicts(state)):
            self.state[p].update(d)

    def _sync_params(self) -> None:
        if self.world_size == 1:
            return
        if self._buckets:
            owners = [owner for owner, _ in self._buckets]
            for work in comm.broadcast_shards(
                [b for _, b in self._buckets], owners, self.process_group
            ):
                work.wait()
            return
        trainable = [p for p in self._all_params() if p.requires_grad]
        owners = [o for p, o in zip(self._all_params(), self._owners()) if p.requires_grad]
        comm.sync_params(trainable, owners, self.process_group)

    # ------------------------------------------------------------------ join

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that lets ``Join([ddp, zero])`` train on uneven inputs (kwargs unused)."""
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

    def _check_overlap_initialized(self) -> None:
        if self._overlap_with_ddp and not self._overlap_ready:
            raise RuntimeError(
                "This method should not be called until this ZeroRedundancyOptimizer instance "
                "has been fully initialized (after the first backward with the DDP hook)"
            )

    def _local_state(self) -> dict[int, dict[str, Any]]:
        """This rank's per-parameter state, keyed by global index, copied to the CPU."""
        out: dict[int, dict[str, Any]] = {}
        params = self._all_params()
        for index, owner in enumerate(self._owners()):
            if owner != self.rank:
                continue
            s = self.state.get(params[index])
            if s:
                out[index] = {
                    k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v
                    for k, v in s.items()
                }
        return out

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard state on rank ``to``; call it on every rank.

        Shards travel one at a time, each moved to the CPU on arrival, so rank ``to`` never holds
        more than one other rank's shard in device memory.
        """
        self._check_overlap_initialized()
        gathered = comm.gather_objects(
            {"state": self._local_state()}, to, self.process_group, self._collective_device()
        )
        self._all_state_dicts = (
            [cast(StateDict, x) for x in gathered] if gathered is not None else []
        )

    def state_dict(self) -> StateDict:
        """torch's format: ``state`` keyed by global parameter index, ``param_groups``.

        Raises:
            RuntimeError: Before :meth:`consolidate_state_dict` on this rank.
        """
        self._check_overlap_initialized()
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant "
                "to save the global state."
            )
        state: dict[int, Any] = {}
        for shard in self._all_state_dicts:
            state.update(shard["state"])
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": list(range(start, start + len(g["params"]))),
            }
            for g, start in zip(self.param_groups, self._group_starts)
        ]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def _validated_state(self, state_dict: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
        """The state of ``state_dict`` after every check, before anything is changed."""
        if (
            not isinstance(state_dict, Mapping)
            or "state" not in state_dict
            or "param_groups" not in state_dict
        ):
            raise ValueError(
                "state_dict must be a dict with 'state' and 'param_groups' keys, as state_dict() returns"
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        for i, (s, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(s["params"]) != len(g["params"]):
                raise ValueError(
                    f"parameter group {i} has {len(g['params'])} parameters but the loaded state "
                    f"dict's has {len(s['params'])}: the state belongs to another model"
                )
        # Saved indices may be any ids (torch.optim uses positions); map them to our positions.
        index_of = {
            saved: start + j
            for s, start in zip(saved_groups, self._group_starts)
            for j, saved in enumerate(s["params"])
        }
        params = self._all_params()
        state: dict[int, Mapping[str, Any]] = {}
        for key, value in state_dict["state"].items():
            if key not in index_of:
                raise ValueError(
                    f"loaded state has an entry for parameter {key!r}, which no group lists"
                )
            index = index_of[key]
            p = params[index]
            for name, t in value.items():
                if isinstance(t, Tensor) and t.dim() > 0 and t.shape != p.shape:
                    raise ValueError(
                        f"parameter {index} has shape {tuple(p.shape)} but its loaded state "
                        f"'{name}' has shape {tuple(t.shape)}: the state belongs to another model"
                    )
            state[index] = value
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the shard of a consolidated (or plain ``torch.optim``) state dict that this rank owns.

        Works at any world size (the state is keyed by global index); never changes the
        caller's dict; checks everything before changing anything.
        """
        self._check_overlap_initialized()
        state = self._validated_state(state_dict)
        params = self._all_params()
        owners = self._owners()
        for g, s in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: v for k, v in s.items() if k != "params"})
        if self._local is not None:
            local_groups = self._local.param_groups
            self._sync_groups(self.param_groups, local_groups)
            local_index = {
                p: i for i, p in enumerate(p for lg in local_groups for p in lg["params"])
            }
            local_sd = {
                "state": {
                    local_index[params[i]]: dict(v)
                    for i, v in state.items()
                    if owners[i] == self.rank
                },
                "param_groups": [
                    {
                        **{k: v for k, v in lg.items() if k != "params"},
                        "params": [local_index[p] for p in lg["params"]],
                    }
                    for lg in local_groups
                ],
            }
            self._local.load_state_dict(local_sd)
            return
        self.state.clear()
        for index, value in state.items():
            if owners[index] != self.rank:
                continue
            p = params[index]
            self.state[p] = {k: self._to_param_policy(k, v, p) for k, v in value.items()}

    @staticmethod
    def _to_param_policy(key: str, value: object, param: Tensor) -> object:
        """Where a loaded state tensor lives: the parameter's device; ``step`` stays float32 there
        (the fused kernels need it on the device, unlike torch's CPU step: pytorch#124133)."""
        if not isinstance(value, Tensor):
            return value
        if key == "step":
            return value.detach().to(device=param.device, dtype=torch.float32, copy=True)
        if value.is_floating_point():
            return value.detach().to(device=param.device, dtype=param.dtype, copy=True)
        return value.detach().to(device=param.device, copy=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter (all ranks' shards)."""
        super().zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return (
            f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank}/"
            f"{self.world_size}, {len(self.param_groups)} groups, functional="
            f"{self._spec is not None})"
        )
