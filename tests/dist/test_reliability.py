"""Bad input is a clear error on every rank, with the optimizer, the model and files untouched.

One case per problem a new user found (issue #14), each asserting the message and that nothing
changed: the optimizer's consolidated state and the model's parameters are compared before and
after. The command line's cases live in ``test_cli.py`` and ``test_launch.py``.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional.app.launch import LaunchError
from zero_functional.hooks import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    reduce_scatter_hook,
)
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.helpers import FUSED, average_grads, max_diff, run_ranks, train_both


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def train(model: nn.Module, opt: Any, rank: int, world_size: int, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if world_size > 1:
            average_grads(model, world_size)
        opt.step()


def snapshot(model: nn.Module, opt: Any) -> tuple[list[torch.Tensor], dict[Any, Any]]:
    return (
        [p.detach().clone() for p in model.parameters()],
        {
            p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in opt.state.items()
        },
    )


def unchanged(
    before: tuple[list[torch.Tensor], dict[Any, Any]], model: nn.Module, opt: Any
) -> bool:
    params, state = before
    if not all(torch.equal(a, b) for a, b in zip(params, model.parameters())):
        return False
    if state.keys() != opt.state.keys():
        return False
    return all(
        all(
            torch.equal(v, opt.state[p][k]) if isinstance(v, torch.Tensor) else v == opt.state[p][k]
            for k, v in s.items()
        )
        for p, s in state.items()
    )


def _cases_worker(rank: int, world_size: int) -> dict[str, str]:
    out: dict[str, str] = {}

    def expect(label: str, exc: type[BaseException], fn: Any) -> None:
        with pytest.raises(exc) as info:
            fn()
        out[label] = str(info.value)

    for partition in ("sorted_greedy", "flat"):
        model = make_model()
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, partition=partition, lr=0.01
        )
        train(model, opt, rank, world_size, 2)
        before = snapshot(model, opt)

        # 1. a state dict from another model with as many parameters: a scalar parameter's
        # state on a matrix (the next fused step used to corrupt the heap)
        other = nn.ParameterList(
            [nn.Parameter(torch.tensor(1.0)) for _ in range(len(list(model.parameters())))]
        )
        plain = torch.optim.Adam(other, lr=0.01)
        for p in other:
            p.grad = torch.ones(())
        plain.step()
        foreign = plain.state_dict()
        # pinned: torch.optim.Adam loads it, and only its next step fails
        ref_m = make_model()
        ref = torch.optim.Adam(ref_m.parameters(), lr=0.01)
        ref.load_state_dict(copy.deepcopy(foreign))
        for p in ref_m.parameters():
            p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError, match="broadcast shape"):
            ref.step()
        expect(
            f"{partition}: foreign state",
            ValueError,
            lambda opt=opt, sd=foreign: opt.load_state_dict(sd),
        )
        assert unchanged(before, model, opt)

        # a state dict whose step is a string, or whose moments are integers
        sd = plain.state_dict()
        bad_step = copy.deepcopy(sd)
        bad_step["state"][0]["step"] = "3"
        expect(
            f"{partition}: string step",
            TypeError,
            lambda opt=opt, sd=bad_step: opt.load_state_dict(sd),
        )
        # one rank's dict alone is bad: that rank raises; loading is local, as torch's is
        own = copy.deepcopy(plain.state_dict())
        mine = ZeroRedundancyOptimizer(other.parameters(), torch.optim.Adam, lr=0.01)
        if rank == world_size - 1:
            own["state"][0]["exp_avg"] = torch.zeros((), dtype=torch.int64)
            expect(
                f"{partition}: one rank's dict",
                (TypeError, ValueError),
                lambda mine=mine, sd=own: mine.load_state_dict(sd),
            )  # type: ignore[arg-type]
        else:
            mine.load_state_dict(own)
            out[f"{partition}: one rank's dict"] = "loaded"
        assert unchanged(before, model, opt)
        train(model, opt, rank, world_size, 1)  # and the optimizer still works

    # 2. the same parameter twice is refused, as torch.optim is moving to
    w, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(1))
    expect(
        "duplicates",
        ValueError,
        lambda: ZeroRedundancyOptimizer([w, w, b], torch.optim.SGD, lr=0.1),
    )

    # 3. ranks that disagree on the parameters: other shapes with the same element count
    shape = (2, 3) if rank == 0 else (3, 2)
    expect(
        "shapes disagree",
        RuntimeError,
        lambda: ZeroRedundancyOptimizer([nn.Parameter(torch.ones(shape))], torch.optim.SGD, lr=0.1),
    )

    # 4. a parameter on a device the backend cannot move, on one rank only: every rank raises
    device = "meta" if rank == 0 else "cpu"
    expect(
        "meta on one rank",
        ValueError,
        lambda: ZeroRedundancyOptimizer(
            [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3, device=device))],
            torch.optim.SGD,
            lr=0.1,
        ),
    )
    return out


def test_bad_input_is_a_clear_error_on_every_rank_and_changes_nothing() -> None:
    for rank, out in enumerate(run_ranks(_cases_worker, 2, timeout_s=120)):
        for partition in ("sorted_greedy", "flat"):
            assert (
                "has shape (3, 4) but its loaded state 'exp_avg' has shape ()"
                in out[f"{partition}: foreign state"]
            ), out
            assert "'step' is a str" in out[f"{partition}: string step"]
            one = out[f"{partition}: one rank's dict"]
            assert (one == "loaded") if rank == 0 else ("exp_avg" in one), one
        assert "parameters 0 and 1 are the same tensor" in out["duplicates"]
        assert "ranks disagree on the parameters" in out["shapes disagree"]
        meta = out["meta on one rank"]
        assert "meta device" in meta and (rank == 0 or "failed on rank(s) [0]" in meta), meta


def _optim_worker(rank: int, world_size: int) -> dict[str, Any]:
    """What torch's own tests read: ``optim.param_groups`` (this rank's), ``optim.state``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    out: dict[str, Any] = {}
    # SGD runs as our functional step (optim is a view); RMSprop as a real instance
    classes = {"SGD": (torch.optim.SGD, {"momentum": 0.9}), "RMSprop": (torch.optim.RMSprop, {})}
    for name, (opt_cls, kw) in classes.items():
        for label, cls in (("ours", ZeroRedundancyOptimizer), ("torch", TorchZero)):
            torch.manual_seed(0)
            sizes = [9, 7, 5, 3]
            params = [nn.Parameter(torch.rand(s, 1)) for s in sizes]
            o = cls(params, opt_cls, lr=0.1, **kw)
            for p in params:
                p.grad = torch.ones_like(p)
            o.step()
            index = {p: i for i, p in enumerate(params)}
            out[f"{name} {label}"] = (
                [[index[p] for p in g["params"]] for g in o.optim.param_groups],
                sorted(index[p] for p in o.optim.state),
                [sorted(k for k in g if k != "params") for g in o.optim.param_groups],
                [g["lr"] for g in o.optim.param_groups],
                {index[p]: sorted(s) for p, s in o.optim.state.items()},
            )
    return out


