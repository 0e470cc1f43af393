"""Where a rank of ``train`` stands when a cluster started it: torchrun, SLURM or a PyTorchJob.

Pure: the environment in, a :class:`ClusterRank` out, or ``None`` (``train`` spawns its own
ranks). The first that applies wins: ``RANK`` and ``WORLD_SIZE`` (torchrun, also under srun;
a PyTorchJob's pod, local rank 0), then srun's one task per process (``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_STEP_ID``; without srun a batch script's ``train`` spawns its own),
whose ``MASTER_ADDR`` is, unless set, the first host of ``SLURM_JOB_NODELIST`` and whose
``MASTER_PORT`` is :func:`slurm_port` of the job id (every task derives the same).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

SLURM_PORT_BASE, SLURM_PORT_SPAN = 29500, 2000  # torchrun's default port; how many job ids spread


class ClusterError(ValueError):
    """The launcher's variables are incomplete or inconsistent; the message names them."""


@dataclass(frozen=True, slots=True)
class ClusterRank:
    """This process's place in a job a cluster launcher started; ``source`` names the launcher
    for messages (``"torchrun"``, ``"SLURM"``, ``"RANK/WORLD_SIZE (a PyTorchJob)"``)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size and 0 <= self.local_rank < self.world_size):
            raise ClusterError(
                f"{self.source}: rank {self.rank} and local rank {self.local_rank} must be "
                f"from 0 to world size - 1 ({self.world_size - 1})"
            )
        if not 0 < self.master_port < 2**16:
            raise ClusterError(f"{self.source}: MASTER_PORT {self.master_port} is not a port")


_GROUP = re.compile(r"\[([^\[\]]*)\]")


def _expand_one(pattern: str) -> list[str]:
    """The hosts of one pattern with any number of bracket groups, in scontrol's order."""
    m = _GROUP.search(pattern)
    if m is None:
        return [pattern]
    values: list[str] = []
    for part in m.group(1).split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ClusterError(f"host list range {part!r} in {pattern!r} is not N or N-M")
        width = len(lo)  # node[01-10]: zero padded to the first bound's digits
        last = int(hi) if sep else int(lo)
        if last < int(lo):
            raise ClusterError(f"host list range {part!r} in {pattern!r} runs backwards")
        values += [f"{i:0{width}d}" for i in range(int(lo), last + 1)]
    head = pattern[: m.start()]
    return [f"{head}{v}{rest}" for v in values for rest in _expand_one(pattern[m.end() :])]


def expand_hostlist(text: str) -> list[str]:
    """The host names of a SLURM host list, as ``scontrol show hostnames`` prints them.

    Example:
        >>> expand_hostlist("a1,b[2-3]"), expand_hostlist("node[01-02,07]")
        (['a1', 'b2', 'b3'], ['node01', 'node02', 'node07'])
        >>> expand_hostlist("rack[1-2]-gpu[8-9]")
        ['rack1-gpu8', 'rack1-gpu9', 'rack2-gpu8', 'rack2-gpu9']
    """
    entries = [e.strip() for e in re.split(r",(?![^\[]*\])", text)]  # commas outside brackets
    for entry in entries:
        if not entry:
            raise ClusterError(f"host list {text!r} is malformed (an empty entry)")
        if {"[", "]"} & set(_GROUP.sub("", entry)):
            raise ClusterError(f"unbalanced brackets in host list entry {entry!r}")
    return [host for entry in entries for host in _expand_one(entry)]


def slurm_port(job_id: int) -> int:
    """The ``MASTER_PORT`` every task of SLURM job ``job_id`` derives when none is set (two jobs
    on one node collide only if their ids are ``SLURM_PORT_SPAN`` apart).

    Example:
        >>> slurm_port(123456), slurm_port(123457)
        (30956, 30957)
    """
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def _int(env: Mapping[str, str], name: str, source: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ClusterError(f"{source}: {name}={env[name]!r} is not an integer") from None


def cluster_rank(env: Mapping[str, str]) -> ClusterRank | None:
    """This process's place in a job a launcher started, from ``env``; ``None`` if none did.

    Raises:
        ClusterError: A launcher's variables are there but incomplete or inconsistent.

    Example:
        >>> slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
        ...          "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1"}
        >>> cluster_rank(slurm)
        ClusterRank(rank=3, world_size=4, local_rank=1, master_addr='gpu07', master_port=29501, source='SLURM')
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        torchrun = "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env
        source = "torchrun" if torchrun else "RANK/WORLD_SIZE (a PyTorchJob)"
        if missing := [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]:
            raise ClusterError(f"{source}: RANK and WORLD_SIZE are set but not {missing}")
        names, addr = ("RANK", "WORLD_SIZE", "LOCAL_RANK"), env["MASTER_ADDR"]
    elif all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID")):
        source, names = "SLURM", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        addr = env.get("MASTER_ADDR", "")
        if not addr and not env.get("SLURM_JOB_NODELIST"):
            raise ClusterError("SLURM: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set")
        addr = addr or expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        if not env.get("MASTER_PORT") and not env.get("SLURM_JOB_ID"):
            raise ClusterError("SLURM: neither MASTER_PORT nor SLURM_JOB_ID is set")
    else:
        return None
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT", source)
    else:  # SLURM's job id: every task derives the same
        port = slurm_port(_int(env, "SLURM_JOB_ID", source))
    rank, world_size, local_rank = (_int(env, n, source) if n in env else 0 for n in names)
    return ClusterRank(rank, world_size, local_rank, addr, port, source)  # no local rank: 0


def elastic_resume(
    checkpoint: str | None,
    resume: str | None,
    env: Mapping[str, str],
    rank: int = 0,
    say: bool = True,
) -> str | None:
    """What a job resumes from: ``resume``; else, when torchrun restarted the workers (a node
    left or failed) and the job's own ``checkpoint`` is there, that checkpoint, at the world
    size the restart gave (rank 0 says so, unless ``say`` is false: an in-memory snapshot may
    win).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> elastic_resume(d, None, {}) is None
        True
        >>> elastic_resume(d, None, {"TORCHELASTIC_RESTART_COUNT": "1"}, rank=1) == d
        True
    """
    restarts = restart_count(env)
    if resume is not None or restarts < 1 or checkpoint is None:
        return resume
    if not os.path.exists(checkpoint):
        return None  # no checkpoint was committed before the restart: start over
    if rank == 0 and say:
        print(f"restart {restarts}: resuming from {checkpoint}", flush=True)
    return checkpoint


def restart_count(env: Mapping[str, str]) -> int:
    """How many times torchrun has restarted this worker's group (0: its first start).

    Example:
        >>> restart_count({}), restart_count({"TORCHELASTIC_RESTART_COUNT": "2"})
        (0, 2)
    """
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restart_hazard(env: Mapping[str, str]) -> str | None:
    """Why torchrun's restarts of these workers may fail, or ``None``: torch 2.13's agent lends
    its rendezvous store to the workers (``TORCHELASTIC_USE_AGENT_STORE``), and a restart at the
    same world size reads the previous round's addresses (pytorch#135712).

    Example:
        >>> print(restart_hazard({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}))
        torchrun lends its store to the workers: a restart at the same world size fails to connect (pytorch#135712); launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
        >>> restart_hazard({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"})
    """
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not shared or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1:
        return None
    return (
        "torchrun lends its store to the workers: a restart at the same world size fails to "
        "connect (pytorch#135712); launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    )
