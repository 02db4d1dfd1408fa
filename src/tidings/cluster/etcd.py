"""A private etcd child process on loopback, for `tidings cluster up`, the demo and tests.

Restarted on the same data dir, etcd keeps its keys *and its leases*, each with its TTL restored:
keys leased by processes of an earlier run live on for one more TTL. `LocalCluster` clears its
own brokers' stale member keys for that reason.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tidings.protocol.status import TidingsError, UsageError

if TYPE_CHECKING:  # (annotations only: tidings.tls imports grpc)
    from tidings.tls import TLS


class ClusterError(TidingsError, RuntimeError):
    """A child process of a local cluster did not start; the message names it and its log."""


def last_line(path: Path) -> str:
    """The last non-empty line of a log file ('' if none): what a child said before it exited."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def endpoint_of(host: str, port: int) -> str:
    """HOST:PORT, an IPv6 literal in brackets and in its shortest form (`[::1]:8080`)."""
    from tidings.tls import canonical_endpoint  # (here: tidings.tls imports grpc, which this module does not need)

    bare = host.strip("[]")
    return canonical_endpoint(f"[{bare}]:{port}") if ":" in bare else f"{bare}:{port}"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


_HANDED_OUT: set[int] = set()  # ports free_port gave, by this process
_HANDED_OUT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on `host` for a server that may restart on it; callers bind it soon after.

    It is drawn below the kernel's ephemeral range, so no outgoing connection and no port-0 listener
    (a broker's replication port, say) can take it while its owner is down between restarts. A port is
    handed out once per process: twenty targets drawn before any of them listens must not share one.
    """
    host = host.strip("[]")
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(10_000, low) if low > 11_000 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            bound: int = s.getsockname()[1]  # (host, port[, flow, scope]) of an AF_INET(6) socket
        with _HANDED_OUT_LOCK:
            if bound in _HANDED_OUT:
                continue
            _HANDED_OUT.add(bound)
        return bound
    raise ClusterError(f"no free TCP port on {host}")


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `host:port` now. A port held only by connections in TIME-WAIT
    (its last server stopped a moment ago) is free, as it is to gRPC's and etcd's SO_REUSEADDR
    listeners; one another socket listens on is not."""
    host = host.strip("[]")
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where /proc does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
    """Stop a child by PID: `sig`, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def die_with_parent(argv: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """``(argv, preexec_fn)`` for a child that gets SIGTERM if its parent dies (Linux ``PR_SET_PDEATHSIG``).

    Children run in their own session so Ctrl-C reaches them only through our orderly stop; this
    makes sure a parent killed outright (SIGKILL, CI timeout) still leaves nothing running. The
    signal fires when the *thread* that forked exits, so it is armed only from the main thread.
    util-linux's ``setpriv --pdeathsig`` arms it when present: no Python runs between fork and
    exec then, which a ``preexec_fn`` does, and that is unsafe in a process with other threads
    (a gRPC client's, say: an etcd child forked so was seen dying of SIGSEGV before its exec).
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return argv, None
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "TERM", "--", *argv], None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def arm() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return argv, arm


def find_etcd() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)
    if path is None:
        raise UsageError("no etcd binary found: install Debian's etcd-server (`make install` does) or pass --etcd URL")
    return path


class EtcdProcess:
    """One etcd member with its own data dir; `start()` returns once it serves.

    Clients are served on `host` (127.0.0.1 unless told; a wildcard needs `advertise_host`, the
    address clients are told to dial); the peer port of this one-member cluster stays on 127.0.0.1.
    Uses short heartbeat/election timeouts so a fresh member is ready in ~0.2 s.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        client_port: int = 0,
        peer_port: int = 0,
        host: str = "127.0.0.1",
        advertise_host: str = "",
        wrap: tuple[str, ...] = (),
        tls: TLS | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        """`wrap` runs etcd through another command (`ip netns exec NS`: a test's host); with `tls` (a
        certificate, its key and a CA) etcd serves clients TLS only and requires their certificates
        (`--client-cert-auth`); `extra`: more etcd flags."""
        self.wrap, self.tls, self.extra = wrap, tls, extra
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="tidings-etcd-"))
        self.host, self.advertise_host = host, advertise_host or host
        self.client_port, self.peer_port = client_port, peer_port
        if not self._own_dir and not (client_port and peer_port):
            self._reuse_ports()  # the ports an earlier run on this data dir used, when they are free
        self.client_port = self.client_port or free_port(host)
        self.peer_port = self.peer_port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return endpoint_of(self.advertise_host, self.client_port)

    PORTS_FILE = "ports.json"  # in the data dir: a restart serves on the same endpoint (scripts keep it)

    def _reuse_ports(self) -> None:
        try:
            old = json.loads((self.data_dir / self.PORTS_FILE).read_text())
            client, peer = int(old["client"]), int(old["peer"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        if not self.client_port and port_free(client, self.host):
            self.client_port = client
        if not self.peer_port and peer != self.client_port and port_free(peer):
            self.peer_port = peer

    def _save_ports(self) -> None:
        if not self._own_dir:
            path = self.data_dir / self.PORTS_FILE
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"client": self.client_port, "peer": self.peer_port}) + "\n")
            os.replace(tmp, path)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def start(self, timeout: float = 20.0) -> EtcdProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._save_ports()
        log = open(self.data_dir / "etcd.log", "ab")
        client = f"{'https' if self.tls else 'http'}://{endpoint_of(self.host, self.client_port)}"
        secure: list[str] = []
        if self.tls is not None:
            paths = self.tls.paths
            secure = [f"--cert-file={paths['--tls-cert']}", f"--key-file={paths['--tls-key']}"]
            if "--tls-ca" in paths:
                secure += [f"--trusted-ca-file={paths['--tls-ca']}", "--client-cert-auth"]
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv, preexec = die_with_parent(
            [
                *self.wrap,
                find_etcd(),
                "--name=tidings",
                f"--data-dir={self.data_dir / 'member-data'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={self.url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=tidings={peer}",
                "--heartbeat-interval=10",
                "--election-timeout=100",
                "--log-level=warn",
                *secure,
                *self.extra,
            ]
        )
        self.proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = last_line(self.data_dir / "etcd.log")
                raise ClusterError(
                    f"etcd exited with {self.proc.returncode} at start ({said or 'no output'}); "
                    f"see {self.data_dir / 'etcd.log'}"
                )
            if self._healthy():
                return self
            time.sleep(0.02)
        self.stop()
        raise ClusterError(
            f"etcd did not become ready on {self.endpoint} within {timeout:g}s; see {self.data_dir / 'etcd.log'}"
        )

    def _healthy(self) -> bool:
        import urllib.request

        context = self.tls.client_context() if self.tls is not None else None
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=0.5, context=context) as resp:
                return b"true" in resp.read()
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the child by PID (SIGTERM, then SIGKILL) and remove a data dir we created."""
        proc, self.proc = self.proc, None
        stop_process(proc)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
