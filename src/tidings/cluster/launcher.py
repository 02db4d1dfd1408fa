"""LocalCluster: a private etcd plus N `tidings broker` child processes on loopback.

`start()` returns once etcd answers and every broker has printed its READY line (it prints it
only after it serves gRPC and its member key is in etcd). `stop()` sends SIGTERM to each broker
(graceful hand-off), then SIGKILL after a timeout, then stops etcd: children are always stopped
by PID, and `kill(i)` sends SIGKILL to one broker for fault tests.

A LocalCluster that starts its own etcd owns it: before starting brokers it clears the member keys
left under its root by an earlier run (killed before its brokers could revoke their leases, which
etcd restored on restart), so brokers of the same ids start at once instead of waiting those
leases out. A cluster on someone else's etcd (`etcd=`) touches nothing there. A child that fails
to start raises ClusterError with one line: what the child last said, and where its log is.
Brokers get SIGTERM if the launching thread dies, even by SIGKILL (`die_with_parent`). A cluster's
`auth_keys` reach its brokers through their environment (TIDINGS_AUTH_KEYS), never their command line
(which `ps` shows to every user).
"""

from __future__ import annotations

import concurrent.futures
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import uvloop

from tidings.allocator.keys import members_prefix
from tidings.cluster.etcd import ClusterError, EtcdProcess, die_with_parent, endpoint_of, free_port, last_line
from tidings.keyspace.etcd import Etcd
from tidings.member.serving import WILDCARDS
from tidings.protocol.status import UsageError
from tidings.tls import TLS

DEFAULT_ROOT = "/tidings/cluster"
_NOT_INHERITED = frozenset(
    {
        "TIDINGS_ADVERTISE",
        "TIDINGS_REPLICATION_ADVERTISE",
        "TIDINGS_METRICS_ADVERTISE",
        "TIDINGS_AUTH_KEYS",
        "TIDINGS_AUTH_KEYS_FILE",
    }
)


