"""A link with a bandwidth: a benchmark re-run in a private network namespace (``unshare -rn``)
whose loopback ``tc`` shapes with a token bucket, so that bytes cost what they cost on a network.
Every rank on 127.0.0.1 shares that one link: a collective's floor is the bytes all ranks send
together over the rate (:func:`byte_floor_ms`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

LINK_ENV = "ZERO_FUNCTIONAL_LINK"  # the rate, inside the shaped namespace: no second re-run

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def rate_bits(rate: str) -> float:
    """Bits per second of a ``tc`` rate written as ``<number><k|m|g|t>bit`` (``2gbit``).

    Example:
        >>> rate_bits("2gbit"), rate_bits("500mbit")
        (2000000000.0, 500000000.0)
        >>> rate_bits("2GB")
        Traceback (most recent call last):
        ...
        ValueError: link rate '2GB': write it as tc does, a number and kbit, mbit, gbit or tbit (e.g. 2gbit, 10gbit)
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", rate.strip().lower())
    if m is None or float(m[1]) <= 0:
        raise ValueError(
            f"link rate {rate!r}: write it as tc does, a number and kbit, mbit, gbit or tbit "
            "(e.g. 2gbit, 10gbit)"
        )
    return float(m[1]) * _UNITS[m[2]]


def byte_floor_ms(total_bytes: float, rate: str) -> float:
    """The least time ``total_bytes`` (what every rank sends, together) take on a ``rate`` link.

    Example:
        >>> byte_floor_ms(32e6, "2gbit")  # 2 ranks reducing 32 MB onto owners: 32 MB in all
        128.0
    """
    return total_bytes * 8 / rate_bits(rate) * 1e3


def shaped_command(rate: str, argv: Sequence[str]) -> list[str]:
    """The command that runs ``argv`` in a private network namespace, its loopback at ``rate``.

    Example:
        >>> shaped_command("2gbit", ["python", "bench.py"])[:2]
        ['unshare', '-rn']
        >>> shaped_command("2gbit", ["python", "bench.py"])[-1].split(" && ")[1]
        'tc qdisc add dev lo root tbf rate 2gbit burst 256kb latency 200ms'
    """
    rate_bits(rate)  # a bad rate fails here, not inside the namespace
    setup = (
        f"ip link set lo up && tc qdisc add dev lo root tbf rate {rate} burst 256kb latency 200ms"
    )
    return ["unshare", "-rn", "sh", "-c", f"{setup} && exec {shlex.join(argv)}"]


def link_banner(rate: str) -> str:
    """The first line a benchmark prints on a shaped link.

    Example:
        >>> link_banner("2gbit")[:30]
        'link: 2gbit (2 Gbit/s), the lo'
    """
    return (
        f"link: {rate} ({rate_bits(rate) / 1e9:g} Gbit/s), the loopback of a private network "
        "namespace shaped with tc tbf (burst 256kb, latency 200ms), shared by every rank; "
        "byte floor = bytes all ranks send / rate"
    )


def run_shaped(rate: str | None, argv: Sequence[str] | None = None) -> None:
    """Re-run this program (``argv``, default ``sys.argv``) on a ``rate`` link and exit with its
    status; return at once when ``rate`` is None or this process runs shaped (after printing
    :func:`link_banner`). Where namespaces or ``tc`` are not allowed, one line says why, exit 2.

    Example:
        >>> run_shaped(None)  # unshaped: nothing to do
    """
    if rate is None:
        return
    if os.environ.get(LINK_ENV) == rate:
        print(link_banner(rate), flush=True)
        return
    argv = list(argv) if argv is not None else [sys.executable, *sys.argv]
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    why = f"{', '.join(missing)} not found" if missing else ""
    if not why:
        probe = subprocess.run(
            shaped_command(rate, ["true"]), capture_output=True, text=True, check=False
        )
        lines = (probe.stderr or probe.stdout).strip().splitlines()
        if probe.returncode != 0:
            why = lines[-1] if lines else f"status {probe.returncode}"
    if why:
        print(f"--link {rate}: cannot shape a private loopback here ({why})", file=sys.stderr)
        raise SystemExit(2)
    env = {**os.environ, LINK_ENV: rate}
    raise SystemExit(subprocess.run(shaped_command(rate, argv), env=env, check=False).returncode)