def test_optim_attribute_shows_this_ranks_share_as_torchs_does() -> None:
    for result in run_ranks(_optim_worker, 2, timeout_s=60):
        for name in ("SGD", "RMSprop"):
            assert result[f"{name} ours"] == result[f"{name} torch"], (name, result)


MUTATIONS = st.lists(
    st.tuples(
        st.integers(0, 3),  # parameter
        st.sampled_from(["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "extra"]),
        st.sampled_from(
            [
                "delete",
                "scalar",
                "wrong shape",
                "transposed",
                "int",
                "float64",
                "number",
                "string",
                "none",
                "nan",
                "drop param",
            ]
        ),
    ),
    max_size=3,
)


def _mutate(sd: dict[str, Any], muts: list[tuple[int, str, str]]) -> dict[str, Any]:
    for index, key, how in muts:
        state = sd["state"].get(index)
        if state is None:
            continue
        if how == "drop param":
            del sd["state"][index]
            continue
        old = state.get(key)
        if not isinstance(old, torch.Tensor):
            old = torch.zeros(2)
        if how == "delete":
            state.pop(key, None)
        elif how == "scalar":
            state[key] = torch.tensor(0.5)
        elif how == "wrong shape":
            state[key] = torch.zeros(old.numel() + 1)
        elif how == "transposed":
            state[key] = old.t().contiguous() if old.dim() == 2 else old.reshape(-1, 1)
        elif how == "int":
            state[key] = old.to(torch.int64)
        elif how == "float64":
            state[key] = old.double()
        elif how == "number":
            state[key] = 2.0
        elif how == "string":
            state[key] = "x"
        elif how == "none":
            state[key] = None
        elif how == "nan":
            state[key] = torch.full_like(old, float("nan"), dtype=torch.float32)
    return sd


def _fuzz_worker(rank: int, world_size: int, examples: int) -> int:
    model = make_model()
    base_opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, base_opt, 0, 1, 2)
    base = base_opt.state_dict()
    checked = 0

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(MUTATIONS)
    def loads_equal_to_torch_or_refuses(muts: list[tuple[int, str, str]]) -> None:
        nonlocal checked
        sd = _mutate(copy.deepcopy(base), muts)
        ours_m, ref_m = copy.deepcopy(model), copy.deepcopy(model)
        ours = ZeroRedundancyOptimizer(ours_m.parameters(), torch.optim.Adam, lr=0.01)
        try:
            ours.load_state_dict(sd)
        except (ValueError, TypeError):
            assert not ours.state  # refused: nothing loaded
            return
        ref = torch.optim.Adam(ref_m.parameters(), lr=0.01)
        ref.load_state_dict(copy.deepcopy(sd))  # what we accept, torch accepts
        train(ours_m, ours, 0, 1, 2)
        train(ref_m, ref, 0, 1, 2)
        for a, b in zip(ours_m.parameters(), ref_m.parameters()):
            # One rank, the same state and gradients: only the kernels differ, a few ulps (2^-22) of
            # a parameter per step, 2 steps: 4.8e-7 relative, within rtol.
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True), muts
        checked += 1

    loads_equal_to_torch_or_refuses()
    return checked


