"""Teardown (issue 20, item 5): after destroy_process_group, nothing of this package is alive or
in flight, and a program that then exits normally is not aborted by a gloo thread."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional.hooks import hook_with_zero_step_interleaved, overlap_state
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.dist.exit_stress import CASES, run_round
from tests.helpers import run_ranks

# A user's script: the optimizer's module imported at the top, the group made after it.
_SCRIPT = """
import tempfile, weakref
import torch
import torch.distributed as dist
from torch import nn
from zero_functional import ZeroRedundancyOptimizer

torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
group = weakref.ref(dist.group.WORLD)
model = nn.Linear(1, 1)
opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
model(torch.ones(4, 1)).sum().backward()
opt.step()
dist.destroy_process_group()
del opt, model
print("freed" if group() is None else "alive")
"""


def test_destroy_process_group_frees_the_default_group_and_its_gloo_threads() -> None:
    # torch.optim.Optimizer's constructor imports torch._dynamo and with it
    # torch.distributed.nn.functional, whose `group=group.WORLD` defaults would hold the
    # default group (and its threads) to interpreter exit had the package not imported it first
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "freed"


def _dropped_overlap(rank: int, world_size: int) -> list[bool]:
    model = DDP(nn.Linear(4, 4))
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1, overlap_with_ddp=True
    )
    model.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, model, zero))
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
    zero.finish_param_sync()  # else the next forward's hook, registered globally, holds `zero`
    state = overlap_state(zero)
    if state is None or state.gather_group is zero.process_group:
        raise RuntimeError("no twin group to watch")  # not an assert: pytest's would hold it
    twin = state.gather_group
    refs: list[weakref.ref[Any]] = [weakref.ref(zero), weakref.ref(state), weakref.ref(twin)]
    del model, zero, state
    dist.destroy_process_group(twin)  # what the user's destroy_process_group() does to it
    del twin
    gc.collect()
    return [r() is None for r in refs]


def test_an_overlap_hook_keeps_neither_its_optimizer_nor_its_twin_group_alive() -> None:
    # forked from the tests' forkserver (no interpreter exit is tested here): what holds the
    # optimizer after destroy_process_group holds it in a forked rank as in a spawned one
    assert run_ranks(_dropped_overlap, 2, timeout_s=120) == [[True, True, True]] * 2


ROUNDS = int(os.environ.get("EXIT_STRESS_ROUNDS", "8"))
"""Rounds of :func:`test_two_ranks_started_and_stopped_many_times_never_abort`: 8 in ``make
test`` (each of the 4 cases twice, imported before ``init_process_group`` and after it), 60
under ``make stress``. Each round spawns two fresh interpreters (about 8 s of CPU): 12 rounds
were a tenth of ``make test``'s CPU and kept it over its 10 minutes. A regression that aborts 1
round in 10 (the rarest rate seen before the fix) fails a run with probability 0.57 at 8 rounds
(0.72 at 12, 0.998 at 60); one that aborts 1 in 5, 0.83."""


def test_two_ranks_started_and_stopped_many_times_never_abort() -> None:
    # Plain mp.spawn, each rank ending with destroy_process_group and a normal interpreter
    # exit; every case (the program and FairScale's), the package imported before and
    # after init_process_group. Before the fix 4 to 9 rounds in 40 of the program
    # aborted, and 3 to 6 in 15 of each of FairScale's.
    seen = [
        (case, late, run_round("ours", case, late=late, timeout_s=120))
        for i in range(ROUNDS)
        for case, late in [(CASES[i % len(CASES)], (i // len(CASES)) % 2 == 1)]
    ]
    failed = [s for s in seen if s[2] != "ok"]
    assert not failed, (
        f"{len(failed)} of {ROUNDS} rounds failed (case, imported late, how): {failed}"
    )
