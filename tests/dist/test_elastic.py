"""Elastic torchrun (issue 32): two agents on this machine (``--nnodes 1:2 --max-restarts 1
--rdzv-backend c10d``) run ``python -m zero_functional train --checkpoint DIR --save-every K``;
one agent is killed mid-run; the survivor's worker restarts at world size 1, resumes from the
last complete checkpoint (the one saved before the kill: every item's checksum is verified as it
loads) and finishes. The job also asks for in-memory snapshots (issue 43), none of which is taken
before the kill: the restart says it resumes from the disk instead."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zero_functional.app.launch import free_port

from tests.dist.test_readme import env_with_src
from tests.helpers import ROOT

TIMEOUT_S = 240


def agent(port: int, checkpoint: Path, log: Path, snapshots: Path) -> subprocess.Popen[str]:
    """One torchrun agent of the elastic job (one worker), its output into ``log``; a snapshot
    every 1,000 steps into ``snapshots`` (its node's memory): none before the job's 184th."""
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
        "--rdzv-conf", "last_call_timeout=15,join_timeout=90,keep_alive_interval=1,keep_alive_max_attempt=2",
        "-m", "zero_functional", "train", "--epochs", "8", "--batch-size", "64",
        "--checkpoint", str(checkpoint), "--save-every", "10",
        "--snapshot-every", "1000", "--snapshot-dir", str(snapshots),
        "--no-reference", "--no-progress",
    ]  # fmt: skip
    with open(log, "w") as out:
        return subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env_with_src(),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(pid: int) -> None:
    for p in tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def saves(text: str) -> list[tuple[int, int]]:
    return [(int(e), int(s)) for e, s in re.findall(r"saved \S+ at epoch (\d+) step (\d+)", text)]


def test_an_agent_killed_mid_run_leaves_the_survivor_to_resume_and_finish(tmp_path: Any) -> None:
    port, ck = free_port(), tmp_path / "ck"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    # the first agent hosts the rendezvous store, so it is the one that stays; the first round
    # waits last_call_timeout (15 s) for the second agent, however slowly this machine starts it
    survivor = agent(port, ck, logs[0], tmp_path / "node0")
    time.sleep(3)
    doomed = agent(port, ck, logs[1], tmp_path / "node1")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        # kill the second agent (and its worker) once two checkpoints are committed at 2 ranks
        while len(saves(logs[0].read_text() + logs[1].read_text())) < 2:
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            assert survivor.poll() is None and doomed.poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        kill_tree(doomed.pid)  # the agent and its worker, as a node that goes away
        doomed.wait(timeout=30)
        code = survivor.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in (survivor, doomed):
            kill_tree(proc.pid)
    text = logs[0].read_text()
    assert code == 0, text[-4000:]
    # torchrun's default lends its store to the workers: rank 0 warned that a restart at the same
    # world size would fail (pytorch#135712); at world size 1 this one does not need to connect
    assert "lends its store to the workers" in text + logs[1].read_text(), text[-3000:]
    # the restarted worker found no complete snapshot and resumed from the disk checkpoint
    before, _, after = text.partition(
        f"restart 1: no complete in-memory snapshot; resuming from {ck}"
    )
    assert after, text[-4000:]
    saved_before = saves(before + logs[1].read_text())
    assert saved_before, before[-2000:]
    # it resumed at a checkpoint saved at 2 ranks, then saved again at 1 and finished
    assert "over Adam, 1 rank(s)" in after, after[-3000:]
    assert saves(after) and saves(after)[0] > saved_before[-1], (saved_before, saves(after))
