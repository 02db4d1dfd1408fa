"""LocalCluster: a private etcd plus N `tidings broker` child processes on loopback.

`start()` returns once etcd answers and every broker has printed its READY line (it prints it
only after it serves gRPC and its member key is in etcd). `stop()` sends SIGTERM to each broker
(graceful hand-off), then SIGKILL after a timeout, then stops etcd: children are always stopped
by PID, and `kill(i)` sends SIGKILL to one broker for fault tests.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from tidings.cluster.etcd import EtcdProcess, die_with_parent, free_port


class BrokerProcess:
    """One `tidings broker` child process."""

    def __init__(self, etcd: str, zone: str, suffix: str, port: int, data_dir: Path, extra: list[str]) -> None:
        self.zone, self.suffix, self.port = zone, suffix, port
        self.endpoint = f"127.0.0.1:{port}"
        self.data_dir = data_dir
        self.args = [
            sys.executable,
            "-m",
            "tidings.cli",
            "broker",
            "--etcd",
            etcd,
            "--zone",
            zone,
            "--id",
            suffix,
            "--listen",
            self.endpoint,
            "--data-dir",
            str(data_dir),
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "broker.log", "ab")
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        log.close()
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker {self.suffix} exited with {self.proc.returncode}; see {self.data_dir}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                buf += os.read(self.proc.stdout.fileno(), 4096)
                if b"READY" in buf:
                    return self
        self.kill()
        raise TimeoutError(f"broker {self.suffix} not ready within {timeout}s; see {self.data_dir}/broker.log")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout: float = 60.0) -> None:
        """SIGTERM (graceful: journals move away first), SIGKILL if it overstays."""
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class LocalCluster:
    """etcd + N brokers over Z zones; broker i listens on `port + i` (0: free ports)."""

    def __init__(
        self, brokers: int = 3, zones: int = 1, data_dir: str | Path = "data", port: int = 0, etcd: str | None = None
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.n, self.zones, self.port = brokers, zones, port
        self.etcd_proc: EtcdProcess | None = None
        self.etcd_endpoint = etcd
        self.brokers: list[BrokerProcess] = []
        self.extra: list[str] = []

    @property
    def store_url(self) -> str:
        return f"file://{self.data_dir / 'fragments'}/"

    def broker(self, i: int) -> BrokerProcess:
        port = self.port + i if self.port else free_port()
        zone = f"zone-{chr(ord('a') + i % self.zones)}"
        assert self.etcd_endpoint is not None
        return BrokerProcess(self.etcd_endpoint, zone, f"broker-{i}", port, self.data_dir / f"broker-{i}", self.extra)

    def start(self) -> LocalCluster:
        try:
            if self.etcd_endpoint is None:
                self.etcd_proc = EtcdProcess(self.data_dir / "etcd").start()
                self.etcd_endpoint = self.etcd_proc.endpoint
            (self.data_dir / "fragments").mkdir(parents=True, exist_ok=True)
            for i in range(self.n):
                self.brokers.append(self.broker(i).start())
        except BaseException:
            self.stop()
            raise
        return self

    def add_broker(self) -> BrokerProcess:
        b = self.broker(len(self.brokers)).start()
        self.brokers.append(b)
        return b

    @property
    def endpoints(self) -> list[str]:
        return [b.endpoint for b in self.brokers if b.alive()]

    def stop(self) -> None:
        """Stop every child by PID, brokers in parallel (SIGTERM first), then etcd."""
        live = [b for b in self.brokers if b.alive()]
        for b in live:
            assert b.proc is not None
            b.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for b in live:
            assert b.proc is not None
            try:
                b.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                b.kill()
        if self.etcd_proc is not None:
            self.etcd_proc.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
