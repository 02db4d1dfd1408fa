"""Broker lifecycle against real processes: etcd outages, restarts after kill -9, SIGTERM with etcd
gone, and `tidings cluster up` killed outright then started again.

Every process a test starts is stopped by PID in a `finally`; a SIGSTOPped etcd gets SIGCONT first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import FAST_BROKER_FLAGS, create_local_journal
from tests.support.waiting import gone, wait_until, wait_until_sync
from tidings.allocator.keys import item_key
from tidings.client import AsyncClient
from tidings.cluster import BrokerProcess, EtcdProcess, LocalCluster, free_port
from tidings.keyspace import Etcd, KeySpace, LeaseLostError
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import TidingsError


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """An etcd of the test's own, on a kept data dir, so the test may stop, pause and restart it."""
    proc = EtcdProcess(data_dir=tmp_path / "etcd")
    proc.start()
    try:
        yield proc
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            os.kill(proc.proc.pid, signal.SIGCONT)
        proc.stop()


def _log(b: BrokerProcess) -> str:
    return (b.data_dir / "broker.log").read_text(errors="replace")


@contextlib.contextmanager
def _etcd_down(etcd: EtcdProcess, how: str) -> Iterator[None]:
    """etcd unavailable inside the block: paused (SIGSTOP) or stopped, then back on the same data dir and port."""
    assert etcd.proc is not None
    if how == "sigstop":
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(etcd.proc.pid, signal.SIGCONT)
    else:
        etcd.stop()
        try:
            yield
        finally:
            etcd.start()


# --- the keep-alive alone ------------------------------------------------------------------


async def test_keep_alive_rides_out_an_etcd_restart_shorter_than_the_lease(private_etcd: EtcdProcess) -> None:
    """A keep-alive whose stream breaks retries until the lease's TTL really passed; etcd restores it.

    A KeySpace watches over the same channel, as in a broker: its retries keep the channel in
    reconnect backoff, where new streams fail before their first write.
    """
    ttl = 4
    client = await Etcd.connect(private_etcd.endpoint)
    ks = KeySpace("/lease-test", lambda key, raw: raw)
    try:
        await ks.start(client)
        lease = await client.grant_lease(ttl)
        await client.put("/lease-test/k", b"x", lease=lease)
        task = asyncio.create_task(client.keep_alive(lease, ttl), name="test-keep-alive")
        await asyncio.sleep(0.5)  # etcd goes down while the keep-alive waits between two refreshes
        down_at = time.monotonic()
        with _etcd_down(private_etcd, "restart"):
            await asyncio.sleep(1.0)  # the outage
        # The claim is about time passing: one whole TTL after the outage began, all is still well.
        await asyncio.sleep(max(0.0, down_at + ttl + 1 - time.monotonic()))
        assert not task.done(), "the keep-alive gave up on a lease etcd still holds"
        kv, _ = await client.get("/lease-test/k")
        assert kv is not None and kv.lease == lease
        task.cancel()
        await asyncio.wait([task])
        await client.revoke_lease(lease)
    finally:
        await ks.aclose()
        await client.aclose()


async def test_keep_alive_reports_the_loss_once_the_ttl_passed_without_etcd(private_etcd: EtcdProcess) -> None:
    """With etcd gone for longer than the TTL, the keep-alive gives up (LeaseLostError), and no sooner is needed."""
    client = await Etcd.connect(private_etcd.endpoint)
    try:
        lease = await client.grant_lease(2)
        task = asyncio.create_task(client.keep_alive(lease, 2), name="test-keep-alive")
        with _etcd_down(private_etcd, "sigstop"):
            with pytest.raises(LeaseLostError, match="no refresh answered"):
                await asyncio.wait_for(task, 6)
    finally:
        await client.aclose()


# --- brokers as child processes -------------------------------------------------------------


