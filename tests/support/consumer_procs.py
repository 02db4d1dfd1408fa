"""`tidings consumer` child processes for tests: started, killed and stopped by PID."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from tidings.consumer.client import ShardClient
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TransportError

REPO = Path(__file__).resolve().parent.parent.parent


class ConsumerProcs:
    """`tidings consumer` children serving `app` (module:factory), by id; `env` adds to their environment;
    `exit_timeout` is their --exit-timeout (how long a SIGTERM waits for its shards to move away)."""

    def __init__(
        self, cluster, root: str, data_dir: Path, app: str, env: dict[str, str] | None = None, exit_timeout: float = 20
    ) -> None:
        self.cluster, self.root, self.data_dir, self.app = cluster, root, data_dir, app
        self.env = env or {}
        self.exit_timeout = exit_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.endpoints: dict[str, str] = {}

    @property
    def broker(self) -> str:
        return self.cluster.brokers[0].endpoint

    async def start(self, suffix: str, zone: str, env: dict[str, str] | None = None) -> str:
        """Start a consumer; returns its endpoint once it printed READY."""
        cmd = [sys.executable, "-m", "tidings.cli", "consumer", "--app", self.app,
               "--etcd", self.cluster.etcd_endpoint, "--broker", self.broker,
               "--root", self.root, "--data-dir", str(self.data_dir / "shards"), "--id", suffix, "--zone", zone,
               "--listen", "127.0.0.1:0", "--metrics", "", "--lease-ttl", "2",
               "--exit-timeout", f"{self.exit_timeout:g}"]  # fmt: skip
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), **self.env,
                   **(env or {})}  # fmt: skip
        self.data_dir.mkdir(parents=True, exist_ok=True)
        proc = self.procs[suffix] = _spawn(cmd, environ, self.data_dir / f"{suffix}.log")
        assert proc.stdout is not None
        line = (await asyncio.to_thread(proc.stdout.readline)).decode()  # (the brokers may run on this loop)
        assert line.startswith("READY "), (line, self.log(suffix)[-2000:])
        self.endpoints[suffix] = line.split()[1]
        return self.endpoints[suffix]

    def log(self, suffix: str) -> str:
        return (self.data_dir / f"{suffix}.log").read_text(errors="replace")

    async def kill(self, suffix: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(suffix)
        self.endpoints.pop(suffix)
        proc.send_signal(sig)
        await asyncio.to_thread(proc.wait, 60)

    async def wait_exit(self, suffix: str, timeout: float) -> int:
        """The exit code of a consumer that ends by itself (within `timeout` seconds)."""
        proc = self.procs.pop(suffix)
        self.endpoints.pop(suffix)
        return await asyncio.to_thread(proc.wait, timeout)

    def live(self) -> list[str]:
        return [e for suffix, e in self.endpoints.items() if self.procs[suffix].poll() is None]

    async def shards(self) -> list[pb.ShardListResponse.Shard] | None:
        """The shards as a live consumer lists them (None if none answers)."""
        for endpoint in self.live():
            try:
                async with ShardClient(endpoint) as sc:
                    return list((await sc.list()).shards)
            except TransportError:  # (it exited just now)
                continue
        return None

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(30)
        self.procs.clear()
        self.endpoints.clear()


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A child writing its stderr to `log` (a quick, local call: fine on the event loop)."""
    with log.open("ab") as f:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, env=env)
