"""Ray Train, for real (issue 32): ``TorchTrainer`` with 2 CPU workers, the model from
``ray.train.torch.prepare_model``, our optimizer after backward, with ``reduce_scatter_hook`` and in
overlap mode. Each worker saves only its own files (``checkpoint.save(..., shared=False)``) into a
local directory and reports it; Ray merges them; the run resumes from
``ray.train.get_checkpoint()`` at 1 worker (where ``prepare_model`` leaves the module as it is),
reading both workers' files, with the optimizer state bitwise equal to what was saved, and
continues. No shared file system is assumed. (Resuming at more workers is ``checkpoint.load``'s
own: ``tests/dist/test_checkpoint.py``; a third ``fit`` here cost 20 s of CPU.)

Two ``fit()`` calls of one Ray instance (about 15-30 s each here): every mode runs inside each.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

MODES = ("after backward", "reduce_scatter_hook", "overlap")
STEPS = 3  # per fit


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def digest(state: dict[str, Any]) -> str:
    """A fingerprint of a consolidated state dict's tensors, bitwise (and its groups)."""
    h = hashlib.sha256(repr(state["param_groups"]).encode())
    for k in sorted(state["state"]):
        for key, v in sorted(state["state"][k].items()):
            h.update(f"{k}.{key}".encode())
            h.update(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_loop(config: dict[str, Any]) -> None:
    """Each worker: per mode, a model (``prepare_model``: DDP on gloo) and our optimizer, resumed
    from Ray's checkpoint if there is one; ``STEPS`` steps; a save of its own files; a report."""
    import ray.train as rt
    import ray.train.torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_functional import checkpoint
    from zero_functional.hooks import hook_with_zero_step_interleaved, reduce_scatter_hook
    from zero_functional.optimizer import ZeroRedundancyOptimizer

    ctx = rt.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    given = rt.get_checkpoint()
    local = tempfile.mkdtemp(prefix=f"rank{rank}-")
    metrics: dict[str, Any] = {"world": world}
    for mode in MODES:
        ddp = ray.train.torch.prepare_model(Net())
        if not isinstance(ddp, DDP):  # at one worker prepare_model leaves the module as it is
            ddp = DDP(ddp)
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(),
            torch.optim.Adam,
            partition="flat",
            lr=0.01,
            overlap_with_ddp=mode == "overlap",
        )
        if mode == "overlap":
            ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
        elif mode == "reduce_scatter_hook":
            ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
        start = 0
        if given is not None:
            with given.as_directory() as merged:
                extra = checkpoint.load(os.path.join(merged, mode), model=ddp, optimizer=zero)
            start = extra["step"]
            zero.consolidate_state_dict(to=0)
            metrics[f"{mode} loaded"] = digest(zero.state_dict()) if rank == 0 else ""
        for step in range(start, start + STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(12, 6, generator=g), torch.randn(12, 2, generator=g)
            lo, hi = 12 * rank // world, 12 * (rank + 1) // world
            zero.zero_grad()
            nn.functional.mse_loss(ddp(x[lo:hi]), y[lo:hi]).backward()
            if mode != "overlap":
                zero.step()
        zero.finish_param_sync()
        extra = {"step": start + STEPS}
        checkpoint.save(
            os.path.join(local, mode), model=ddp, optimizer=zero, extra=extra, shared=False
        )
        zero.consolidate_state_dict(to=0)
        metrics[f"{mode} saved"] = digest(zero.state_dict()) if rank == 0 else ""
        metrics[f"{mode} files"] = sorted(os.listdir(os.path.join(local, mode)))
        dist.barrier()
    rt.report(metrics, checkpoint=rt.Checkpoint.from_directory(local))


def test_ray_train_saves_per_worker_and_resumes_at_other_worker_counts(tmp_path: Any) -> None:
    # imported here, not at collection: Ray (with pandas) is over a second of each xdist
    # worker's CPU, and only the worker that runs this test needs it
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.train.torch")
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")
    # an actor per fit that polls the cluster for nodes being drained: this one-node cluster
    # is never drained (each actor is a Python interpreter: about 1.5 s of CPU)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        storage = str(tmp_path / "ray")

        def fit(workers: int, name: str, **config: Any) -> Any:
            trainer = TorchTrainer(
                train_loop,
                train_loop_config=config,
                scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                run_config=RunConfig(storage_path=storage, name=name),
            )
            return trainer.fit()

        first = fit(2, "a")
        merged = sorted(os.listdir(os.path.join(first.checkpoint.path, "after backward")))
        for mode in MODES:
            # each worker wrote only its own, uniquely named files, with its own manifest
            assert first.metrics[f"{mode} files"] == [
                ".metadata",
                ".metadata.crc32",
                ".rank-0-of-2.json",
                ".zero_functional-save",
                "__0_0.distcp",
            ], first.metrics
        assert {".rank-1-of-2.json", "__1_0.distcp", "__0_0.distcp"} <= set(merged), merged
        fewer = fit(1, "a")  # the same run: ray.train.get_checkpoint() is the merged one
        assert fewer.metrics["world"] == 1
        for mode in MODES:
            assert fewer.metrics[f"{mode} loaded"] == first.metrics[f"{mode} saved"], mode
            assert fewer.metrics[f"{mode} saved"] != first.metrics[f"{mode} saved"], mode
    finally:
        ray.shutdown()