@pytest.mark.parametrize("how", ["sigstop", "restart"])
async def test_etcd_outage_shorter_than_the_lease_stops_no_broker_and_loses_no_append(
    private_etcd: EtcdProcess, tmp_path: Path, how: str
) -> None:
    """Invariant 1 across an etcd outage: brokers keep serving the routes they have, no broker exits,
    every append acknowledged OK (before, during and after) reads back, and etcd changes made after
    the outage reach every broker (their watches resumed)."""
    lc = LocalCluster(brokers=3, zones=3, data_dir=tmp_path / "cluster", etcd=private_etcd.endpoint)
    lc.extra = ["--pulse-interval", "0.5", "--lease-ttl", "5", "--stall-timeout", "5"]
    acked: list[tuple[int, int, bytes]] = []
    stop = asyncio.Event()

    async def writer(i: int) -> None:
        n = 0
        async with AsyncClient(lc.brokers[i % 3].endpoint, retries=5) as c:
            while not stop.is_set():
                body = f"<{i}:{n}>".encode() * (1 + n % 7)
                n += 1
                try:
                    r = await c.append("outage/a", body)
                except TidingsError:
                    await asyncio.sleep(0.05)
                    continue
                acked.append((r.begin, r.end, body))

    try:
        await asyncio.to_thread(lc.start)
        await create_local_journal(lc, "outage/a")
        writers = [asyncio.create_task(writer(i)) for i in range(4)]
        try:
            await wait_until(lambda: len(acked) >= 30, 30)
            before = len(acked)
            with _etcd_down(private_etcd, how):
                await asyncio.sleep(2.0)  # the outage itself
                during = len(acked) - before
            await wait_until(lambda: len(acked) >= before + during + 30, 30)
        finally:
            stop.set()
            await asyncio.gather(*writers)
        assert during > 0, "appends on an established route go on while etcd is away"
        await _every_broker_sees_a_new_journal(lc, private_etcd, "outage/after")  # their watches resumed

        dead = [(b.suffix, b.proc.returncode if b.proc else None) for b in lc.brokers if not b.alive()]
        assert dead == [], f"brokers exited during a {how} outage shorter than their lease"
        for b in lc.brokers:
            assert "lost its lease" not in _log(b), b.suffix
        async with AsyncClient(lc.brokers[0].endpoint) as c:
            data = await c.read_all("outage/a")
        for begin, end, body in acked:
            assert data[begin:end] == body, f"acknowledged append at [{begin},{end}) changed"
    finally:
        await asyncio.to_thread(lc.stop)


async def _every_broker_sees_a_new_journal(lc: LocalCluster, etcd: EtcdProcess, name: str) -> None:
    """Write a journal spec straight into etcd; wait until every broker routes it (with a primary)."""
    spec = spec_from_dict({"name": name, "replication": 2, "fragment": {"length": "64KiB", "stores": [lc.store_url]}})
    client = await Etcd.connect(etcd.endpoint)
    try:
        await client.put(item_key(lc.root, name), spec.SerializeToString())
    finally:
        await client.aclose()
    for b in lc.brokers:
        async with AsyncClient(b.endpoint) as c:

            async def routed() -> bool:
                return any(j.spec.name == name and j.route.primary >= 0 for j in (await c.list()).journals)

            await wait_until(routed, 20)


async def test_broker_restarted_at_once_after_kill_9_waits_for_its_old_member_key(
    etcd: EtcdProcess, etcd_root: str, tmp_path: Path
) -> None:
    """The old member key (leased by the killed process) is still there: the new process says so,
    waits for the lease to expire, then serves; nothing is printed about an unclosed server."""
    lc = LocalCluster(brokers=2, data_dir=tmp_path, etcd=etcd.endpoint)
    lc.extra = [*FAST_BROKER_FLAGS, "--root", etcd_root]  # --lease-ttl 2
    try:
        await asyncio.to_thread(lc.start)
        old = lc.brokers[1]
        old.kill()  # SIGKILL: its member key stays until its lease expires
        new = BrokerProcess(etcd.endpoint, old.zone, old.suffix, old.port, old.data_dir, lc.extra)
        lc.brokers[1] = new
        await asyncio.to_thread(new.start, 30)
        assert new.alive()
        log = _log(new)
        assert f"member {old.zone}#{old.suffix} is still announced by a previous process" in log
        assert "Exception ignored" not in log
        async with AsyncClient(new.endpoint) as c:
            await c.list()  # it serves
    finally:
        await asyncio.to_thread(lc.stop)
        client = await Etcd.connect(etcd.endpoint)
        try:
            await client.delete_prefix(etcd_root + "/")
        finally:
            await client.aclose()


