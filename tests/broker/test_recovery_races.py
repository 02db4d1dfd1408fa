"""A replica's HEAD covers an append before its client hears OK, and recovery keeps it, whatever is in
flight: the last append of a burst, an acknowledgement read while the spool closes, a recovery killed
mid-copy (DESIGN.md invariant 1); and readers arriving together at a hole list the stores once."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from tests.support.cluster import TestCluster
from tidings.broker import replica as replica_module
from tidings.broker.pipeline import Pipeline
from tidings.broker.replica import Replica, spool_directory
from tidings.broker.transport import Dialer, PeerStream, ReplicationServer
from tidings.fragment import spool as spool_module
from tidings.fragment.fragment import EMPTY_SUM, Fragment
from tidings.fragment.persister import Persister
from tidings.fragment.spool import HEAD, Spool, _read_head, recover
from tidings.protocol import protocol_pb2 as pb


async def test_every_replica_records_an_append_before_its_client_hears_ok(etcd, etcd_root, tmp_path) -> None:
    """A replica recovers on its own no further than its HEAD. A peer records each commit there before
    it answers it, and the primary before it tells the client, so when the last append of a burst (no
    append, no pulse following) returns OK, every replica's HEAD already covers it."""
    tc = TestCluster(etcd.endpoint, etcd_root, tmp_path, pulse_interval=600.0)  # no pulse to carry it
    try:
        for zone in ("zone-a", "zone-b", "zone-c"):
            await tc.add_broker(zone)
        j = "it/ack-note"
        await tc.create_journal(j, 3)
        async with tc.client(0) as c:
            await c.append(j, b"first ")
            last = await c.append(j, b"and the last of the burst")
        for broker in tc.brokers:
            h = _read_head(spool_directory(broker.config.data_dir, j) / HEAD, j)
            assert h is not None and h.committed_end == last.end, f"{broker.config.suffix}: {h}"
    finally:
        await tc.stop()


