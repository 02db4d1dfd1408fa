"""What the benchmark scripts share: journals on a LocalCluster, JSON lines, the event loop, child
processes and their CPU and memory."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Coroutine, Iterator
from typing import Any

import uvloop

from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict


def emit(rec: dict, **defaults: Any) -> dict:
    """Print one measurement as a JSON line (the peers' harness uses the same fields)."""
    rec = {"system": "tidings", **defaults, **rec}
    print(json.dumps(rec), flush=True)
    return rec


async def create_journal(
    c: AsyncClient,
    lc: LocalCluster,
    name: str,
    replication: int,
    labels: dict[str, str] | None = None,
    fragment_length: str = "256MiB",
) -> None:
    """Create a journal (256 MiB fragments unless told) and return once it takes appends."""
    spec = spec_from_dict(
        {
            "name": name,
            "replication": replication,
            "labels": labels or {},
            "fragment": {"length": fragment_length, "stores": [lc.store_url]},
        }
    )
    await c.apply([pb.ApplyRequest.Change(upsert=spec)])
    await c.append(name, b"")  # a zero-byte barrier: retried until the journal has its primary


async def primary_endpoint(c: AsyncClient, name: str) -> str:
    j = next(j for j in (await c.list()).journals if j.spec.name == name)
    return j.route.endpoints[j.route.primary]


def run(main: Coroutine[Any, Any, None]) -> None:
    uvloop.run(main)


CLK_TCK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT = 20.0  # seconds for a child process to print its endpoint


@contextlib.contextmanager
def child_processes(argvs: list[list[str]], what: str, sigterm: bool = False) -> Iterator[list[tuple[str, int]]]:
    """Start one child per argv (each prints its endpoint, or READY, on a line, and stops when its
    stdin closes, or on SIGTERM if `sigterm`); yield [(that line, pid)]; stop them all by PID,
    whatever happens."""
    procs: list[subprocess.Popen] = []
    try:
        for argv in argvs:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    start_new_session=True,  # a Ctrl-C reaches only us; we stop the children
                )
            )
        started = []
        for p in procs:
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], START_TIMEOUT)
            line = p.stdout.readline().strip() if ready else ""
            if not line:
                raise RuntimeError(f"{what} (pid {p.pid}) printed no endpoint (exit status {p.poll()})")
            started.append((line, p.pid))
        yield started
    finally:
        for p in procs:  # closing stdin (or SIGTERM) asks each to stop; then by PID, harder
            with contextlib.suppress(OSError):
                p.stdin.close()  # type: ignore[union-attr]
            if sigterm and p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            with contextlib.suppress(OSError):
                p.stdout.close()  # type: ignore[union-attr]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc; resolution 1/CLK_TCK."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0