def test_load_state_dict_fuzz_steps_equal_to_torch_or_raises() -> None:
    (checked,) = run_ranks(_fuzz_worker, 1, 80, timeout_s=240)
    assert checked > 0  # some mutations (none, float64, extra keys) load and step like torch


def _mismatch_worker(rank: int, world_size: int) -> tuple[str, float]:
    import time

    from zero_functional.comm import CollectiveError

    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01, timeout=3.0)
    train(model, opt, rank, world_size, 1)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        if rank == 0:
            opt.step()  # rank 0 steps ...
        else:
            opt.consolidate_state_dict(to=1)  # ... while rank 1 consolidates
    return str(info.value), time.monotonic() - t0


def test_ranks_in_different_calls_fail_within_the_timeout_naming_each_others_call() -> None:
    # the ranks return their errors, but cannot leave a process group whose collectives broke
    with pytest.raises(LaunchError) as info:
        run_ranks(_mismatch_worker, 2, timeout_s=120, pg_timeout_s=60, grace_s=15)
    (msg0, t0), (msg1, t1) = info.value.results[0], info.value.results[1]  # type: ignore[misc]
    assert "step() #" in msg0 and "failed on rank 0 of 2" in msg0, msg0
    assert "rank 1 was in consolidate_state_dict(to=1)" in msg0, msg0
    assert "consolidate_state_dict(to=1) #" in msg1 and "rank 0 was in step()" in msg1, msg1
    assert max(t0, t1) < 3.0 + 5.0 + 5.0  # the timeout, the grace for reports, some slack


