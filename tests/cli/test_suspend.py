"""Suspension of idle journals, as Gazette's: `journals suspend` (or the brokers' --auto-suspend) takes a
journal holding nothing down to no replicas, and an idle one to a single replica serving reads; a
suspended journal costs no pipeline and no pulse; its next append resumes it where it stopped, with its
replicas back. A journal still holding content is never taken down to no replicas (DESIGN.md
invariant 1). Against real brokers."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import grpc
import pytest

from tests.cli._support import run
from tests.support.cluster import TestCluster
from tests.support.waiting import wait_until
from tidings.broker import pulse
from tidings.protocol import protocol_pb2 as pb

FULL, PARTIAL = pb.JournalSpec.Suspend.FULL, pb.JournalSpec.Suspend.PARTIAL


async def _journal(cluster, name: str) -> pb.ListResponse.Journal:
    async with cluster.client() as c:
        return next(j for j in (await c.list()).journals if j.spec.name == name)


async def _suspend(name: str, ep: str, *flags: str) -> dict:
    r = await run("journals", "suspend", name, "--json", *flags, broker=ep)
    assert r.returncode == 0, r
    return json.loads(r.stdout)


def _count_pulses(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Pulses run per journal from now on, on every broker of this process (the cluster's)."""
    pulses: Counter = Counter()
    pulse_once = pulse.pulse_once

    async def counted(broker, replica, mode=pb.AppendRequest.SUSPEND_NO_RESUME) -> None:
        pulses[replica.journal] += 1
        await pulse_once(broker, replica, mode)

    monkeypatch.setattr(pulse, "pulse_once", counted)
    return pulses


async def test_a_journal_holding_nothing_is_fully_suspended_and_an_append_resumes_it(cluster) -> None:
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("idle/empty", 3)
    assert await _suspend("idle/empty", ep) == {"journal": "idle/empty", "suspended": True, "level": "full"}
    await wait_until(lambda: not cluster.route("idle/empty").members, 30)  # no replicas at all

    status = json.loads((await run("status", "--json", broker=ep)).stdout)
    row = next(j for j in status["journals"] if j["name"] == "idle/empty")
    assert (row["suspended"], row["head"], status["problems"]) == ("full", 0, []), status
    r = await run("journals", "read", "idle/empty", broker=ep)
    assert (r.returncode, r.stdout) == (0, b""), r
    assert (await run("journals", "head", "idle/empty", broker=ep)).stdout == b"0\n"
    assert await _suspend("idle/empty", ep) == {"journal": "idle/empty", "suspended": True, "level": "full"}

    async with cluster.client(1) as c:
        tail = asyncio.ensure_future(c.reader("idle/empty", 0, block=True).__anext__())
        r = await run("journals", "append", "idle/empty", broker=ep, stdin=b"wake up\n")  # (resumes it)
        assert r.returncode == 0 and json.loads(r.stdout)["begin"] == 0, r
        assert (await asyncio.wait_for(tail, 30)).content == b"wake up\n"  # a blocking reader waited for it
    journal = await _journal(cluster, "idle/empty")
    assert not journal.spec.HasField("suspend") and len(journal.route.members) == 3


