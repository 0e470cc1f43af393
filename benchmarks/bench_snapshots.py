"""In-memory snapshots (issue 43): what ``checkpoint.snapshot`` after every step costs, and what it saves.

Three measurements:

* **cost per step**: whole iterations (forward, backward, ``step()``) of DDP + ours (Adam,
  ``partition="flat"``, ``reduce_scatter_hook``) on gloo ranks, round by round in the same ranks:
  ``--iterations`` without a snapshot, then as many with ``checkpoint.snapshot(...)`` after each
  step (the snapshot directory under ``/dev/shm``), then as many with each snapshot waited for
  (untimed) before the next iteration. ``snapshot() returns, none in flight`` is the time the
  call blocks the caller's thread when the previous snapshot has ended (the copy of this rank's
  share); ``snapshot() returns, every step`` the same called after every step (a call made while
  the previous snapshot is still being taken on some rank is skipped on every rank, the default
  ``when_busy="skip"``: the line after the table says how many were taken, and the steps
  between them); ``iteration, snapshot every step``
  is forward + backward + step while the snapshot threads write, send and remove behind it (on 2
  shared cores they compete with training); ``iteration + snapshot(), every step`` is the loop's
  whole slowdown. Each is over
  the iteration without snapshots measured in the same rounds (issue 43 asks <= 5% for the
  first). Models: the demo job's MLP (``train``'s ``build_model(128)``: 64 -> 128 -> 128 -> 10,
  a global batch of 64 digit-sized rows) and the 8 x Linear(512, 512) MLP of the other
  benchmarks (a batch of 32 per rank).
* **host memory per rank**: the bytes of the files of a rank's share and of the copy of another
  rank's share it keeps (read from the snapshot directory), beside its optimizer state's.
* **recovery** (``--no-recovery`` leaves it out): ``train`` under ``torchrun --max-restarts 1``,
  2 workers; one SIGKILLed, and the time from the kill to rank 0's ``resumed from ...`` line of
  the restarted job, and to the job's end, with ``--snapshot-every`` against the disk checkpoint
  of ``--save-every`` alone; the steps the restarted job resumed from.

Times are medians of the slowest rank (the mean for ``snapshot()`` called after every step,
where a few calls are taken and most skipped).

    PYTHONPATH=src python benchmarks/bench_snapshots.py [--world-sizes 2 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import median_ms, mlp, run_ranks
from zero_functional import checkpoint
from zero_functional.app.train import build_model
from zero_functional.hooks import reduce_scatter_hook
from zero_functional.optimizer import ZeroRedundancyOptimizer

ROOT = Path(__file__).resolve().parents[1]
PLAIN = "iteration, no snapshot"
FINISH = "the step's all-gather awaited first"
COPY = "snapshot() returns, none in flight"
SNAP_CALL = "snapshot() returns, every step (mean)"
SNAP_ITER = "iteration, snapshot every step"
BOTH = "iteration + snapshot(), every step"
MEMCPY = "the share's tensors copied alone (floor)"
HELD = "the next update, held for the thread's copy"
CALLER = "caller's thread in all: returns + held"
VARIANTS = (PLAIN, FINISH, COPY, HELD, CALLER, MEMCPY, SNAP_CALL, SNAP_ITER, BOTH)
TARGET = 0.05  # issue 43: the caller's-thread cost <= 5% of an iteration
DEMO_BATCH, MLP_BATCH = 64, 32


def _model(name: str, numel: int) -> tuple[nn.Module, int, int]:
    """The model, its input width and its batch per rank (at 2 ranks for the demo's)."""
    if name == "demo":
        torch.manual_seed(0)
        return build_model(128), 64, DEMO_BATCH
    width = 512
    return mlp(numel, width=width), width, MLP_BATCH


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _worker(
    rank: int, world_size: int, name: str, numel: int, rounds: int, iterations: int, root: str
) -> dict[str, Any]:
    torch.set_num_threads(1)
    module, width, batch = _model(name, numel)
    if name == "demo":
        batch = max(1, batch // world_size)  # the global batch of 64, split
    ddp = DDP(module)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, partition="flat", lr=1e-4)
    ddp.register_comm_hook(None, reduce_scatter_hook(ddp, opt))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g)

    def iteration() -> None:
        out: Tensor = ddp(x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    where = os.path.join(root, "snaps")
    step = 0
    for _ in range(3):  # warm-up: buckets, the copies' group, the staging buffers
        iteration()
        step += 1
        checkpoint.snapshot(model=module, optimizer=opt, step=step, snapshot_dir=where)
    checkpoint.snapshot(model=module, optimizer=opt, step=step + 1, snapshot_dir=where).wait()
    step += 1
    # the floor of the copy: the same tensors (state over the pieces, the pieces' values) copied
    # into buffers made once, with no layout around them
    params = list(module.parameters())
    sources = [
        t for _, s in opt.shard_state().values() for t in s.values() if isinstance(t, Tensor)
    ]
    sources += [
        params[k].detach().reshape(-1)[p.start : p.stop] for k, (p, _) in opt.shard_state().items()
    ]
    buffers = [torch.empty_like(t) for t in sources]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    taken: list[bool] = []  # each every-step call: taken (or skipped, its thread busy)
    last = step
    for _ in range(rounds):
        dist.barrier()
        for _ in range(iterations):
            t0 = time.perf_counter()
            iteration()
            times[PLAIN].append(time.perf_counter() - t0)
            step += 1
        dist.barrier()
        handles = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            iteration()
            t1 = time.perf_counter()
            step += 1
            handle = checkpoint.snapshot(model=module, optimizer=opt, step=step, snapshot_dir=where)
            t2 = time.perf_counter()
            handles.append(handle)
            times[SNAP_ITER].append(t1 - t0)
            times[SNAP_CALL].append(t2 - t1)
            times[BOTH].append(t2 - t0)
        handles[-1].wait()  # the next iterations run without its thread (and all have ended)
        taken += [not h.skipped for h in handles]
        dist.barrier()
        for _ in range(iterations):  # the copy alone: each snapshot waited for, untimed
            iteration()
            step += 1
            # snapshot() first waits for the parameters' all-gather the step left in flight
            # (the next forward would wait for it too): timed apart from the copy
            t0 = time.perf_counter()
            opt.finish_param_sync()
            t1 = time.perf_counter()
            handle = checkpoint.snapshot(model=module, optimizer=opt, step=step, snapshot_dir=where)
            last = step  # the newest snapshot's step, whose files are measured below
            times[FINISH].append(t1 - t0)
            times[COPY].append(time.perf_counter() - t1)
            iteration()  # its update waits for the thread's copy of the optimizer's part
            step += 1
            times[HELD].append(handle.held_s)
            times[CALLER].append(times[COPY][-1] + handle.held_s)
            handle.wait()
            t0 = time.perf_counter()
            for buffer, source in zip(buffers, sources):
                buffer.copy_(source)
            times[MEMCPY].append(time.perf_counter() - t0)
    dist.barrier()
    share = Path(where) / f"step-{last}" / f"share-{rank}-of-{world_size}"
    copies = list((Path(where) / f"step-{last}").glob(f"copy-*-of-{world_size}"))
    held: dict[str, Any] = {"share": _bytes(share)}
    # the copies this rank keeps: on one node they all sit in the one directory; rank q's copy is
    # kept by the rank it was sent to (snapshots.peers' partner), the same size as q's share
    held["copies_all"] = sum(_bytes(c) for c in copies)
    state = sum(
        t.numel() * t.element_size()
        for _, s in opt.shard_state().values()
        for t in s.values()
        if isinstance(t, Tensor)
    )
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    out = {"times": times, "held": held, "state_bytes": state, "param_bytes": params}
    return {**out, "taken": taken}


def _cost(
    name: str, label: str, ws: int, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], bool]:
    root = tempfile.mkdtemp(prefix="zf-bench-snapshots-", dir="/dev/shm")
    try:
        work = (name, args.numel, args.rounds, args.iterations, root)
        results = run_ranks(_worker, ws, *work, timeout_s=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ms = {v: max(median_ms(r["times"][v]) for r in results) for v in VARIANTS}
    # called after every step, most calls are skipped and a few taken: the mean is the cost
    # per step (the median would be the skipped calls')
    ms[SNAP_CALL] = max(statistics.mean(r["times"][SNAP_CALL]) * 1e3 for r in results)
    base = ms[PLAIN]
    print(
        f"\n== {label}, world size {ws}: {args.rounds} rounds of {args.iterations} iterations "
        "each way, medians of the slowest rank"
    )
    print(f"{'':<40}{'ms':>9}{'x iteration':>13}")
    rows = []
    for v in VARIANTS:
        print(f"{v:<40}{ms[v]:>9.2f}{ms[v] / base:>12.3f}x")
        rows.append(
            {
                "benchmark": f"snapshots ({label})",
                "world_size": ws,
                "variant": v,
                "ms": ms[v],
                "vs_torch_best": ms[v] / base,  # here: x the iteration without snapshots
            }
        )
    met = True
    for v in (CALLER, SNAP_CALL):
        cost = ms[v] / base
        met = met and cost <= TARGET
        print(
            f"issue 43: {v} on the caller's thread {cost:.1%} of an iteration "
            f"(<= {TARGET:.0%}): {'met' if cost <= TARGET else 'NOT met'}"
        )
    taken = results[0]["taken"]  # the ranks agree on each call
    print(
        f"snapshot() called after every step: {sum(taken)} of {len(taken)} calls taken (the "
        f"rest skipped, a thread busy): one every {len(taken) / max(sum(taken), 1):.1f} steps"
    )
    print(f"the loop with a snapshot every step: {ms[BOTH] / base - 1:+.1%}")
    mib = 2**20
    print(f"host memory per rank, MiB: {'share':>8}{'copy kept':>11}{'together':>10}", end="")
    print(f"{'Adam state':>12}{'x state':>9}{'params':>9}")
    copies_all = max(r["held"]["copies_all"] for r in results)
    for rank, r in enumerate(results):
        # each share has one copy, kept by one other rank: on average a rank keeps one of
        # the same size; reported as the directory's copies over the ranks
        share, copy = r["held"]["share"], copies_all / ws
        together = share + copy
        print(
            f"  rank {rank:<24}{share / mib:>8.2f}{copy / mib:>11.2f}{together / mib:>10.2f}"
            f"{r['state_bytes'] / mib:>12.2f}{together / max(r['state_bytes'], 1):>8.2f}x"
            f"{r['param_bytes'] / mib:>9.2f}"
        )
    return rows, met


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _worker_pid(agent: int, rank: int) -> int | None:
    for pid in _children(agent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def _recovery(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One torchrun job of ``train``; a worker SIGKILLed once a save (disk) or a complete
    snapshot of ``args.kill_after`` steps or more exists; what the restart took."""
    tmp = Path(tempfile.mkdtemp(prefix="zf-bench-recovery-", dir="/dev/shm"))
    ck, snaps, log = tmp / "ck", tmp / "snaps", tmp / "run.log"
    job = ["--epochs", str(args.epochs), "--no-reference", "--no-progress", "--checkpoint", str(ck)]
    job += ["--save-every", str(args.save_every)]
    if mode == "snapshots":
        job += ["--snapshot-every", str(args.snapshot_every), "--snapshot-dir", str(snaps)]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    argv += ["2", "--max-restarts", "1", "-m", "zero_functional", "train", *job]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    out: dict[str, Any] = {"mode": mode}
    with open(log, "w") as sink:
        agent = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        saved = re.compile(r"saved \S+ at epoch (\d+) step (\d+)")
        per_epoch = 23  # 1,438 digits in batches of 64

        def reached() -> int:
            if mode == "snapshots":
                steps = [int(m[1]) for n in os.listdir(snaps) if (m := re.match(r"step-(\d+)$", n))]
                return min(steps, default=-1) if snaps.exists() else -1  # older go when complete
            got = saved.findall(log.read_text())
            return max((int(e) * per_epoch + int(s) for e, s in got), default=-1)

        deadline = time.monotonic() + 300
        while True:
            try:
                at = reached()
            except FileNotFoundError:
                at = -1
            if at >= args.kill_after:
                break
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: no kill point reached\n{log.read_text()[-3000:]}")
            time.sleep(0.01)
        pid = _worker_pid(agent.pid, 1)
        if pid is None:
            raise RuntimeError(f"{mode}: no worker of rank 1 under {agent.pid}")
        out["known_at_kill"] = at
        before = len(log.read_text())
        t_kill = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        pattern = re.compile(r"(resumed from the in-memory snapshot of step \d+|restart 1: [^\n]*)")
        while (found := pattern.search(log.read_text()[before:])) is None:
            if agent.poll() is not None or time.perf_counter() - t_kill > 300:
                raise RuntimeError(f"{mode}: no resume line\n{log.read_text()[-3000:]}")
            time.sleep(0.005)
        out["to_resumed_s"] = time.perf_counter() - t_kill
        out["line"] = found[1]
        code = agent.wait(timeout=600)
        out["to_end_s"] = time.perf_counter() - t_kill
        text = log.read_text()
        if code != 0:
            raise RuntimeError(f"{mode}: the job failed ({code})\n{text[-3000:]}")
        if mode == "snapshots":
            out["resumed_step"] = int(found[1].rsplit(" ", 1)[1])
        else:  # the disk checkpoint: the last save before the kill
            got = saved.findall(text[:before])
            out["resumed_step"] = max(int(e) * per_epoch + int(s) for e, s in got)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (5)")
    ap.add_argument("--iterations", type=int, default=10, help="iterations each way per round")
    ap.add_argument(
        "--numel", type=int, default=8 * 512 * 512, help="the MLP's size: numel // 512**2 layers"
    )
    ap.add_argument("--models", nargs="+", choices=("demo", "mlp"), default=["demo", "mlp"])
    ap.add_argument("--no-recovery", action="store_true", help="leave out the torchrun restarts")
    ap.add_argument("--epochs", type=int, default=20, help="recovery: the job's epochs (20)")
    ap.add_argument("--snapshot-every", type=int, default=5, help="recovery: --snapshot-every (5)")
    ap.add_argument("--save-every", type=int, default=50, help="recovery: --save-every (50)")
    ap.add_argument(
        "--kill-after", type=int, default=120, help="recovery: kill once this step is kept (120)"
    )
    ap.add_argument("--json", help="also write the rows as JSON to this path")
    args = ap.parse_args()
    command = shlex.join(["python", "benchmarks/bench_snapshots.py", *sys.argv[1:]])
    print(f"$ PYTHONPATH={os.environ.get('PYTHONPATH', '')} {command}")
    print(f"torch {torch.__version__}, gloo, {os.cpu_count()} CPU cores, snapshots in /dev/shm")
    labels = {
        "demo": "demo MLP 64-128-128-10 + Adam",
        "mlp": f"{args.numel // 512**2} x Linear(512, 512) MLP + Adam",
    }
    rows: list[dict[str, Any]] = []
    for name in args.models:
        for ws in args.world_sizes:
            got, _ = _cost(name, labels[name], ws, args)
            rows += got
    if not args.no_recovery:
        print(
            f"\n== recovery: train --epochs {args.epochs} under torchrun (2 workers, "
            "--max-restarts 1), rank 1 SIGKILLed once a save/snapshot of step "
            f">= {args.kill_after} is kept"
        )
        print(
            f"{'':<36}{'kill -> resumed s':>18}{'kill -> end s':>15}{'known at kill':>15}"
            f"{'resumed at':>12}{'lost at most':>14}"
        )
        for mode, every, what in (
            ("snapshots", args.snapshot_every, f"--snapshot-every {args.snapshot_every}"),
            ("disk", args.save_every, f"--save-every {args.save_every} alone"),
        ):
            r = _recovery(mode, args)
            print(
                f"{what:<36}{r['to_resumed_s']:>18.2f}{r['to_end_s']:>15.2f}"
                f"{r['known_at_kill']:>15}{r['resumed_step']:>12}{every:>14}"
            )
            print(f"  rank 0 said: {r['line']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
