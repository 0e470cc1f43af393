"""``train --snapshot-every K`` under elastic torchrun (issue 43): a worker SIGKILLed mid-run, or a
whole agent with its snapshot directory (a node gone), and the job resumes from the in-memory
snapshot, bitwise where an uninterrupted run (or 2 ranks to step S, then 1 from a checkpoint of
step S) would be. Without a complete snapshot the disk checkpoint is used, and said: the agent
lost in ``tests/dist/test_elastic.py``, whose job takes none before it.

One machine stands in for two nodes: each agent gets its own ``--snapshot-dir``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zero_functional import checkpoint
from zero_functional.app.launch import free_port
from zero_functional.app.train import build_model

from tests.dist.test_elastic import kill_tree, tree
from tests.dist.test_readme import env_with_src
from tests.helpers import ROOT, forked_train_ranks, run_cli

TIMEOUT_S = 240
EPOCHS = 6  # 23 steps each (1,438 digits, batches of 64)
JOB = ["--epochs", str(EPOCHS), "--no-reference", "--no-progress", "--save-every", "100000"]


def final(path: Path) -> list[torch.Tensor]:
    """A train checkpoint's model and Adam state, read in this process."""
    model = build_model(128)
    adam = torch.optim.Adam(model.parameters())
    checkpoint.load(path, model=model, optimizer=adam)
    state = [s[k] for s in adam.state_dict()["state"].values() for k in sorted(s)]
    return [p.detach() for p in model.parameters()] + state


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def steps_in(directory: Path) -> list[int]:
    """The snapshot steps a node's directory holds now."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [int(m[1]) for n in names if (m := re.match(r"^step-(\d+)$", n))]


def torchrun(args: list[str], job: list[str], log: Path) -> subprocess.Popen[str]:
    """torchrun as docs/launchers.md says to run it: with its store not shared with the
    workers, without which a restart at the same world size reads the last round's addresses
    (pytorch#135712: the workers' gloo fails to connect)."""
    argv = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "zero_functional"]
    with open(log, "w") as out:
        return subprocess.Popen(
            [*argv, "train", *job],
            cwd=ROOT,
            # one thread per worker, as `train --nproc` gives its ranks: the same arithmetic
            env={
                **env_with_src(),
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "OMP_NUM_THREADS": "1",
            },
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


def worker(agent: int, rank: int) -> int:
    """The pid of ``agent``'s worker of global rank ``rank``."""
    for pid in tree(agent)[1:]:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
            return pid
    raise AssertionError(f"agent {agent} has no worker of rank {rank}: {tree(agent)}")


def wait_for_snapshot(dirs: list[Path], at_least: int, procs: list[Any], log: Path) -> None:
    """Until a node holds a complete snapshot of ``at_least`` steps or more: its older ones
    are gone (they go once a newer one is on both copies)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not any(min(steps_in(d), default=-1) >= at_least for d in dirs):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
        time.sleep(0.05)


def test_a_worker_killed_mid_run_resumes_from_memory_bitwise(
    tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    snaps, ck, log = tmp_path / "snaps", tmp_path / "ck", tmp_path / "run.log"
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    job = [*JOB, "--checkpoint", str(ck), "--snapshot-every", "10", "--snapshot-dir", str(snaps)]
    agent = torchrun(args, job, log)
    try:
        wait_for_snapshot([snaps], 30, [agent], log)
        assert not ck.exists()  # no disk checkpoint before the end
        os.kill(worker(agent.pid, 1), 9)
        code = agent.wait(timeout=TIMEOUT_S)
    finally:
        kill_tree(agent.pid)
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "lends its store" not in text  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: no warning
    found = re.findall(r"resumed from the in-memory snapshot of step (\d+)", text)
    assert found and int(found[0]) >= 30 and int(found[0]) % 10 == 0, text[-4000:]
    assert not snaps.exists(), os.listdir(snaps)  # the job ended well: removed
    # the summary counts the restarted run's snapshots (a busy one skipped)
    taken, due = map(
        int, re.search(r"in-memory snapshots: (\d+) taken of (\d+) due", text).groups()
    )
    assert 1 <= taken <= due, text[-3000:]
    forked_train_ranks(monkeypatch)
    ref = tmp_path / "ref"
    argv = ["train", "--nproc", "2", *JOB, "--checkpoint", str(ref)]
    assert run_cli(argv, capsys)[0] == 0
    assert same(final(ck), final(ref))


def test_a_node_gone_leaves_the_survivor_its_copy_and_it_finishes_alone(
    tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    port, ck = free_port(), tmp_path / "ck"
    dirs, logs = [tmp_path / "node0", tmp_path / "node1"], [tmp_path / "a.log", tmp_path / "b.log"]
    rdzv = [
        "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "snaps",
        "--rdzv-conf", "last_call_timeout=15,join_timeout=90,keep_alive_interval=1,keep_alive_max_attempt=2",
    ]  # fmt: skip
    job = [*JOB, "--checkpoint", str(ck), "--snapshot-every", "23"]  # at each epoch's end
    survivor = torchrun(rdzv, [*job, "--snapshot-dir", str(dirs[0])], logs[0])
    time.sleep(3)  # the first agent hosts the rendezvous store: it is the one that stays
    doomed = torchrun(rdzv, [*job, "--snapshot-dir", str(dirs[1])], logs[1])
    try:
        wait_for_snapshot(dirs, 46, [survivor, doomed], logs[0])
        kill_tree(doomed.pid)  # the agent and its worker, as a node that goes away
        doomed.wait(timeout=30)
        for entry in dirs[1].glob("*"):
            subprocess.run(["rm", "-rf", str(entry)], check=True)  # and its memory with it
        code = survivor.wait(timeout=TIMEOUT_S)
    finally:
        for proc in (survivor, doomed):
            kill_tree(proc.pid)
    text = logs[0].read_text()
    assert code == 0, text[-4000:]
    found = re.findall(r"resumed from the in-memory snapshot of step (\d+)", text)
    assert found and int(found[0]) >= 46, text[-4000:]
    assert "over Adam, 1 rank(s)" in text.split("resumed from")[-1], text[-3000:]
    # the same: 2 ranks to step S, a checkpoint there, then 1 rank from it
    forked_train_ranks(monkeypatch)
    epochs, two, one = int(found[0]) // 23, tmp_path / "two", tmp_path / "one"
    two_ranks = ["train", "--nproc", "2", "--epochs", str(epochs), "--no-reference"]
    assert run_cli([*two_ranks, "--no-progress", "--checkpoint", str(two)], capsys)[0] == 0
    argv = ["train", "--nproc", "1", *JOB, "--resume", str(two), "--checkpoint", str(one)]
    assert run_cli(argv, capsys)[0] == 0
    assert same(final(ck), final(one))