def _killed_worker(rank: int, world_size: int, where: str) -> tuple[str, float]:
    import os
    import signal
    import time

    from zero_functional.comm import CollectiveError

    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01, timeout=20.0)
    train(model, opt, rank, world_size, 1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies before its part of the call
    t0 = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        if where == "step":
            opt.step()
        else:
            opt.consolidate_state_dict(to=0)
    return str(info.value), time.monotonic() - t0


@pytest.mark.parametrize("where", ["step", "consolidate_state_dict"])
def test_a_rank_killed_mid_call_is_named_by_the_survivors(where: str) -> None:
    with pytest.raises(LaunchError, match="rank 1 was killed by signal SIGKILL") as info:
        run_ranks(_killed_worker, 3, where, timeout_s=120, pg_timeout_s=60, grace_s=15)
    for rank in (0, 2):
        message, seconds = info.value.results[rank]  # type: ignore[misc]
        assert f"{where}(" in message and f"failed on rank {rank} of 3" in message, message
        # rank 1 among the silent (a survivor slow to report under load is named with it)
        assert re.search(r"ranks? (\d+, )*1(, \d+)* did not report \(it died", message), message
        assert seconds < 20.0 + 5.0 + 5.0


def _sparse_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hook in ("reduce_scatter_hook", "hook_with_zero_step"):
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Embedding(10, 4, sparse=True)))
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(),
            torch.optim.SparseAdam,
            overlap_with_ddp=hook == "hook_with_zero_step",
            lr=0.1,
        )
        try:  # before: registered, then aten's as_strided failed in backward (overlap: a hang)
            if hook == "reduce_scatter_hook":
                reduce_scatter_hook(ddp, zero)
            else:
                hook_with_zero_step(allreduce_hook, ddp, zero)
            out[hook] = "registered"
        except ValueError as e:
            out[hook] = str(e)
    # the way that works: the step after backward, DDP all-reducing the sparse gradients
    models, opts = [], []
    for sharded in (True, False):
        torch.manual_seed(0)
        models.append(DDP(nn.Sequential(nn.Embedding(10, 4, sparse=True))))
        cls: Any = ZeroRedundancyOptimizer if sharded else torch.optim.SparseAdam
        args = (torch.optim.SparseAdam,) if sharded else ()
        opts.append(cls(models[-1].parameters(), *args, lr=0.1))

    def backward(model: nn.Module, rank: int, world_size: int, step: int) -> None:
        model(torch.tensor([rank, 3 + step, 5])).pow(2).sum().backward()

    train_both(list(zip(models, opts)), rank, world_size, 3, backward)
    out["after backward"] = max_diff(*models)
    return out


def test_sparse_gradients_are_refused_by_the_hooks_on_every_rank_naming_why() -> None:
    """Issue 34, item 7: DDP's buckets of sparse gradients are refused where a hook is made (no
    failure inside aten, no rank left waiting); SparseAdam after backward equals plain DDP's."""
    for out in run_ranks(_sparse_worker, 2, timeout_s=120):
        for hook in ("reduce_scatter_hook", "hook_with_zero_step"):
            message = out[hook]
            assert "submodule(s) '0' (nn.Embedding or nn.EmbeddingBag" in message, message
            assert "dense flat buffers: step after backward without a hook" in message, message
        # Bitwise by construction (two ranks, a sum of two either order; SparseAdam is torch's own
        # class on whole tensors on both sides); the bound is kept.
        assert out["after backward"] <= 1e-6, out


