"""Hybrid sharding on a 2-D mesh (issue 23, part 1): state sharded within the "shard" groups and
replicated across "replicate", in every mode, equal to plain DDP + AdamW; checkpoints move
between meshes, 1-D groups and one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional import ZeroRedundancyOptimizer, checkpoint
from zero_functional.core.loads import rank_traffic
from zero_functional.core.plans import ownership_for
from zero_functional.hooks import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    reduce_scatter_hook,
)

from tests.helpers import (
    FUSED,
    all_to_all_sent,
    average_grads,
    consolidated,
    local_batch,
    make_model,
    max_diff,
    run_ranks,
)

STEPS = 10
MODES = [  # (the step, partition)
    ("after", "flat"),
    ("after", "sorted_greedy"),
    ("reduce_scatter_hook", "flat"),
    ("hook_with_zero_step_interleaved", "flat"),
]
MORE_MODES = [  # on one uneven mesh (3 shards): the options, each once
    ("after, bucket view", "sorted_greedy"),
    ("reduce_scatter_hook, GradScaler", "flat"),
    ("hook_with_zero_step, GradScaler", "sorted_greedy"),
    ("reduce_scatter_hook", "sorted_greedy"),
]
NORM_BOUND = (192 + 8) * torch.finfo(torch.float32).eps / 2
"""A norm's bound from two orders of make_model's 192 squares (tests/dist/test_flat.py)."""
OVERFLOW_AT = 3  # the step where the last rank's gradient overflows (with a GradScaler)


def _mesh(replicas: int, shards: int) -> Any:
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _train(rank: int, world: int, mode: str, partition: str, **where: Any) -> dict[str, Any]:
    """Train a DDP model over the world with our AdamW sharded as ``where`` says (device_mesh or
    process_group), beside plain DDP + AdamW; clip after backward where the mode allows."""
    model, ref_model = make_model(), make_model()
    ddp, ref = DDP(model), DDP(ref_model)
    overlap = mode.startswith("hook_with")
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        partition=partition,
        overlap_with_ddp=overlap,
        parameters_as_bucket_view="bucket view" in mode,
        **where,
    )
    scaling = "GradScaler" in mode
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2))
    kw: dict[str, Any] = {"grad_scaler": scaler} if scaling else {}
    if mode.startswith("reduce_scatter_hook"):
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, **kw))
    elif mode.startswith("hook_with_zero_step_interleaved"):
        ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
    elif overlap:
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero, **kw))
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2, **FUSED)
    norms: list[tuple[float, float]] = []
    scales: list[tuple[float, float]] = []
    for step in range(STEPS):
        x, y = local_batch(rank, world, step)
        for d, s in ((ddp, scaler), (ref, ref_scaler)):
            loss = ((d(x) - y) ** 2).mean()
            handle = None
            if scaling and step == OVERFLOW_AT and rank == world - 1:
                handle = d.module[0].bias.register_hook(lambda g: g * float("inf"))
            (s.scale(loss) if scaling else loss).backward()
            if handle is not None:
                handle.remove()
        if scaling:
            if not overlap:
                scaler.step(zero)
            ref_scaler.step(plain)
            scaler.update()
            ref_scaler.update()
            scales.append((scaler.get_scale(), ref_scaler.get_scale()))
        else:
            if not overlap:
                ours = zero.clip_grad_norm_(0.5)
                # torch's norm, checked on its own (NORM_BOUND); ours clips both sides
                theirs = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()])
                torch.nn.utils.clip_grads_with_norm_(ref.parameters(), 0.5, ours)
                norms.append((float(ours), float(theirs)))
                zero.step()
            plain.step()
        ddp.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    owned = sum(s.stop - s.start for s in zero.ownership.owned(zero.rank))
    plan = ownership_for(partition, zero.param_groups, zero.world_size).owned(zero.rank)
    return {
        "diff": max_diff(model, ref_model),
        "scales": all(a == b for a, b in scales) and (not scales or scales[-1][0] < 2.0**10),
        "norm": max((abs(a - b) / b for a, b in norms), default=0.0),
        "owned": owned,
        "planned": sum(s.stop - s.start for s in plan),
        "total": sum(p.numel() for p in model.parameters()),
        "state": sum(v.numel() for s in zero.state.values() for v in s.values() if v.dim()),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _state(zero: ZeroRedundancyOptimizer, rank: int) -> dict[int, dict[str, Any]]:
    sd = consolidated(zero, rank)
    assert sd is not None
    return sd["state"]  # type: ignore[no-any-return]


def _checkpointed(
    rank: int, world: int, load: str | None, save: str, **where: Any
) -> tuple[dict[int, Any], dict[int, Any] | None]:
    """Load ``load`` (when given) into an AdamW sharded as ``where`` says; its state, then
    (after two more steps) save to ``save``."""
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, **where)
    loaded = None
    if load is not None:
        checkpoint.load(load, model=model, optimizer=zero)
        loaded = _state(zero, rank)
    for step in range(2):
        x, y = local_batch(rank, world, step)
        ((model(x) - y) ** 2).mean().backward()
        average_grads(model, world)
        zero.step()
        model.zero_grad(set_to_none=True)
    checkpoint.save(save, model=model, optimizer=zero)
    return _state(zero, rank), loaded


def _mesh_worker(rank: int, world: int, shape: tuple[int, int], ckpt: str) -> dict[str, Any]:
    replicas, shards = shape
    mesh = _mesh(replicas, shards)
    out: dict[str, Any] = {"modes": {}}
    for mode, partition in MODES + (MORE_MODES if shape == (2, 3) else []):
        out["modes"][(mode, partition)] = _train(rank, world, mode, partition, device_mesh=mesh)
    one_d: dict[str, Any] = {}
    if replicas == 1:  # 1 x S: today's 1-D run over the world
        one_d = _train(rank, world, "reduce_scatter_hook", "flat")
    elif shards == 1:  # R x 1: each rank its own shard group, DDP averaging over the world
        one_d = _train(rank, world, "after", "flat", process_group=dist.new_group([rank]))
    if one_d:
        mode = ("reduce_scatter_hook", "flat") if replicas == 1 else ("after", "flat")
        mine = out["modes"][mode]["params"]
        out["bitwise_1d"] = all(map(torch.equal, mine, one_d["params"]))
    for r in out["modes"].values():
        del r["params"]
    # checkpoints: the previous mesh's (if any) loads here; this mesh's is saved for the next
    previous = f"{ckpt}.previous" if shape != (2, 2) else None
    out["saved"], out["loaded"] = _checkpointed(rank, world, previous, ckpt, device_mesh=mesh)
    return out


def _plain_load_worker(rank: int, world: int, ckpt: str) -> dict[int, Any] | None:
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    checkpoint.load(ckpt, model=model, optimizer=zero)
    return _state(zero, rank)


def _equal_states(a: dict[int, Any], b: dict[int, Any]) -> bool:
    return a.keys() == b.keys() and all(
        all(torch.equal(torch.as_tensor(a[k][key]), torch.as_tensor(b[k][key])) for key in a[k])
        for k in a
    )


SHAPES = [(2, 2), (3, 2), (1, 4), (4, 1), (2, 3)]


def test_meshes_match_plain_ddp_and_checkpoints_move_between_them(tmp_path: Any) -> None:
    import os
    import shutil

    ckpt = str(tmp_path / "ckpt")
    saved: dict[int, Any] | None = None
    for shape in SHAPES:
        if saved is not None:
            shutil.rmtree(f"{ckpt}.previous", ignore_errors=True)
            os.replace(ckpt, f"{ckpt}.previous")
        world = shape[0] * shape[1]
        results = run_ranks(_mesh_worker, world, shape, ckpt, timeout_s=600)
        for r in results:
            for (mode, partition), m in r["modes"].items():
                case = (shape, mode, partition)
                # Our reduce within the shard group and all-reduce across replicas add the W
                # gradients in another order than DDP's all-reduce over the world: an average
                # differs by at most (W - 1) u kappa of itself (u = 2^-24, W <= 6; kappa =
                # sum |g_r| / |sum g_r|, the seeded data's, not the machine's), which AdamW's
                # step (<= lr = 0.01, a ratio of gradient statistics) carries over at most
                # twice: 10 steps x 2 x 0.01 x 5 u kappa = 6e-8 kappa, under 1e-6 while
                # kappa < 16. Both sides clip by our coefficient; the norms differ as two orders
                # of the same squares do: NORM_BOUND.
                assert m["diff"] <= 1e-6, (case, m["diff"])
                assert m["norm"] <= NORM_BOUND, (case, m["norm"])
                assert m["scales"], case  # equal scales, lowered by the overflow
                if not mode.startswith("hook_with"):  # overlap mode owns by DDP's buckets
                    assert m["owned"] == m["planned"], case
                assert m["state"] == 2 * m["owned"], case  # AdamW's two moments, 1/S each
                if partition == "flat":  # 1/S of the model, exactly (the last takes the rest)
                    assert m["owned"] in (-(-m["total"] // shape[1]), m["total"] % shape[1]) or (
                        m["total"] % shape[1] == 0 and m["owned"] == m["total"] // shape[1]
                    ), case
            if "bitwise_1d" in r:
                assert r["bitwise_1d"], shape
            if saved is not None:  # the previous mesh's checkpoint, bitwise
                assert r["loaded"] is not None and _equal_states(r["loaded"], saved), shape
        saved = results[0]["saved"]
    # the last mesh's checkpoint loads at 4 ranks (1-D) and in one process
    assert saved is not None
    for world in (4, 1):
        for loaded in run_ranks(_plain_load_worker, world, ckpt, timeout_s=200):
            assert loaded is not None and _equal_states(loaded, saved), world


def _refusals(rank: int, world: int) -> list[str]:
    mesh = _mesh(2, 2)
    ddp = DDP(make_model())  # over the world, 4 ranks; an optimizer over a 1-D group of 2
    out = []
    for build in (
        lambda: ZeroRedundancyOptimizer(
            make_model().parameters(),
            torch.optim.AdamW,
            process_group=dist.group.WORLD,
            device_mesh=mesh,
        ),
        lambda: ZeroRedundancyOptimizer(
            make_model().parameters(), torch.optim.AdamW, device_mesh=init_device_mesh("cpu", (4,))
        ),
        lambda: reduce_scatter_hook(
            ddp,
            ZeroRedundancyOptimizer(
                ddp.parameters(), torch.optim.AdamW, process_group=mesh.get_group("shard")
            ),
        ),
    ):
        try:
            build()
            out.append("accepted")
        except (TypeError, ValueError) as e:
            out.append(str(e))
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, device_mesh=mesh)
    try:
        checkpoint.stateful(model, zero)
        out.append("accepted")
    except ValueError as e:
        out.append(str(e))
    out.append(
        f"{dist.get_world_size(zero.shard_group)} {dist.get_world_size(zero.replicate_group)}"
    )
    return out


def test_mesh_arguments_are_checked() -> None:
    both, one_d, hook, stateful, sizes = run_ranks(_refusals, 4, timeout_s=120)[0]
    assert "checkpoint.save/load" in stateful
    assert "not both" in both
    assert "2-D" in one_d
    assert "device_mesh" in hook
    assert sizes == "2 2"


# ---------------------------------------------------------------- bytes and Join


def _traffic_worker(rank: int, world: int, shape: tuple[int, int]) -> dict[str, float]:
    """Bytes per rank of one step (reduce_scatter_hook, flat), counted from the collectives
    that ran: within the shard group what a reduce sends from a non-owner and a broadcast
    brings to a non-owner; across, a ring all-reduce's ``2 b (R-1)/R`` of each owned run."""
    replicas, shards = shape
    mesh = _mesh(replicas, shards)
    model = make_model()
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.AdamW, lr=1e-2, partition="flat", device_mesh=mesh
    )
    ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
    counted = {"within": 0.0, "across": 0.0}
    names = ("reduce", "broadcast", "all_reduce", "all_to_all_single")
    originals = {name: getattr(dist, name) for name in names}

    def counting(name: str) -> Any:
        def inner(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            nbytes = tensor.numel() * tensor.element_size()
            group = kwargs.get("group")
            if name == "all_to_all_single" and _ranks(group) == _ranks(zero.shard_group):
                # the reduce onto owners, on the exchanger's twin of the shard group
                counted["within"] += all_to_all_sent(args[0], args[2], group)
            elif name == "all_reduce" and group is zero.replicate_group:
                counted["across"] += 2 * nbytes * (replicas - 1) / replicas
            elif name in ("reduce", "broadcast") and group is zero.shard_group:
                if args[0] != dist.get_rank():  # the root: dst of a reduce, src of a broadcast
                    counted["within"] += nbytes
            return originals[name](tensor, *args, **kwargs)

        return inner

    for step in range(2):
        if step == 1:  # the first backward is ours too (no deferral after backward)
            for name in originals:
                setattr(dist, name, counting(name))
        x, y = local_batch(rank, world, step)
        ((ddp(x) - y) ** 2).mean().backward()
        zero.step()
        ddp.zero_grad(set_to_none=True)
    for name, fn in originals.items():
        setattr(dist, name, fn)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {**counted, "bytes": float(total)}


def _ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def _join_worker(rank: int, world: int) -> bool:
    """Uneven inputs under Join on a 2 x 2 mesh, after backward: every rank ends with the same
    parameters (no hang, no drift between replicas)."""
    from torch.distributed.algorithms.join import Join

    model = make_model()
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.AdamW, lr=1e-2, device_mesh=_mesh(2, 2)
    )
    with Join([ddp, zero]):
        for step in range(3 + rank):
            x, y = local_batch(rank, world, step)
            ((ddp(x) - y) ** 2).mean().backward()
            zero.step()
            ddp.zero_grad(set_to_none=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], f) for f in every)


@pytest.mark.parametrize("shape", [(2, 2), (3, 2)])
def test_bytes_per_rank_within_and_across_match_the_plan(shape: tuple[int, int]) -> None:
    replicas, shards = shape
    for r in run_ranks(_traffic_worker, replicas * shards, shape, timeout_s=120):
        want = rank_traffic(int(r["bytes"]), shards, replicas)
        assert r["within"] == want.within, (shape, r, want)
        # byte counts: 2 b (R - 1) / R summed in floats, exact below 2^53 but for the division's
        # rounding.
        assert abs(r["across"] - want.across) < 1e-9, (shape, r, want)


def test_join_with_uneven_inputs_on_a_mesh() -> None:
    assert all(run_ranks(_join_worker, 4, timeout_s=120))
