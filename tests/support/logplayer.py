"""LogPlayer test support: what each target should have applied (the WAL read committed), what it
did apply (its apply log), and target / LogPlayer child processes stopped by PID."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import apsw

from tidings.auth import Authorizer
from tidings.client import AsyncClient
from tidings.logplayer.player import last_acks
from tidings.logplayer.wal import Targets, WalEntry
from tidings.message.iterators import ReadCommitted
from tidings.protocol import protocol_pb2 as pb

from .waiting import wait_until

REPO = Path(__file__).resolve().parent.parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}


async def expected_parts(client: AsyncClient, wal: str, targets: Targets) -> dict[str, list[int]]:
    """Per target, the indices of the WAL entries (read committed) with a part for it, in order."""
    out: dict[str, list[int]] = {t: [] for t in targets.ids}
    async for env in ReadCommitted(client, wal, message_type=WalEntry, block=False, on_garbage=lambda _j, _g: None):
        for t, mutations in env.message.parts.items():
            if t in out and mutations:  # (an empty part is no part)
                out[t].append(env.begin)
    return out


def applied_log(db: Path) -> list[int]:
    """The indices a target applied, in apply order (its `applied` table)."""
    conn = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return [r[0] for r in conn.execute("SELECT idx FROM applied ORDER BY seq")]
    finally:
        conn.close()


async def wait_delivered(
    client: AsyncClient, wal: str, targets: Targets, timeout: float = 60.0, auth: Authorizer | None = None
) -> dict[str, list[int]]:
    """Wait until every target acknowledged its last entry of the WAL; the expected indices. (`auth`: what
    the targets' GetLastAck takes, when they hold keys; TLS as `client`'s.)"""
    expected = await expected_parts(client, wal, targets)

    async def done() -> bool:
        answers = await last_acks(targets, tls=client.tls, auth=auth)
        return all(
            isinstance(a, pb.LastAckResponse) and (not expected[t] or a.last_applied >= expected[t][-1])
            for t, a in answers.items()
        )

    await wait_until(done, timeout, interval=0.05)
    return expected


class Procs:
    """`tidings target serve` and `tidings logplayer run` children by name, each logging to a file."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def log(self, name: str) -> Path:
        return self.data_dir / f"{name}.log"

    async def start(self, name: str, args: list[str], timeout: float = 60.0) -> str:
        """Start `tidings ARGS` as `name`; its READY line."""
        proc = self.procs[name] = _spawn(args, self.log(name))
        assert proc.stdout is not None
        try:
            line = (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout)).decode()
        except TimeoutError:
            line = ""
        assert line.startswith("READY"), (name, line, self.log(name).read_text()[-3000:])
        return line

    async def start_target(self, target: str, endpoint: str, *flags: str) -> None:
        """`tidings target serve` of `target` on `endpoint` with an apply log (and `flags`)."""
        db = self.data_dir / f"{target}.sqlite"
        await self.start(
            target, ["target", "serve", "--id", target, "--listen", endpoint, "--db", str(db), "--log-applied", *flags]
        )

    async def signal(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name] if sig in (signal.SIGSTOP, signal.SIGCONT) else self.procs.pop(name)
        proc.send_signal(sig)
        if sig not in (signal.SIGSTOP, signal.SIGCONT):
            await asyncio.to_thread(proc.wait, 60)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.wait(30)
        self.procs.clear()


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    """`tidings ARGS` writing its stderr to `log` (a quick, local call: fine on the event loop)."""
    with log.open("ab") as f:
        return subprocess.Popen([sys.executable, "-m", "tidings.cli", *args], stdout=subprocess.PIPE, stderr=f, env=ENV)