async def test_an_idle_journal_is_partially_suspended_serves_reads_and_costs_no_pulse(
    cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("idle/orders", 3, fragment={"flush_interval": "1s"})
    await cluster.create_journal("busy/control", 3)
    r = await run("journals", "append", "idle/orders", broker=ep, stdin=b"one\n")
    assert r.returncode == 0, r
    # Content not yet persisted and a second old: not idle, unless forced.
    first = await _suspend("idle/orders", ep)
    if first["suspended"]:  # (persisted and a second old already: a slow machine)
        assert first["level"] == "partial"
    else:

        async def idle() -> bool:
            return (await _suspend("idle/orders", ep))["suspended"]

        await wait_until(idle, 30)
    journal = await _journal(cluster, "idle/orders")
    assert journal.spec.suspend.level == PARTIAL and journal.spec.suspend.offset == 4
    await wait_until(lambda: len(cluster.route("idle/orders").members) == 1, 30)
    assert (await run("journals", "read", "idle/orders", broker=ep)).stdout == b"one\n"  # its replica serves reads

    pulses = _count_pulses(monkeypatch)
    await wait_until(lambda: pulses["busy/control"] >= 4, 30)
    assert pulses["idle/orders"] == 0, pulses  # four pulse intervals, and none for the suspended journal

    r = await run("journals", "append", "idle/orders", broker=ep, stdin=b"two\n")
    assert r.returncode == 0 and json.loads(r.stdout)["begin"] == 4, r  # where it stopped
    assert (await run("journals", "read", "idle/orders", broker=ep)).stdout == b"one\ntwo\n"
    journal = await _journal(cluster, "idle/orders")
    assert not journal.spec.HasField("suspend") and len(journal.route.members) == 3


async def test_force_suspends_a_journal_with_content_not_yet_persisted(cluster) -> None:
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("busy/now", 3, fragment={"flush_interval": "1h"})
    assert (await run("journals", "append", "busy/now", broker=ep, stdin=b"x\n")).returncode == 0
    r = await run("journals", "suspend", "busy/now", broker=ep)
    assert r.returncode == 0 and "not suspended" in r.stdout.decode() and "--force" in r.stdout.decode(), r
    assert await _suspend("busy/now", ep, "--force") == {"journal": "busy/now", "suspended": True, "level": "partial"}
    r = await run("journals", "read", "busy/now", broker=ep)
    assert r.stdout == b"x\n", r


async def test_suspend_mistakes_are_one_line(cluster) -> None:
    ep = cluster.brokers[0].endpoint
    r = await run("journals", "suspend", broker=ep)
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1 and "NAME or --selector" in r.stderr.decode(), r
    r = await run("journals", "suspend", "no/such", broker=ep)
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "'no/such' does not exist" in lines[0], r
    async with cluster.client() as c:
        await cluster.create_journal("busy/content", 1)
        req = pb.AppendRequest(journal="busy/content", content=b"x", commit=True, suspend=pb.AppendRequest.SUSPEND_NOW)
        try:
            await c.stub(cluster.brokers[0].endpoint).Append(iter([req]))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "carries no content" in exc.details()
        else:
            raise AssertionError("a suspend request with content was accepted")


async def test_brokers_suspend_idle_journals_on_their_own(etcd, etcd_root, tmp_path) -> None:
    tc = TestCluster(etcd.endpoint, etcd_root, tmp_path, pulse_interval=0.1, auto_suspend=True)
    try:
        for zone in ("zone-a", "zone-b"):
            await tc.add_broker(zone)
        await tc.create_journal("auto/empty", 2)
        await tc.create_journal("auto/used", 2, fragment={"flush_interval": "1s"})
        async with tc.client() as c:
            await c.append("auto/used", b"hello\n")

            async def levels() -> bool:
                listed = {j.spec.name: j.spec.suspend.level for j in (await c.list()).journals}
                return listed == {"auto/empty": FULL, "auto/used": PARTIAL}

            await wait_until(levels, 60)
            assert await c.read_all("auto/used") == b"hello\n"
            assert (await c.append("auto/used", b"again\n")).begin == 6  # resumed where it stopped
            assert (await c.append("auto/empty", b"first\n")).begin == 0
    finally:
        await tc.stop()


async def test_a_journal_with_recovered_content_still_being_checked_is_never_fully_suspended(cluster) -> None:
    """Recovered spool fragments join the index only once checked; meanwhile the index is empty, yet the
    journal is not fully suspended: that would remove every replica, leaving the recovered committed
    content nobody to check against (no committed byte lost, DESIGN.md invariant 1)."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("idle/recovering", 1)
    replica = next(
        b.resolver.replicas["idle/recovering"] for b in cluster.brokers if "idle/recovering" in b.resolver.replicas
    )
    replica.unverified.append(("a recovered fragment", "its spool file"))  # (as _recover leaves them)
    try:
        assert (await _suspend("idle/recovering", ep))["suspended"] is False
        assert not (await _journal(cluster, "idle/recovering")).spec.HasField("suspend")
    finally:
        replica.unverified.clear()
    assert await _suspend("idle/recovering", ep) == {"journal": "idle/recovering", "suspended": True, "level": "full"}
