"""Run a function on several gloo ranks on 127.0.0.1, with a timeout so a hang fails in seconds.

Each spawn costs seconds, so a test runs many cases inside one call: the worker gets
``(rank, world_size, *args)`` and returns a picklable value, and :func:`run_ranks` returns the
list of per-rank results (rank order) or raises with every failing rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world_size: int,
    port: int,
    pg_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        # plain pickle bytes: tensors through torch's queue go by shared memory, which breaks
        # once this process has exited
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = 30.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(rank, world_size, port, pg_timeout_s, fn, args, queue),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = queue.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            if ok:
                results[rank] = pickle.loads(value)
            else:
                failures[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    missing = [r for r in range(world_size) if r not in results and r not in failures]
    if failures or missing:
        lines = [f"rank {r} failed:\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            lines.append(f"ranks {missing} gave no result within {timeout_s:.0f}s (hang or crash)")
        raise AssertionError("\n".join(lines))
    return [results[r] for r in range(world_size)]