async def test_sigterm_with_etcd_gone_exits_within_a_bound(private_etcd: EtcdProcess, tmp_path: Path) -> None:
    """etcd hangs (SIGSTOP): a SIGTERMed broker cannot hand off, says so, and exits in well under 15 s."""
    lc = LocalCluster(brokers=2, data_dir=tmp_path / "cluster", etcd=private_etcd.endpoint)
    lc.extra = ["--pulse-interval", "0.5", "--lease-ttl", "5"]
    try:
        await asyncio.to_thread(lc.start)
        await create_local_journal(lc, "gone/a", replication=2)
        victim = lc.brokers[0]
        assert victim.proc is not None
        with _etcd_down(private_etcd, "sigstop"):
            t0 = time.monotonic()
            victim.proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(victim.proc.wait, 30)
            took = time.monotonic() - t0
        assert rc == 0
        assert took < 15, f"the stop took {took:.1f}s with etcd gone"
        log = _log(victim)
        assert "stopping without handing its journals off" in log
        assert "Exception ignored" not in log
    finally:
        await asyncio.to_thread(lc.stop)


async def test_sigterm_when_no_broker_can_take_its_journals_says_so_and_how_long_it_waits(
    etcd: EtcdProcess, etcd_root: str, tmp_path: Path
) -> None:
    """Invariant 5 keeps an R=3 journal on all three brokers: the one told to stop says that nobody
    can take it and for how long it waits (--exit-timeout), then stops anyway."""
    lc = LocalCluster(brokers=3, data_dir=tmp_path, etcd=etcd.endpoint)
    lc.extra = [*FAST_BROKER_FLAGS, "--root", etcd_root, "--exit-timeout", "2"]
    try:
        await asyncio.to_thread(lc.start)
        await create_local_journal(lc, "stuck/a", replication=3)
        victim = lc.brokers[2]
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(victim.proc.wait, 30) == 0
        log = _log(victim)
        assert "no other live broker is free to take journal stuck/a" in log
        assert "waiting up to 2s for one to join" in log
        assert "journal stuck/a still assigned after 2s; stopping anyway" in log
    finally:
        await asyncio.to_thread(lc.stop)
        client = await Etcd.connect(etcd.endpoint)
        try:
            await client.delete_prefix(etcd_root + "/")
        finally:
            await client.aclose()


def test_startup_failure_prints_one_line(tmp_path: Path) -> None:
    """A broker that cannot listen says so on one line: no traceback, no unclosed-server noise."""
    etcd = EtcdProcess(data_dir=tmp_path / "etcd").start()
    try:
        with _listening_socket() as port:
            args = ["broker", "--etcd", etcd.endpoint, "--listen", f"127.0.0.1:{port}", "--data-dir", f"{tmp_path}/b"]
            r = subprocess.run(
                [sys.executable, "-m", "tidings.cli", *args, "--log-level", "warning"],
                capture_output=True,
                text=True,
                timeout=60,
            )
    finally:
        etcd.stop()
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and re.match(r"error: broker \S+ cannot listen on 127\.0\.0\.1:", lines[0]), r.stderr
    assert "--listen" in lines[0]