class BrokerProcess:
    """One `tidings broker` child process."""

    def __init__(
        self,
        etcd: str,
        zone: str,
        suffix: str,
        port: int,
        data_dir: Path,
        extra: list[str],
        root: str = DEFAULT_ROOT,
        listen_host: str = "127.0.0.1",
        advertise_host: str = "",
        wrap: tuple[str, ...] = (),
        auth_keys: str = "",
    ) -> None:
        """`wrap` runs the broker through another command (`ip netns exec NS`: a test's host); `auth_keys`
        (--auth-keys' text) go to it in its environment."""
        self.zone, self.suffix, self.port = zone, suffix, port
        self.auth_keys = auth_keys
        self.listen = endpoint_of(listen_host, port)
        self.endpoint = endpoint_of(advertise_host or listen_host, port)  # what it announces; clients dial it
        if advertise_host:
            extra = ["--advertise", self.endpoint, *extra]
        self.metrics_endpoint = ""  # where it serves /metrics, from its READY line
        self.data_dir = data_dir
        self.args = [
            *wrap,
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
            self.listen,
            "--data-dir",
            str(data_dir),
            "--root",
            root,
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "broker.log", "ab")
        argv, preexec = die_with_parent(self.args)
        # (each broker announces what it was told, and holds the cluster's keys: a TIDINGS_ADVERTISE or
        # TIDINGS_AUTH_KEYS* of the caller's is no broker's)
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        if self.auth_keys:
            env["TIDINGS_AUTH_KEYS"] = self.auth_keys
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec,
            env=env,
        )
        log.close()
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = last_line(self.data_dir / "broker.log")
                raise ClusterError(
                    f"broker {self.suffix} exited with {self.proc.returncode} at start ({said or 'no output'}); "
                    f"see {self.data_dir / 'broker.log'}"
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                buf += os.read(self.proc.stdout.fileno(), 4096)
                if b"READY" in buf and b"\n" in buf[buf.index(b"READY") :]:
                    words = buf[buf.index(b"READY") :].split(b"\n", 1)[0].decode().split()
                    if "METRICS" in words[:-1]:  # READY HOST:PORT [METRICS HOST:PORT]
                        self.metrics_endpoint = words[words.index("METRICS") + 1]
                    return self
        self.kill()
        raise ClusterError(f"broker {self.suffix} not ready within {timeout:g}s; see {self.data_dir / 'broker.log'}")

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
    """etcd + N brokers over Z zones; broker i listens on `port + i` (0: free ports), and serves /metrics
    on `metrics_port + i` (0: its own choice, see `tidings broker --metrics`).

    Everything listens on `listen_host` (127.0.0.1; `::1`, or a routable address to reach the cluster
    from other hosts); a wildcard one (0.0.0.0, ::) needs `advertise_host`, the address etcd and each
    broker announce (each broker's `--advertise`). With `auth_keys` (--auth-keys' text) every broker
    verifies tokens with them. With `tls` (a certificate, its key, a CA) the brokers serve mutual TLS
    and the cluster's own etcd serves TLS only, requiring client certificates (the same ones)."""

    def __init__(
        self,
        brokers: int = 3,
        zones: int = 1,
        data_dir: str | Path = "data",
        port: int = 0,
        etcd: str | None = None,
        root: str = DEFAULT_ROOT,
        metrics_port: int = 0,
        listen_host: str = "127.0.0.1",
        advertise_host: str = "",
        auth_keys: str = "",
        tls: TLS | None = None,
    ) -> None:
        self.auth_keys, self.tls = auth_keys, tls
        if listen_host.strip("[]") in WILDCARDS and not advertise_host:
            raise UsageError(
                f"a cluster listening on {listen_host} would announce addresses nobody can dial: "
                "pass --advertise-host HOST (the address other hosts reach this one at)"
            )
        self.listen_host, self.advertise_host = listen_host.strip("[]"), advertise_host.strip("[]")
        self.data_dir = Path(data_dir).resolve()
        self.n, self.zones, self.port = brokers, zones, port
        self.metrics_port = metrics_port  # broker i serves /metrics on it + i (0: each its port + 1000, or any)
        self.root = root
        self.etcd_proc: EtcdProcess | None = None
        self.etcd_endpoint = etcd
        self.brokers: list[BrokerProcess] = []
        self.extra: list[str] = []
        self.cleared = 0  # stale member keys of an earlier run removed at start

    @property
    def store_url(self) -> str:
        return f"file://{self.data_dir / 'fragments'}/"

    def broker(self, i: int) -> BrokerProcess:
        port = self.port + i if self.port else free_port(self.listen_host)
        zone = f"zone-{chr(ord('a') + i % self.zones)}"
        assert self.etcd_endpoint is not None
        extra = ["--default-store", self.store_url, *self.extra]  # journals without stores persist here
        if self.tls is not None:
            paths = {flag: str(Path(p).resolve()) for flag, p in self.tls.paths.items()}
            extra += [arg for flag, path in paths.items() for arg in (flag, path)]
            if self.etcd_proc is not None:  # (its own etcd: TLS too, the same certificate as a client's)
                extra += [arg for flag, path in paths.items() for arg in (flag.replace("--tls", "--etcd-tls"), path)]
        if self.metrics_port:
            extra = ["--metrics", endpoint_of(self.listen_host, self.metrics_port + i), *extra]
        return BrokerProcess(
            self.etcd_endpoint,
            zone,
            f"broker-{i}",
            port,
            self.data_dir / f"broker-{i}",
            extra,
            self.root,
            self.listen_host,
            self.advertise_host,
            auth_keys=self.auth_keys,
        )

    def start(self) -> LocalCluster:
        try:
            if self.etcd_endpoint is None:
                self.etcd_proc = EtcdProcess(
                    self.data_dir / "etcd", host=self.listen_host, advertise_host=self.advertise_host, tls=self.tls
                ).start()
                self.etcd_endpoint = self.etcd_proc.endpoint
                self.cleared = _run_async(_clear_members(self.etcd_endpoint, self.root, self.tls))
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


_T = TypeVar("_T")


async def _clear_members(endpoint: str, root: str, tls: TLS | None = None) -> int:
    """Revoke the leases of every member key under ``root`` and delete the keys; their number.

    Only for an etcd this cluster owns and before its brokers start: any member there is stale.
    """
    prefix = members_prefix(root)
    etcd = await Etcd.connect(endpoint, tls=tls)
    try:
        kvs, _ = await etcd.get_prefix(prefix)
        for lease in {kv.lease for kv in kvs if kv.lease}:
            await etcd.revoke_lease(lease)
        if kvs:
            await etcd.delete_prefix(prefix)
        return len(kvs)
    finally:
        await etcd.aclose()


def _run_async(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine to completion from sync code, even when this thread already runs a loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(uvloop.run, coro).result()


async def broker_endpoints(etcd_endpoint: str, root: str = DEFAULT_ROOT) -> list[str]:
    """The endpoints of the brokers announced in etcd under `root` (`cluster up`'s by default): a
    program given only a cluster's etcd finds its brokers there."""
    from tidings.protocol import protocol_pb2 as pb

    etcd = await Etcd.connect(etcd_endpoint)
    try:
        kvs, _ = await etcd.get_prefix(members_prefix(root))
    finally:
        await etcd.aclose()
    found = []
    for kv in kvs:
        spec = pb.BrokerSpec()
        try:
            spec.ParseFromString(kv.value)
        except Exception:  # (not a broker's announcement: skip it)
            continue
        if spec.endpoint and not spec.exiting:
            found.append(spec.endpoint)
    return found
