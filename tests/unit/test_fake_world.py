"""Thousands of ranks by simulation (issue 23, part 2): torch's fake process group lets this
process be rank r of a world of 64, 1,024 or 4,096, to check construction, ownership, memory and
the length of messages at scale.

What cannot be checked this way (see :mod:`zero_functional.comm.testing`): anything that needs other
ranks' data (sums, gathers, the constructor's agreement check, consolidation: each receives this
rank's own bytes), and overlap mode's first backward with DDP's ``allreduce_hook``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_functional import ZeroRedundancyOptimizer, comm
from zero_functional.comm import calls
from zero_functional.comm.testing import fake_world
from zero_functional.core.fingerprint import agreement_verdict
from zero_functional.core.plans import ownership_for
from zero_functional.hooks import reduce_scatter_hook

WORLDS = [64, 1024, 4096]
MESSAGE_LIMIT = 2048


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small's 148 parameter tensors (124,439,808 elements), in state-dict order."""
    shapes: list[tuple[int, ...]] = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,)]
        shapes += [(768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
    return shapes + [(768,), (768,)]


@pytest.fixture(scope="module")
def gpt2() -> list[nn.Parameter]:
    """One set of GPT-2-small-shaped parameters with gradients, shared by the module's tests
    (each simulated rank changes only its own pieces)."""
    params = [nn.Parameter(torch.empty(s).uniform_(-0.02, 0.02)) for s in gpt2_small_shapes()]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    return params


def _owned_state(zero: ZeroRedundancyOptimizer) -> dict[int, tuple[int, int]]:
    params = [p for g in zero.param_groups for p in g["params"]]
    index = {p: k for k, p in enumerate(params)}
    return {
        index[p]: (s["exp_avg"].numel(), s["exp_avg_sq"].numel()) for p, s in zero.state.items()
    }


@pytest.mark.parametrize("partition", ["flat", "sorted_greedy"])
@pytest.mark.parametrize("world_size", WORLDS)
def test_gpt2_small_at_thousands_of_ranks(
    gpt2: list[nn.Parameter], world_size: int, partition: Any
) -> None:
    plan = ownership_for(partition, [{"params": gpt2}], world_size)
    seen: list[int] = []
    for rank in (0, 1, world_size - 1):
        started = time.perf_counter()
        with fake_world(world_size, rank):
            zero = ZeroRedundancyOptimizer(gpt2, torch.optim.AdamW, lr=1e-3, partition=partition)
            zero.step()
            seconds = time.perf_counter() - started
            assert zero.ownership == plan  # what the pure plan says, exactly
            seen.append(hash(zero.ownership))
            # the local state holds exactly the pieces the plan gives this rank
            want = {s.param: (s.stop - s.start,) * 2 for s in plan.owned(rank)}
            assert _owned_state(zero) == want
        print(f"{partition} {world_size} ranks, rank {rank}: built and stepped in {seconds:.2f} s")
    assert len(set(seen)) == 1  # the same ownership on every sampled rank
    loads = [sum(s.stop - s.start for s in plan.owned(r)) for r in range(world_size)]
    if partition == "flat":  # even to the element: 124,439,808 / 4,096 is not whole
        assert round(max(loads) / (sum(loads) / world_size), 3) == 1.000
        assert len(set(loads[:-1])) == 1  # all but the last rank, which takes the remainder


def test_ddp_and_a_step_after_backward_at_1024_ranks() -> None:
    torch.manual_seed(0)
    with fake_world(1024, rank=5):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        ddp = nn.parallel.DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, partition="flat")
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
        before = [p.detach().clone() for p in model.parameters()]
        ddp(torch.randn(8, 64)).sum().backward()
        zero.step()
        params = list(model.parameters())
        for s in zero.ownership.owned(5):  # this rank's pieces took the step (the others'
            # values are not meaningful here: a receive buffer gets no data under the fake group)
            piece = params[s.param].detach().reshape(-1)[s.start : s.stop]
            assert bool((piece != before[s.param].reshape(-1)[s.start : s.stop]).all())
        assert zero.ownership.owned(5)


@pytest.mark.parametrize("world_size", WORLDS)
def test_messages_stay_short_at_any_world_size(
    world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a collective that fails: every other rank is silent (the fake store holds no reports)
    monkeypatch.setattr(calls, "REPORT_GRACE_S", 0.0)
    with fake_world(world_size, rank=0) as group:
        with pytest.raises(comm.CollectiveError) as failed:
            with comm.call("step()", group):
                raise RuntimeError("Connection closed by peer")
    text = str(failed.value)
    assert len(text) <= MESSAGE_LIMIT, len(text)
    assert f"and {world_size - 1 - 4} more did not report" in text
    # every rank's check failed, or every rank's parameters differ from rank 0's
    failed_everywhere = agreement_verdict("x()", None, [("ValueError", "bad")] * world_size)
    differ = agreement_verdict("x()", None, [[0, 1, 2, r] for r in range(world_size)])
    for error in (failed_everywhere, differ):
        assert error is not None and len(str(error)) <= MESSAGE_LIMIT


def test_fake_world_refuses_a_running_group_and_bad_ranks() -> None:
    with pytest.raises(ValueError, match="rank"):
        with fake_world(4, rank=4):
            pass
    with fake_world(2) as group:
        assert dist.get_world_size(group) == 2
        with pytest.raises(RuntimeError, match="already running"):
            with fake_world(2):
                pass
    assert not dist.is_initialized()


# ------------------------------------------ issue 34, item 12: every failure's message, at 4,096


def _message(call: Any, error: type[Exception], match: str) -> str:
    """The message ``call()`` fails with, after checking it is the failure meant."""
    with pytest.raises(error, match=match) as caught:
        call()
    return str(caught.value)


def _model_of(n: int) -> nn.ParameterList:
    """``n`` parameters of 1,000 elements and one of 2**20 (split over about 1,000 ranks by
    partition='flat'): message sizes that grow with the parameters or the ranks show."""
    torch.manual_seed(0)
    sizes = [1000] * n + [1 << 20]
    return nn.ParameterList([nn.Parameter(torch.randn(s) * 0.01) for s in sizes])


@pytest.mark.parametrize("partition", ["flat", "sorted_greedy"])
def test_every_failure_names_itself_in_2_kb_at_4096_ranks(partition: Any, tmp_path: Any) -> None:
    """Construction, add_param_group, load_state_dict, Ownership queries and checkpoint
    failures of a 451-parameter model at 4,096 ranks. Before the caps these were longer
    (characters): an Ownership whose pieces leave a gap 68,179 (flat), checkpoint.load into
    a model of other names 7,113, Ownership.extended 4,194, an Ownership with a piece outside
    its parameters 2,796, checkpoint.save/load with a model lacking the optimizer's
    parameters 2,249; owned_slices of no parameter was an IndexError."""
    from zero_functional import checkpoint
    from zero_functional.checkpoint.storage import CheckpointError
    from zero_functional.core.consolidation import PARTIAL_KEY
    from zero_functional.core.ownership import Ownership, flat_ownership
    from zero_functional.core.partition import Piece

    world, me, n = 4096, 5, 450
    saved = tmp_path / "saved"  # a checkpoint of the model, by a one-rank job (DCP's save
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:  # needs every rank's plan, which the fake group does not gather)
        checkpoint.save(saved, model=_model_of(n))
    finally:
        dist.destroy_process_group()
    messages: dict[str, str] = {}
    with fake_world(world, rank=me):
        model = _model_of(n)
        params = list(model)

        def build(ps: Any = params, cls: Any = torch.optim.AdamW, **kw: Any) -> Any:
            return ZeroRedundancyOptimizer(ps, cls, partition=partition, **kw)

        construction = {
            "a parameter twice": (lambda: build(params + params[:1]), ValueError, "same tensor"),
            "a bad lr": (lambda: build(lr="x"), TypeError, "must be a number"),
            "not an optimizer class": (lambda: build(cls=int), TypeError, "optimizer_class"),
            "no parameters": (lambda: build([]), ValueError, "empty parameter list"),
            "a dict": (lambda: build(dict(model.named_parameters())), TypeError, "a dict"),
            "a sparse tensor": (lambda: build([torch.zeros(3).to_sparse()]), ValueError, "sparse"),
            "LBFGS": (lambda: build(cls=torch.optim.LBFGS), ValueError, "closure"),
        }
        for name, (call, error, match) in construction.items():
            messages[name] = _message(call, error, match)

        zero = build(lr=1e-3)
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        zero.step()
        ownership = zero.ownership
        torch_adam = torch.optim.AdamW(params, lr=1e-3)
        torch_adam.step()
        other = [nn.Parameter(torch.zeros(7)) for _ in params]
        other_adam = torch.optim.AdamW(other, lr=1e-3)
        for p in other:
            p.grad = torch.ones_like(p)
        other_adam.step()
        extra_key = torch_adam.state_dict()
        extra_key["state"][10**6] = {}
        partial = {**torch_adam.state_dict(), PARTIAL_KEY: True}
        no_params = {"state": {}, "param_groups": [{"params": [0], "lr": 1e-3}]}
        wrong = {"params": [1, 2]}
        split = max(range(n + 1), key=lambda k: len(ownership.holders(k)))
        held = ownership.holders(split)
        dropped = held[len(held) // 2][0]  # a rank whose piece of `split` goes missing
        gap = tuple(
            tuple(s for s in ownership.owned(r) if r != dropped or s.param != split)
            for r in range(world)
        )
        outside = ((Piece(10**6, 0, 1, 1),),) + ownership.pieces[1:]
        queries = {
            "add_param_group duplicates": (
                lambda: zero.add_param_group({"params": params[:50]}),
                ValueError,
                "more than one parameter group",
            ),
            "add_param_group non-tensors": (
                lambda: zero.add_param_group(wrong),
                TypeError,
                "not a Tensor",
            ),
            "unconsolidated state_dict": (zero.state_dict, RuntimeError, "consolidat"),
            "another model's state": (
                lambda: zero.load_state_dict(other_adam.state_dict()),
                ValueError,
                "belongs to another model",
            ),
            "a partial state dict": (lambda: zero.load_state_dict(partial), ValueError, "partial"),
            "not a state dict": (lambda: zero.load_state_dict({"x": 1}), ValueError, "'state'"),
            "too few parameters": (
                lambda: zero.load_state_dict(no_params),
                ValueError,
                "another model",
            ),
            "a state no group lists": (
                lambda: zero.load_state_dict(extra_key),
                ValueError,
                "no group lists",
            ),
            "owner of no parameter": (lambda: ownership.owner(10**6), ValueError, "not one of"),
            "owned by no rank": (lambda: ownership.owned(world), ValueError, "not a rank"),
            "piece of no rank": (lambda: ownership.piece(-1, 0), ValueError, "not a rank"),
            "runs of no parameter": (lambda: ownership.runs([10**6]), ValueError, "not one of"),
            "slices of no parameter": (
                lambda: ownership.owned_slices([10**6], 0),
                ValueError,
                "not one of",
            ),
            "extended across worlds": (
                lambda: ownership.extended(flat_ownership([7] * (n + 2), 8)),
                ValueError,
                "cannot extend",
            ),
            "transfers to other parameters": (
                lambda: ownership.transfers(flat_ownership([7], world)),
                ValueError,
                "cannot move state",
            ),
            "reshard to other parameters": (
                lambda: zero.reshard(flat_ownership([7] * n, world)),
                ValueError,
                "parameter",
            ),
            "an ownership with a gap": (
                lambda: Ownership(ownership.numels, world, gap),
                ValueError,
                "tile it|exactly one owner",
            ),
            "a piece outside": (
                lambda: Ownership(ownership.numels, world, outside),
                ValueError,
                "outside",
            ),
        }
        if partition == "flat":
            queries["owner of a split parameter"] = (
                lambda: ownership.owner(split),
                ValueError,
                "split across ranks",
            )
        for name, (call, error, match) in queries.items():
            messages[name] = _message(call, error, match)

        (tmp_path / "empty").mkdir()
        renamed = nn.Module()
        renamed.w = nn.ParameterList(params)  # the same tensors under other names
        failures = {
            "no such checkpoint": (tmp_path / "absent", model, zero, "no checkpoint directory"),
            "an empty directory": (tmp_path / "empty", model, zero, "empty directory"),
            "another model": (saved, renamed, zero, "does not fit the model"),
            "not the optimizer's model": (saved, nn.Linear(2, 2), zero, "not parameters of"),
        }
        for name, (path, m, opt, match) in failures.items():
            messages[name] = _message(
                functools.partial(checkpoint.load, path, model=m, optimizer=opt),
                CheckpointError,
                match,
            )
        messages["save with another model"] = _message(
            lambda: checkpoint.save(tmp_path / "x", model=nn.Linear(2, 2), optimizer=zero),
            CheckpointError,
            "not parameters of",
        )
    too_long = {name: len(text) for name, text in messages.items() if len(text) > MESSAGE_LIMIT}
    assert not too_long, too_long


def test_gathered_objects_are_each_ranks_own_though_equal_payloads_decode_once() -> None:
    # the fake group hands every rank this rank's payload: one decode, then copies, so that
    # what a caller changes in one rank's object stays out of the others' (as if unpickled apart)
    with fake_world(64, rank=3) as group:
        every = comm.all_gather_objects({"step": 7, "seen": [1, 2], "t": torch.ones(2)}, group)
    assert len(every) == 64
    first, second = every[0], every[1]
    assert isinstance(first, dict) and isinstance(second, dict)
    assert first["step"] == second["step"] == 7 and torch.equal(first["t"], second["t"])
    first["seen"].append(3)
    first["t"].add_(1)
    assert second["seen"] == [1, 2] and torch.equal(second["t"], torch.ones(2))
    assert len({id(o) for o in every}) == 64