@contextlib.contextmanager
def _listening_socket() -> Iterator[int]:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _cluster_up(data_dir: Path, port: int) -> subprocess.Popen[str]:
    args = ["cluster", "up", "--brokers", "2", "--port", str(port), "--data-dir", str(data_dir)]
    return subprocess.Popen(
        [sys.executable, "-m", "tidings.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def _wait_ready(proc: subprocess.Popen[str], timeout: float = 60) -> list[str]:
    lines: list[str] = []
    assert proc.stdout is not None

    def ready() -> bool:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line and proc.poll() is not None:
            raise AssertionError(f"cluster up exited with {proc.returncode}: {proc.stderr.read()}")  # type: ignore[union-attr]
        lines.append(line)
        return "ready" in line

    wait_until_sync(ready, timeout)
    return lines


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_cluster_up_killed_leaves_nothing_running_and_starts_again_cleanly(tmp_path: Path) -> None:
    """SIGKILL `cluster up`: its etcd and brokers exit on their own (parent-death SIGTERM, etcd gone
    too) within a bound. `cluster up` again on the same data dir starts at once, without a traceback,
    still has the journal and its data, and stops within a bound on SIGTERM."""
    data_dir, port = tmp_path / "data", free_port()
    spec = tmp_path / "j.yaml"
    spec.write_text(
        "journals:\n  - name: up/a\n    replication: 2\n"
        f"    fragment: {{length: 64KiB, stores: ['file://{data_dir}/fragments/']}}\n"
    )
    broker = f"127.0.0.1:{port}"
    first = _cluster_up(data_dir, port)
    children: list[int] = []
    second: subprocess.Popen[str] | None = None
    try:
        _wait_ready(first)
        children = _children(first.pid)
        assert len(children) == 3, "etcd and two brokers"
        cli = [sys.executable, "-m", "tidings.cli"]
        r = subprocess.run([*cli, "journals", "apply", str(spec), "--broker", broker], capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        r = subprocess.run(
            [*cli, "journals", "append", "up/a", "--broker", broker], input=b"hello", capture_output=True, timeout=60
        )
        assert r.returncode == 0, r.stderr

        first.kill()
        first.wait()
        wait_until_sync(lambda: all(gone(pid) for pid in children), 20)

        second = _cluster_up(data_dir, port)
        lines = _wait_ready(second, 60)
        children += _children(second.pid)
        assert any(line.startswith("cleared 2 member keys") for line in lines), lines
        r = subprocess.run([*cli, "journals", "read", "up/a", "--broker", broker], capture_output=True, timeout=60)
        assert r.returncode == 0 and r.stdout == b"hello", r.stderr
        t0 = time.monotonic()
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0
        took = time.monotonic() - t0
        assert took < 15, f"stopping the restarted cluster took {took:.1f}s"
        assert "Traceback" not in (second.stderr.read() if second.stderr else "")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in children:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_cluster_up_restarts_at_once_on_its_own_ports_and_etcd_endpoint(tmp_path: Path) -> None:
    """`cluster up --brokers 3 --port P`, an append, then a stop (SIGTERM, then SIGKILL of the whole
    tree) and `cluster up` again on the same data dir and port: it starts at once (the ports the last
    run's connections hold in TIME-WAIT are free), on the same etcd endpoint, with the append there.
    A port another process listens on is still refused in one line."""
    data_dir, port = tmp_path / "data", free_port()
    broker = f"127.0.0.1:{port}"
    cli = [sys.executable, "-m", "tidings.cli"]
    spec = tmp_path / "j.yaml"
    spec.write_text("journals:\n  - name: up/b\n    replication: 3\n")
    procs: list[subprocess.Popen[str]] = []
    children: list[int] = []

    def up() -> str:
        proc = subprocess.Popen(
            [*cli, "cluster", "up", "--brokers", "3", "--port", str(port), "--data-dir", str(data_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        procs.append(proc)
        lines = _wait_ready(proc, 60)
        children.extend(_children(proc.pid))
        return next(line.split()[1] for line in lines if line.startswith("etcd "))

    try:
        etcd = up()
        r = subprocess.run([*cli, "journals", "apply", str(spec), "--broker", broker], capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        r = subprocess.run(
            [*cli, "journals", "append", "up/b", "--broker", broker], input=b"once", capture_output=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        held = [socket.create_connection(("127.0.0.1", port + i)) for i in range(3)]  # (a client's connections)
        procs[-1].send_signal(signal.SIGTERM)
        assert procs[-1].wait(timeout=60) == 0
        for conn in held:  # the brokers closed first: read to their FIN, close, and their ports stay in TIME-WAIT
            conn.settimeout(10)
            while conn.recv(65536):
                pass
            conn.close()
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port + 1))  # (what the restart used to probe with)

        assert up() == etcd, "a restart serves etcd where the last run did"
        for pid in [procs[-1].pid, *_children(procs[-1].pid)]:
            os.kill(pid, signal.SIGKILL)  # the whole tree at once
        procs[-1].wait()
        wait_until_sync(lambda: all(gone(pid) for pid in children), 20)

        assert up() == etcd
        r = subprocess.run([*cli, "journals", "read", "up/b", "--broker", broker], capture_output=True, timeout=60)
        assert r.returncode == 0 and r.stdout == b"once", r.stderr

        r = subprocess.run(
            [*cli, "cluster", "up", "--brokers", "3", "--port", str(port + 1), "--data-dir", str(tmp_path / "other")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and f"127.0.0.1:{port + 1} is taken" in r.stderr, r.stderr
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for pid in children:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
