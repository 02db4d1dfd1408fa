"""Hosts for tests: one network namespace per process on a private bridge, so nothing works by accident
through 127.0.0.1 (docs/design/production.md §3.15).

`Net()` makes a bridge `tdb<run>` in the root namespace with address `.1` of a free 10.2xx.y.0/24
(and `fd7d:0<run>::1/64`: with a leading zero, a spelling other than the address's shortest, which
every hosts test then dials, announces and has certificates for), so the test process itself is a
client on the network; `net.host(name)` adds a namespace `td-<run>-<name>` joined to the bridge by a
veth pair (`eth0` inside, `lo` up), with the next address. `host.wrap` is the argv prefix that runs a
command there (`ip netns exec`); `host.popen` starts one and records its PID. `close()` (also after a
failure) stops every PID it started (SIGTERM, then SIGKILL), kills what is left inside its own
namespaces (`ip netns pids`), then deletes the namespaces and the bridge. A registry file per Net
(`/run/tidings-netns/<run>`: owner PID and its start time, the names made) lets the next Net sweep
what a killed pytest left.

Needs root with CAP_NET_ADMIN and `ip` (make installs iproute2): `require()` fails the test saying
so otherwise (the suite runs as root; a hosts test that did not run proves nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REGISTRY = Path("/run/tidings-netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def require() -> None:
    """Fail the calling test, saying what to do, unless this process can make network namespaces."""
    if os.geteuid() != 0:
        pytest.fail("network-namespace hosts need root with CAP_NET_ADMIN (not root): run `make test` as root")
    probe = f"td-probe-{os.getpid()}"
    try:
        r = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        pytest.fail("network-namespace hosts need the `ip` command: `make install` installs iproute2")
    if r.returncode != 0:
        pytest.fail(f"network-namespace hosts need root with CAP_NET_ADMIN (ip netns add: {r.stderr.strip()})")
    _ip("netns", "del", probe, check=False)


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _sweep() -> None:
    """Remove the namespaces and bridges of Nets whose owner process is gone (a killed test run)."""
    if not REGISTRY.is_dir():
        return
    for entry in REGISTRY.iterdir():
        try:
            rec = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if _start_time(int(rec["owner"])) == rec["started"]:
            continue  # (its owner still runs)
        _teardown(rec["namespaces"], rec["bridge"], [])
        entry.unlink(missing_ok=True)


def _teardown(namespaces: list[str], bridge: str, procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for ns in namespaces:  # (children of ours still inside our own namespaces: by their PIDs)
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
    _ip("link", "del", bridge, check=False)


@dataclass
class Host:
    """One "machine": a namespace with an address on the test's bridge."""

    name: str
    ns: str
    ip: str
    ip6: str
    net: Net = field(repr=False)

    @property
    def wrap(self) -> tuple[str, ...]:
        """The argv prefix that runs a command on this host."""
        return ("ip", "netns", "exec", self.ns)

    def popen(self, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
        """Start `argv` on this host in its own session; `Net.close` stops it by PID."""
        proc: subprocess.Popen[bytes] = subprocess.Popen([*self.wrap, *argv], start_new_session=True, **kw)  # type: ignore[call-overload]
        self.net.procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.wrap, *argv], capture_output=True, text=True, timeout=timeout)

    def wait_reaches(self, address: str, port: int, timeout: float = 30.0) -> None:
        """Return once a TCP connection from this host to `address:port` succeeds (a fresh namespace's
        first IPv6 dials could time out while its link and neighbours settled); RuntimeError after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.run([sys.executable, "-I", "-S", "-c", _CONNECT, address, str(port)], timeout=15)
            if r.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {self.name} cannot reach {address}:{port} within {timeout:g}s: {r.stderr}")


_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()"


def _listen(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.listen(64)
    sock.setblocking(False)
    return sock


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError):
        while True:
            sock.accept()[0].close()


class Net:
    """A private bridge and the hosts on it; use as a context manager (or call `close`)."""

    def __init__(self) -> None:
        require()
        REGISTRY.mkdir(parents=True, exist_ok=True)
        _sweep()
        self.run = f"{random.randrange(16**6):06x}"
        self.bridge = f"tdb{self.run}"
        self.v6 = f"0{self.run[:3]}"  # (the /64's fourth group of hex digits)
        self.prefix = self._free_subnet()
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._record()
        try:
            # (no multicast snooping: IPv6 neighbour discovery is multicast, and a bridge that has not yet
            # heard a port's MLD report would not forward it there: the first dials over IPv6 time out)
            _ip("link", "add", self.bridge, "type", "bridge", "mcast_snooping", "0")
            _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
            _ip("-6", "addr", "add", f"fd7d:{self.v6}::1/64", "dev", self.bridge, "nodad")
            _ip("link", "set", self.bridge, "up")
            # (a listening socket on each of the bridge's addresses: every new host must reach both before
            # it is handed out; the kernel completes the handshakes, `_drain` accepts and closes them)
            self._beacons = [_listen(f"{self.prefix}.1"), _listen(f"fd7d:{self.v6}::1")]
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_subnet() -> str:
        used = _ip("-br", "addr").stdout + _ip("route").stdout
        for _ in range(200):
            prefix = f"10.{random.randrange(200, 251)}.{random.randrange(256)}"
            if f"{prefix}." not in used:
                return prefix
        raise RuntimeError("no free 10.2xx.y.0/24 for the test's bridge")

    def _record(self) -> None:
        rec = {
            "owner": os.getpid(),
            "started": _start_time(os.getpid()),
            "bridge": self.bridge,
            "namespaces": [h.ns for h in self.hosts.values()] + [f"td-{self.run}-{n}" for n in self._pending],
        }
        (REGISTRY / self.run).write_text(json.dumps(rec))

    _pending: tuple[str, ...] = ()

    def host(self, name: str) -> Host:
        """A new host `name` (short: interface names are at most 15 bytes) with the next address."""
        i = len(self.hosts) + 11
        ns, veth = f"td-{self.run}-{name}", f"tdv{self.run}{len(self.hosts)}"
        self._pending = (name,)
        self._record()  # (before it exists: a crash now still leaves its name for the sweep)
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        h = Host(name, ns, f"{self.prefix}.{i}", f"fd7d:{self.v6}::{i}", self)
        for args in (
            ("addr", "add", f"{h.ip}/24", "dev", "eth0"),
            ("-6", "addr", "add", f"{h.ip6}/64", "dev", "eth0", "nodad"),
            ("link", "set", "eth0", "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("-n", ns, *args)
        self.hosts[name] = h
        self._pending = ()
        for beacon in self._beacons:
            address, port = beacon.getsockname()[:2]
            h.wait_reaches(address, port)
            _drain(beacon)
        return h

    def close(self) -> None:
        for beacon in getattr(self, "_beacons", ()):
            beacon.close()
        _teardown([*(h.ns for h in self.hosts.values()), *(f"td-{self.run}-{n}" for n in self._pending)],
                  self.bridge, self.procs)  # fmt: skip
        (REGISTRY / self.run).unlink(missing_ok=True)

    def __enter__(self) -> Net:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