@pytest.mark.parametrize(
    ("flags", "training"),
    [
        (["--nproc", "3", "--overlap", "--checkpoint", "{tmp}/ck"], True),
        (["--nproc", "2"], False),
    ],
    ids=["3 ranks training, overlap, a checkpoint", "2 ranks starting"],
)
def test_ranks_stop_within_2_s_of_the_train_parents_death_under_load(
    flags: list[str], training: bool, tmp_path: Any
) -> None:
    """Issue 34, item 10 and issue 42, item 6: SIGKILL to ``train`` (nothing runs in it) left
    both ranks training, orphaned, ~37 s, then up to 12 s under load; now the kernel kills each
    rank when its launcher dies (``PR_SET_PDEATHSIG``), with or without a SIGTERM handler (a
    checkpoint), while training or still importing torch, with both cores kept busy."""
    import signal
    import sys
    import time

    from tests.dist.test_elastic import tree
    from tests.dist.test_readme import ROOT, env_with_src

    argv = [sys.executable, "-m", "zero_functional", "train", "--epochs", "50"]
    argv += ["--no-reference", "--no-progress", *(f.format(tmp=tmp_path) for f in flags)]
    parent = subprocess.Popen(
        argv, cwd=ROOT, env=env_with_src(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    ranks: list[int] = []
    load: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 120
        while len(_ranks(parent.pid)) < int(flags[1]):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        # both cores kept busy from here to the end: the ranks' start, the kill and the 2 s
        # (not the parent's own start before it, which no assertion times); each spinner says
        # when it spins
        busy = "print(flush=True)\nwhile True: pass"
        load = [
            subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE) for _ in range(2)
        ]
        for spinner in load:
            assert spinner.stdout is not None
            spinner.stdout.readline()
        time.sleep(3 if training else 0)  # training, or still importing torch
        ranks = _ranks(parent.pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        t0 = time.monotonic()
        while any(os.path.exists(f"/proc/{p}") and "Z" not in _state(p) for p in ranks):
            assert time.monotonic() - t0 < 2, [(p, _state(p)) for p in ranks]
            time.sleep(0.05)
    finally:
        for p in [*tree(parent.pid), *ranks, *(spin.pid for spin in load)]:  # orphans too
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _ranks(pid: int) -> list[int]:
    """The ranks that process ``pid`` spawned (not multiprocessing's resource tracker)."""
    from tests.dist.test_elastic import tree

    def cmdline(p: int) -> bytes:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                return f.read()
        except OSError:
            return b""

    return [p for p in tree(pid) if b"spawn_main" in cmdline(p)]


def _state(pid: int) -> str:
    """A process's state letter (``Z``: exited, not yet reaped), or ``""`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _ranked_steps(model: nn.Module, opt: Any, rank: int, steps: int, by_hand: bool) -> None:
    """``steps`` steps on this rank's own batches (different on each rank), gradients averaged
    by hand (``by_hand``) or left to DDP."""
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if by_hand:
            average_grads(model, 2)
        opt.step()


def _unfreeze_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # fine-tuning with hand-averaged gradients: a layer frozen at construction, unfrozen later
    for partition in ("sorted_greedy", "flat"):
        models = [make_model(), make_model()]
        for m in models:
            m[0].requires_grad_(False)
        frozen = models[0][0].weight.detach().clone()
        ours = ZeroRedundancyOptimizer(
            models[0].parameters(), torch.optim.Adam, partition=partition, lr=0.01
        )
        plain = torch.optim.Adam(models[1].parameters(), lr=0.01, **FUSED)
        for model, opt in zip(models, (ours, plain)):
            _ranked_steps(model, opt, rank, 2, by_hand=True)
            model[0].requires_grad_(True)
            _ranked_steps(model, opt, rank, 3, by_hand=True)
        trained = not torch.equal(frozen, models[0][0].weight)
        out[partition] = (max_diff(*models), trained)
    # DDP built while the layer was frozen, plain (no hook) and with reduce_scatter_hook
    for hook in (False, True):
        model = make_model()
        model[0].requires_grad_(False)
        ddp = DDP(model)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
        if hook:
            ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
        _ranked_steps(ddp, zero, rank, 1, by_hand=False)
        model[0].requires_grad_(True)
        before = snapshot(model, zero)
        try:
            _ranked_steps(ddp, zero, rank, 1, by_hand=False)
            out[f"ddp, hook {hook}"] = "stepped"
        except RuntimeError as e:
            out[f"ddp, hook {hook}"] = str(e)
        out[f"ddp, hook {hook}, unchanged"] = unchanged(before, model, zero)
    return out


def test_unfreezing_trains_as_plain_adam_where_averaged_and_is_refused_naming_ddp() -> None:
    """Issue 34, item 5: a layer unfrozen in hand-averaged fine-tuning trains as torch's class
    lets it (equal to plain Adam); under a DDP built while it was frozen, which never averages
    its gradients (plain, or with a hook), the step is refused on every rank, naming DDP."""
    for out in run_ranks(_unfreeze_worker, 2, timeout_s=120):
        for partition in ("sorted_greedy", "flat"):
            diff, trained = out[partition]
            # Both sides average the same gradients (both average through
            # tests.helpers.average_grads) and run the same kernels (a reference Adam is FUSED, the
            # kernel ours runs; SGD and the rest run torch's own on both), so they differ only where
            # a piece cut off a tensor puts elements in a kernel's scalar tail rather than its
            # vector body: a few ulps of an update per step, which move a parameter by one ulp of
            # itself only where they cross a rounding boundary: at most 5 steps x ulp(|p| < 1) =
            # 3e-7 < 1e-6 (|p| < 1, ulp <= 6e-8: these layers start below 0.5 and move little).
            assert diff <= 1e-6 and trained, (partition, out)
        for hook in (False, True):
            message = out[f"ddp, hook {hook}"]
            assert "were frozen" in message and "DDP does not average" in message, message
            assert "(3, 4)" in message and out[f"ddp, hook {hook}, unchanged"], out


def _fp32_reduce_worker(rank: int, world_size: int) -> dict[str, float]:
    """Per mode, the largest relative difference of this rank's fp32 main pieces from a
    reference: plain AdamW on fp32 mains, stepped with the fp32 average of the ranks' bf16
    gradients, its bf16 model the mains rounded; with ``reduce_dtype`` fp32 and bf16."""
    out: dict[str, float] = {}
    for mode in ("reduce_scatter_hook", "hook_with_zero_step", "interleaved"):
        for reduce_dtype in (torch.float32, None):
            model, ref = make_model().to(torch.bfloat16), make_model().to(torch.bfloat16)
            mains = [p.detach().float().clone() for p in ref.parameters()]
            ref_opt = torch.optim.AdamW(mains, lr=1e-3, **FUSED)
            ddp, overlap = DDP(model), mode != "reduce_scatter_hook"
            zero = ZeroRedundancyOptimizer(
                ddp.parameters(),
                torch.optim.AdamW,
                partition="flat",
                overlap_with_ddp=overlap,
                main_params_dtype=torch.float32,
                lr=1e-3,
            )
            wrap = hook_with_zero_step if mode == "hook_with_zero_step" else None
            wrap = hook_with_zero_step_interleaved if mode == "interleaved" else wrap
            hook = (
                reduce_scatter_hook(ddp, zero, reduce_dtype=reduce_dtype)
                if wrap is None
                else wrap(allreduce_hook, ddp, zero, reduce_dtype=reduce_dtype)
            )
            ddp.register_comm_hook(None, hook)
            for step in range(4):
                g = torch.Generator().manual_seed(100 * rank + step)
                x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
                # the reference's forward runs on our bf16 parameters, not on its own mains
                # rounded: a last-bit difference of a main (another AdamW kernel) would flip a
                # bf16 rounding there, and the next gradients would differ at bf16's precision
                with torch.no_grad():
                    for q, p in zip(ref.parameters(), model.parameters()):
                        q.copy_(p)
                for m in (ddp, ref):
                    m.zero_grad()
                    ((m(x.bfloat16()) - y).float() ** 2).mean().backward()
                if not overlap:
                    zero.step()
                for main, p in zip(mains, ref.parameters()):
                    assert p.grad is not None
                    main.grad = p.grad.float() / world_size
                    torch.distributed.all_reduce(main.grad)
                ref_opt.step()
            got = zero.main_params()
            rel = 0.0
            for s in zero.ownership.owned(rank):
                p = list(model.parameters())[s.param]
                want = mains[s.param].reshape(-1)[s.start : s.stop]
                diff = (got[p].reshape(-1) - want).abs().max() / want.abs().max()
                rel = max(rel, diff.item())
            out[f"{mode}, {reduce_dtype}"] = rel
    return out


def test_an_fp32_reduce_updates_the_fp32_mains_from_the_fp32_average_in_every_mode() -> None:
    """Issue 34, item 6: with ``reduce_dtype=torch.float32`` the fp32 main copies follow plain
    AdamW stepped with the fp32 average of the ranks' gradients (not its bf16 rounding), after
    backward with ``reduce_scatter_hook`` and in overlap mode; a bf16 reduce does not."""
    for out in run_ranks(_fp32_reduce_worker, 2, timeout_s=120):
        for mode in ("reduce_scatter_hook", "hook_with_zero_step", "interleaved"):
            # The same gradients on both sides (a sum of two, either order), on the same
            # parameters, the same kernel (torch's fused AdamW): a main can differ only where a
            # piece puts elements in the kernel's scalar tail, at most one ulp (2^-23) of it per
            # step, 4 steps: 4.8e-7 of its scale.
            assert out[f"{mode}, torch.float32"] <= 1e-6, (mode, out)
            assert out[f"{mode}, None"] > 2e-6, (mode, out)


def _job(path: str, value: float, mode: str, made: Any, go: Any, out: Any) -> None:
    """One job of its own (one process, no process group) saving ``value`` to ``path``; the
    second job (``made`` given) pauses once its temporary exists until the first has saved."""
    from zero_functional import checkpoint
    from zero_functional.checkpoint import atomic_dir

    if made is not None:
        make = atomic_dir.make_temporary

        def made_then_wait(target: str) -> str:
            tmp = make(target)
            made.put(tmp)
            go.wait(60)
            return tmp

        atomic_dir.make_temporary = made_then_wait  # type: ignore[assignment]
    store = f"file://{path}-job-{value}"  # this job's own process group, of one rank
    torch.distributed.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    try:
        handle = checkpoint.save(
            path, model=model, blocking=mode != "background", shared=mode != "shared=False"
        )
        if handle is not None:
            handle.wait()
        out.put("saved")
    except checkpoint.CheckpointError as e:
        out.put(str(e))


@pytest.mark.parametrize("mode", ["blocking", "background", "shared=False"])
def test_two_jobs_saving_to_one_path_keep_their_temporaries_and_the_loser_says_so(
    tmp_path: Any, mode: str
) -> None:
    """Issue 34, item 4: job A saves while job B's save to the same path is in progress. A's
    cleanup removed B's temporary (and B's commit then replaced A's checkpoint with what was
    left, or removed it); now B's temporary is its own, B fails naming A's save, and the
    checkpoint there is A's, complete."""
    import multiprocessing

    from zero_functional import checkpoint

    from tests.helpers import PRELOAD

    multiprocessing.set_forkserver_preload(list(PRELOAD))  # as run_ranks: torch imported once
    ctx = multiprocessing.get_context("forkserver")
    path = str(tmp_path / "ckpt")
    made, go, out_a, out_b = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Queue()
    b = ctx.Process(target=_job, args=(path, 2.0, mode, made, go, out_b))
    b.start()
    try:
        tmp_b = made.get(timeout=60)
        a = ctx.Process(target=_job, args=(path, 1.0, "blocking", None, None, out_a))
        a.start()
        assert out_a.get(timeout=60) == "saved"
        a.join(30)
        assert os.path.isdir(tmp_b), "job A's cleanup removed job B's save in progress"
        go.set()
        message = out_b.get(timeout=60)
        b.join(30)
    finally:
        go.set()
        b.join(5)
        if b.is_alive():
            b.kill()
    assert "another save committed" in message and "two jobs are saving to one" in message
    assert re.search(r"\(save [0-9a-f]{12} by process \d+ on ", message), message
    assert len(message) <= 2048, len(message)
    model = nn.Linear(3, 2)
    checkpoint.load(path, model=model)
    assert bool((model.weight == 1.0).all()), model.weight


FULL_DISK_SCRIPT = """
import sys

from tests.helpers import run_ranks
from zero_functional.app import cli, train

train.run_ranks = run_ranks  # ranks forked from a server with torch imported: seconds less

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
"""


FULL_DISK_SAVE_SCRIPT = """
import sys

import torch

from zero_functional.checkpoint import CheckpointError, storage

try:  # 80 KB into 64 KiB: the disk fills inside torch.save's zip writer
    storage.save_pieces(sys.argv[1], {"w": ((20000,), torch.float32, [(0, 20000, torch.ones(20000))])}, {}, None)
except CheckpointError as e:
    print(e)
"""


def _on_a_full_disk(tmp_path: Any, script: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with ``argv`` (``{disk}`` replaced) in a user and mount namespace of its
    own, ``tmp_path / "disk"`` a 64 KiB tmpfs there; skip where no such namespace is allowed."""
    import sys

    from tests.dist.test_readme import ROOT, env_with_src

    disk = tmp_path / "disk"
    disk.mkdir()
    mount = f"mount -t tmpfs -o size=64k tmpfs {disk}"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", mount], capture_output=True, text=True)
    if probe.returncode != 0:  # no user namespaces here: nothing to fill without root
        pytest.skip(f"cannot mount a small tmpfs: {probe.stderr.strip()}")
    (tmp_path / "script.py").write_text(script)
    env = env_with_src()
    env["PYTHONPATH"] += os.pathsep + str(ROOT)  # a script may import tests.helpers
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", f'{mount} && exec "$0" "$@"', sys.executable]
        + [str(tmp_path / "script.py"), *(a.format(disk=disk) for a in argv)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_full_disk_is_named_by_the_save_not_torchs_zip_writer(tmp_path: Any) -> None:
    """Issue 34, item 8, the Python API: the save named torch.save's ``[enforce fail at
    inline_container.cc:672] unexpected pos 704 vs 598``, raised while handling the ENOSPC."""
    done = _on_a_full_disk(tmp_path, FULL_DISK_SAVE_SCRIPT, "{disk}/ckpt")
    message = done.stdout.strip()
    assert "[Errno 28] No space left on device" in message and "enforce" not in message, (
        message,
        done.stderr[-2000:],
    )
    assert re.search(r"rank 0: cannot write \S+/disk/ckpt\.tmp-[0-9a-f]{12}/__0_0\.distcp", message)


def test_a_full_disk_during_train_checkpoint_is_one_line_naming_it(tmp_path: Any) -> None:
    """Issue 34, item 8: ``train --checkpoint`` on a 64 KiB tmpfs printed 30 lines ending in
    ``[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598``; now one line names
    the rank, no space left on device, the file and the checkpoint."""
    argv = ["train", "--nproc", "2", "--epochs", "1", "--save-every", "1", "--hidden", "64"]
    argv += ["--no-progress", "--no-reference", "--checkpoint", "{disk}/ckpt"]
    done = _on_a_full_disk(tmp_path, FULL_DISK_SCRIPT, *argv)
    disk = tmp_path / "disk"
    assert done.returncode == 1, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert re.fullmatch(
        rf"zero-functional train: rank [01]: no space left on device writing {disk}/ckpt\.tmp-"
        rf"[0-9a-f]{{12}}/__[01]_0\.distcp; {disk}/ckpt is unchanged: free space there or pass "
        "another --checkpoint",
        lines[0],
    ), lines[0]


def _lbfgs_worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    model = make_model()
    try:  # before: built, each rank ran its own LBFGS on its own tensors (and could hang)
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS, lr=0.5)
        out["world"] = "built"
    except ValueError as e:
        out["world"] = str(e)
    # at world size 1 (a group of this rank alone) it is plain LBFGS, closure and all
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    models = [make_model(), make_model()]
    zero = ZeroRedundancyOptimizer(
        models[0].parameters(), torch.optim.LBFGS, process_group=alone, lr=0.5
    )
    plain = torch.optim.LBFGS(models[1].parameters(), lr=0.5)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    for m, opt in zip(models, (zero, plain)):
        for _ in range(3):

            def closure(m: nn.Module = m, opt: Any = opt) -> torch.Tensor:
                opt.zero_grad()
                loss = m(x).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)
    out["alone"] = max_diff(*models)
    return out


def test_lbfgs_is_refused_over_several_ranks_on_every_rank_and_runs_alone() -> None:
    """Issue 34, item 9: sharded LBFGS ran its own direction and line search per rank (param
    norm 41,920 where DDP + LBFGS reached 2.50) and hung where the closure counts differed; now
    every rank refuses it at construction, naming why, and alone it equals plain LBFGS."""
    for out in run_ranks(_lbfgs_worker, 2, timeout_s=60):
        message = out["world"]
        assert "LBFGS is registered as 'closure' and cannot be sharded over 2 ranks" in message
        assert "call the closure a different number of times" in message, message
        assert out["alone"] == 0.0, out


def test_a_stopped_rank_is_named_as_the_one_that_stopped_reporting_within_30_s() -> None:
    """Issue 34, item 10: a SIGSTOPped rank was caught only at ``--timeout`` (600 s), and rank 0
    was blamed; now the launcher sees rank 1's process stopped and names it within seconds."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.dist.test_elastic import tree
    from tests.dist.test_readme import ROOT, env_with_src

    argv = [sys.executable, "-m", "zero_functional", "train", "--nproc", "2", "--epochs", "50"]
    argv += ["--no-reference", "--no-progress"]
    parent = subprocess.Popen(
        argv, cwd=ROOT, env=env_with_src(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )

    def ranks() -> list[int]:  # the spawned ranks, in the order they started (not the tracker)
        children = [p for p in tree(parent.pid) if _state(p) and p != parent.pid]
        cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in children}
        return sorted(p for p, c in cmdlines.items() if b"spawn_main" in c)

    stopped: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks()) < 2:
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.2)
        time.sleep(1)  # the ranks are training
        stopped = ranks()[1:]
        os.kill(stopped[0], signal.SIGSTOP)
        out, _ = parent.communicate(timeout=30)  # was: --timeout's 600 s
        text = out.decode(errors="replace")
        assert parent.returncode == 1, text
        assert "rank 1 stopped reporting: its process was stopped" in text, text
        assert "rank 0 was stopped after rank 1 failed" in text, text
    finally:
        for p in [*tree(parent.pid), *stopped]:  # SIGKILL ends a stopped process too
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.wait(timeout=10)