async def test_an_append_acknowledged_while_its_replica_closes_is_in_no_head(tmp_path: Path) -> None:
    """Replica.aclose shuts the pipeline down and closes the primary's spool while an append's
    acknowledgements are still on their way (the FSM gave the send side back after its commit
    proposal). The receive loop then reads every peer's OK and the client hears OK after the primary's
    spool closed (a closed spool writes no HEAD). Some replica's HEAD must hold the append by then (a
    peer records each commit before it answers it), so a kill of both brokers at that moment (the kill
    campaign) and a restart still recover it."""
    primary_dir, peer_dir = tmp_path / "primary", tmp_path / "peer"
    peer_spool = Spool("j", peer_dir)
    release = asyncio.Event()
    release.set()

    async def peer(stream: PeerStream) -> None:  # the peer side of serve_replicate, around a real Spool
        while (req := await stream.recv()) is not None:
            resp = peer_spool.apply(req)
            peer_spool.flush_head()
            if req.acknowledge:
                await release.wait()
                await stream.send(resp)

    server = await ReplicationServer(peer).start("127.0.0.1:0")
    dialer = Dialer()
    tasks: set[asyncio.Task[None]] = set()

    def spawn(coro, name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        tasks.add(task)
        return task

    spool = Spool("j", primary_dir)
    returned: list[Spool] = []
    route = pb.Route(members=[pb.ProcessId(zone="z", suffix="a"), pb.ProcessId(zone="z", suffix="b")], primary=0)
    pln = Pipeline(pb.Header(route=route), spool, [dialer.open(server.endpoint)], returned.append, spawn)
    try:
        sync = pb.ReplicateRequest(
            header=pb.Header(route=route), acknowledge=True, proposal=Fragment("j", 0, 0, EMPTY_SUM, pb.NONE).to_proto()
        )
        assert (await (await pln.scatter(sync))).error is None

        async def append(content: bytes) -> asyncio.Future:
            proposal = spool.next_fragment(content)
            req = pb.ReplicateRequest(
                content=content,
                content_delta=0,
                proposal=proposal.to_proto(),
                registers=pb.LabelSet(),
                acknowledge=True,
            )
            fut = await pln.scatter(req, require_ok=True)
            assert fut is not None
            return fut

        first = await (await append(b"first"))
        assert first.error is None

        release.clear()  # the peer's answer to the next append is on its way
        fut = await append(b"second")
        pln.shutdown()  # Replica.aclose: takes the pipeline from its slot, shuts it down,
        returned.pop().close()  # takes the spool back and closes it
        release.set()
        acks = await fut
        assert acks.error is None and all(r is not None and r.status == pb.OK for r in acks.responses)
        # The client hears OK now. Snapshot both data dirs as a kill -9 of both brokers would leave them.
        for name in ("primary", "peer"):
            shutil.copytree(tmp_path / name, tmp_path / f"killed-{name}")
        recovered = {name: recover("j", tmp_path / f"killed-{name}").end for name in ("primary", "peer")}
        assert max(recovered.values()) == 11, f"an acknowledged append [5, 11) is in no HEAD: {recovered}"
    finally:
        pln.shutdown()
        if tasks:
            await asyncio.wait(tasks, timeout=15)
        await dialer.aclose()
        await server.aclose()


class _Killed(BaseException):
    """The process dies here (kill -9): nothing after this point runs."""


def test_recovery_killed_after_copying_a_prefix_keeps_the_acknowledged_prefix(tmp_path: Path, monkeypatch) -> None:
    """recover() copies the acknowledged prefix of a longer file to recover-*.tmp, unlinks the
    original, then opens and renames the copy. A broker killed between the unlink and the rename
    leaves the acknowledged bytes only in the temporary, which the next recover() deletes as a
    leftover: the acknowledged append is gone from this broker (with replication 1, from the journal)."""
    directory = tmp_path / "spools" / "j"
    sp = Spool("j", directory)
    sp.apply(pb.ReplicateRequest(content=b"hello", content_delta=0))
    sp.apply_proposal(sp.next_fragment(), pb.LabelSet())
    sp.flush_head()
    sp.apply(pb.ReplicateRequest(content=b"world", content_delta=0))
    sp.apply_proposal(sp.next_fragment(), pb.LabelSet())  # committed, never acknowledged
    del sp  # kill -9

    real = spool_module._copy_prefix

    def copy_then_killed(path: Path, frag: Fragment) -> Path:
        real(path, frag)
        raise _Killed

    monkeypatch.setattr(spool_module, "_copy_prefix", copy_then_killed)
    with pytest.raises(_Killed):
        recover("j", directory)
    monkeypatch.setattr(spool_module, "_copy_prefix", real)

    got = recover("j", directory)  # the broker restarts
    assert got.end == 5
    assert [(f.begin, f.end, fl.pread(10, 0)) for f, fl in got.fragments] == [(0, 5, b"hello")]


async def test_many_readers_at_a_hole_list_the_stores_once(tmp_path: Path, monkeypatch) -> None:
    """refresh_soon() checks the time of the last listing before it takes the refresh lock: readers
    arriving together at a hole all see an old listing and each runs one, one after another (with a
    store taking 100 ms to list, the 100th reader waits 10 s, READ_REFRESH_TIMEOUT)."""
    spec = pb.JournalSpec(name="j", replication=1)
    spec.fragment.stores.append(f"file://{tmp_path / 'store'}/")
    replica = Replica("j", spec, tmp_path / "data", Persister(lambda f, file: None))
    listings = 0
    real = replica_module._list

    def counting(url: str, journal: str) -> list[Fragment]:
        nonlocal listings
        listings += 1
        return real(url, journal)

    monkeypatch.setattr(replica_module, "_list", counting)
    await asyncio.gather(*(replica.refresh_soon() for _ in range(20)))
    assert listings <= 2, f"20 readers at one hole listed the stores {listings} times"
