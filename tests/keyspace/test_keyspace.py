"""The etcd client and the KeySpace mirror, against a real etcd: the mirror loads then follows the watch,
shows each transaction whole at its revision, never claims a revision it has not reached, and rides out
compactions and etcd restarts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.tcp_gate import TcpGate
from tidings.cluster.etcd import EtcdProcess, free_port
from tidings.keyspace import (
    CompactedError,
    Etcd,
    KeySpace,
    LeaseLostError,
    create_revision_is,
    decoder,
    delete_op,
    mod_revision_is,
    put_op,
    value_is,
)
from tidings.keyspace import etcd as etcd_mod
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TransportError


@pytest.fixture
async def client(etcd: EtcdProcess, etcd_root: str) -> AsyncIterator[Etcd]:
    """An Etcd connection; the test's prefix must be empty once it is deleted at teardown."""
    c = await Etcd.connect(etcd.endpoint)
    try:
        yield c
    finally:
        await c.delete_prefix(etcd_root + "/")
        assert (await c.get_prefix(etcd_root + "/"))[0] == []
        await c.aclose()


def _raw(key: str, raw: bytes) -> bytes:
    """A decoder keeping raw values, rejecting values that start with b'!'."""
    if raw.startswith(b"!"):
        raise ValueError(f"bad value {raw!r}")
    return raw


def _snapshot(ks: KeySpace) -> dict[str, bytes]:
    return {kv.key: kv.raw for kv in ks.kvs}


# --- Etcd -------------------------------------------------------------------------------


async def test_connect_to_unreachable_endpoint_fails_naming_it() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(TransportError, match=endpoint):
        await Etcd.connect(f"http://{endpoint}", timeout=0.3)


async def test_a_connection_attempt_left_unanswered_is_retried_within_the_connect_timeout(etcd: EtcdProcess) -> None:
    """A first attempt that is never answered (a lost SYN, a stalled handshake) must not use up the
    connect timeout: gRPC's own default gives each attempt 20 s before trying again."""
    gate = await TcpGate(etcd.endpoint, silent=1).open()
    try:
        c = await Etcd.connect(gate.endpoint)
        try:
            await c.get("/tidings-test/none")
        finally:
            await c.aclose()
        assert gate.silent == 0 and gate.connections == 1  # (the second attempt went through)
    finally:
        await gate.shut()


async def test_kv_reads_writes_and_header_revisions(client: Etcd, etcd_root: str, monkeypatch) -> None:
    p = etcd_root + "/"
    rev1 = await client.put(p + "a", b"1")
    kv, rev = await client.get(p + "a")
    assert kv is not None and kv.value == b"1" and kv.create_revision == kv.mod_revision == rev1 and rev >= rev1
    assert (await client.get(p + "missing"))[0] is None

    monkeypatch.setattr(etcd_mod, "PAGE_SIZE", 2)  # get_prefix pages at one revision
    for i in range(5):
        await client.put(f"{p}k/{i}", str(i).encode())
    kvs, rev = await client.get_prefix(p + "k/")
    assert [kv.value for kv in kvs] == [b"0", b"1", b"2", b"3", b"4"]
    assert rev == (await client.get(p + "a"))[1]

    drev = await client.delete(p + "k/0")
    assert drev > rev
    assert await client.delete_prefix(p + "k/") > drev
    assert (await client.get_prefix(p + "k/"))[0] == []


async def test_txn_compares_and_returns_the_write_revision(client: Etcd, etcd_root: str) -> None:
    key = etcd_root + "/t"
    ok, rev = await client.txn([mod_revision_is(key, 0)], [put_op(key, b"v1")])
    assert ok
    kv, _ = await client.get(key)
    assert kv is not None and kv.mod_revision == rev

    ok, rev2 = await client.txn([mod_revision_is(key, 0)], [put_op(key, b"v2")], [delete_op(key + "/other")])
    assert not ok and rev2 >= rev  # a failed txn still reports the current revision

    ok, _ = await client.txn([create_revision_is(key, rev), value_is(key, b"v1")], [put_op(key, b"v3")])
    assert ok
    ok, _ = await client.txn([value_is(key, b"v1")], [delete_op(key)])
    assert not ok
    ok, _ = await client.txn([mod_revision_is(key, (await client.get(key))[0].mod_revision)], [delete_op(key)])
    assert ok and (await client.get(key))[0] is None


async def test_watch_reports_puts_deletes_and_compaction(client: Etcd, etcd_root: str) -> None:
    p = etcd_root + "/w/"
    r1 = await client.put(p + "a", b"1")
    r2 = await client.delete(p + "a")
    async with client.watch(p, r1) as watch:
        batches = []
        async for batch in watch:
            batches.append(batch)
            if batch.revision >= r2:
                break
    events = [(ev.type, ev.kv.key, ev.kv.mod_revision) for b in batches for ev in b.events]
    assert events == [("put", p + "a", r1), ("delete", p + "a", r2)]

    r3 = await client.put(p + "b", b"2")
    await client.compact(r3)
    with pytest.raises(CompactedError) as info:
        async with client.watch(p, r1) as watch:
            await anext(watch)
    assert info.value.compact_revision == r3


async def test_keep_alive_holds_the_lease_and_reports_its_loss(client: Etcd, etcd_root: str) -> None:
    key = etcd_root + "/leased"
    lease = await client.grant_lease(1)
    await client.put(key, b"x", lease=lease)
    task = asyncio.create_task(client.keep_alive(lease, 1), name="test-keep-alive")
    # The lease's 1s TTL passes twice over while the keep-alive runs: the key must survive.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), 2.2)
    kv, _ = await client.get(key)
    assert kv is not None and kv.lease == lease

    await client.revoke_lease(lease)
    with pytest.raises(LeaseLostError):
        await asyncio.wait_for(task, 5)
    assert (await client.get(key))[0] is None
    await client.revoke_lease(lease)  # already gone: not an error


# --- KeySpace ---------------------------------------------------------------------------


async def test_keyspace_loads_then_follows_the_watch(client: Etcd, etcd_root: str) -> None:
    p = etcd_root + "/"
    await client.put(p + "b", b"2")
    await client.put(p + "a", b"1")
    await client.put(etcd_root + "-sibling/x", b"not ours")
    ks = KeySpace(etcd_root, _raw)
    await ks.start(client)
    try:
        assert _snapshot(ks) == {p + "a": b"1", p + "b": b"2"}
        rev = await client.put(p + "c/1", b"3")
        await client.put(p + "c/0", b"4")
        rev = await client.delete(p + "a")
        await ks.wait_for_revision(rev, timeout=5)
        assert [kv.key for kv in ks.kvs] == [p + "b", p + "c/0", p + "c/1"]
        assert [kv.raw for kv in ks.prefixed(p + "c/")] == [b"4", b"3"]
        got = ks.get(p + "b")
        assert got is not None and got.decoded == b"2" and ks.get(p + "a") is None

        before = ks.revision
        rev = await client.put(p + "b", b"22")
        await ks.wait_for_update(before, timeout=5)
        assert ks.revision == rev and ks.get(p + "b").raw == b"22"  # type: ignore[union-attr]
    finally:
        await ks.aclose()


async def test_observers_see_a_whole_transaction_applied_with_its_revision(client: Etcd, etcd_root: str) -> None:
    p = etcd_root + "/"
    ks = KeySpace(etcd_root, _raw)
    seen: list[tuple[int, frozenset[str]]] = []
    ks.add_observer(lambda: seen.append((ks.revision, frozenset(kv.key for kv in ks.kvs))))
    await ks.start(client)
    try:
        keys = [f"{p}{i:02d}" for i in range(20)]
        ok, rev = await client.txn([], [put_op(k, b"x") for k in keys])
        assert ok
        await ks.wait_for_revision(rev, timeout=5)
        ok, rev2 = await client.txn([], [delete_op(k) for k in keys[::2]])
        await ks.wait_for_revision(rev2, timeout=5)
    finally:
        await ks.aclose()
    by_rev = dict(seen)
    assert by_rev[rev] == frozenset(keys)
    assert by_rev[rev2] == frozenset(keys[1::2])
    for _, snapshot in seen:  # never half a transaction
        assert snapshot in (frozenset(), frozenset(keys), frozenset(keys[1::2]))


async def test_invalid_values_are_logged_and_skipped_never_crash(
    client: Etcd, etcd_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    p = etcd_root + "/"
    await client.put(p + "bad-at-load", b"!nope")
    ks = KeySpace(etcd_root, _raw)
    with caplog.at_level(logging.WARNING, logger="tidings.keyspace"):
        await ks.start(client)
        try:
            assert ks.get(p + "bad-at-load") is None
            await client.put(p + "good", b"1")
            rev = await client.put(p + "good", b"!broken")
            await ks.wait_for_revision(rev, timeout=5)
            assert ks.get(p + "good") is None
            rev = await client.put(p + "good", b"fixed")
            await ks.wait_for_revision(rev, timeout=5)
            assert ks.get(p + "good").raw == b"fixed"  # type: ignore[union-attr]
            rev = await client.delete(p + "bad-at-load")
            await ks.wait_for_revision(rev, timeout=5)
        finally:
            await ks.aclose()
    text = caplog.text
    assert p + "bad-at-load" in text and p + "good" in text and "bad value" in text


async def test_wait_for_revision_reaches_revisions_written_outside_the_prefix(client: Etcd, etcd_root: str) -> None:
    """A peer's revision may come from writes no watch event reports: the mirror proves itself current."""
    ks = KeySpace(etcd_root + "/ks", _raw)
    await client.put(etcd_root + "/ks/a", b"1")
    await ks.start(client)
    try:
        rev = await client.put(etcd_root + "/elsewhere", b"x")
        await ks.wait_for_revision(rev, timeout=5)
        assert ks.revision >= rev
    finally:
        await ks.aclose()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param("put-new", id="new-key"),
        pytest.param("overwrite", id="overwritten-key"),
        pytest.param("delete", id="deleted-key"),
    ],
)
async def test_stale_mirror_never_claims_a_later_revision(client: Etcd, etcd_root: str, change: str) -> None:
    """Without its watch, a mirror that missed a change must not prove itself current."""
    p = etcd_root + "/ks/"
    await client.put(p + "a", b"1")
    ks = KeySpace(etcd_root + "/ks", _raw)
    await ks.load(client)  # no watch: changes below are missed
    if change == "put-new":
        await client.put(p + "b", b"2")
    elif change == "overwrite":
        await client.put(p + "a", b"2")
    else:
        await client.delete(p + "a")
    rev = await client.put(etcd_root + "/elsewhere", b"x")
    with pytest.raises(TimeoutError):
        await ks.wait_for_revision(rev, timeout=0.3)
    await ks.load(client)
    assert ks.revision >= rev


async def test_mirror_missing_only_a_net_zero_change_may_claim_the_revision(client: Etcd, etcd_root: str) -> None:
    p = etcd_root + "/ks/"
    await client.put(p + "a", b"1")
    ks = KeySpace(etcd_root + "/ks", _raw)
    await ks.load(client)
    await client.put(p + "tmp", b"2")
    rev = await client.delete(p + "tmp")
    await ks.wait_for_revision(rev, timeout=5)
    assert _snapshot(ks) == {p + "a": b"1"}


async def test_watch_from_a_compacted_revision_reloads(
    client: Etcd, etcd_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    p = etcd_root + "/"
    await client.put(p + "a", b"1")
    ks = KeySpace(etcd_root, _raw)
    await ks.load(client)
    await client.delete(p + "a")
    rev = await client.put(p + "b", b"2")
    await client.compact(rev)
    with caplog.at_level(logging.WARNING, logger="tidings.keyspace"):
        await ks.start(client, load=False)
        try:
            await ks.wait_for_revision(rev, timeout=5)
            assert _snapshot(ks) == {p + "b": b"2"}
        finally:
            await ks.aclose()
    assert "compacted" in caplog.text


async def test_watch_resumes_after_etcd_restarts(tmp_path: Path, etcd_root: str) -> None:
    proc = EtcdProcess(data_dir=tmp_path / "etcd")
    proc.start()
    try:
        client = await Etcd.connect(proc.endpoint)
        ks = KeySpace(etcd_root, _raw)
        try:
            await ks.start(client)
            proc.stop()
            proc.start()
            rev = await client.put(etcd_root + "/after", b"1")
            await ks.wait_for_revision(rev, timeout=15)
            assert _snapshot(ks) == {etcd_root + "/after": b"1"}
        finally:
            await ks.aclose()
            await client.delete_prefix(etcd_root + "/")
            await client.aclose()
    finally:
        proc.stop()


async def test_aclose_stops_the_watch_task(client: Etcd, etcd_root: str) -> None:
    ks = KeySpace(etcd_root, _raw)
    await ks.start(client)
    names = {t.get_name() for t in asyncio.all_tasks()}
    assert f"keyspace-watch:{etcd_root}" in names
    await ks.aclose()
    assert f"keyspace-watch:{etcd_root}" not in {t.get_name() for t in asyncio.all_tasks()}
    rev = await client.put(etcd_root + "/x", b"1")
    with pytest.raises(TimeoutError):
        await ks.wait_for_update(rev, timeout=0.1)


# --- decoder ----------------------------------------------------------------------------

ROOT = "/r"


def _spec(**kw: object) -> pb.JournalSpec:
    spec = pb.JournalSpec(name="a/b", replication=2)
    spec.fragment.length = 1 << 20
    spec.fragment.compression_codec = pb.NONE
    spec.fragment.refresh_interval_ms = 60_000
    for k, v in kw.items():
        setattr(spec, k, v)
    return spec


def _broker(zone: str = "z1", suffix: str = "b1") -> bytes:
    return pb.BrokerSpec(
        id=pb.ProcessId(zone=zone, suffix=suffix), endpoint="127.0.0.1:1", journal_limit=10
    ).SerializeToString()


def _route(*members: tuple[str, str], primary: int = 0) -> bytes:
    return pb.Route(members=[pb.ProcessId(zone=z, suffix=s) for z, s in members], primary=primary).SerializeToString()


@pytest.mark.parametrize(
    ("key", "raw", "expect"),
    [
        pytest.param("/r/members/z1#b1", _broker(), pb.BrokerSpec, id="member"),
        pytest.param("/r/members/z1#b2", _broker(), "does not match", id="member-id-mismatch"),
        pytest.param("/r/members/z1", _broker(), "zone", id="member-key-without-suffix"),
        pytest.param("/r/members/z1#b1", _broker("z 1"), "zone", id="member-invalid-id"),
        pytest.param("/r/members/z1#b1", b"\xff\xff", "not a valid BrokerSpec", id="member-garbage"),
        pytest.param("/r/items/a/b", _spec().SerializeToString(), pb.JournalSpec, id="item"),
        pytest.param("/r/items/a/c", _spec().SerializeToString(), "does not match", id="item-name-mismatch"),
        pytest.param("/r/items/a/b", _spec(replication=0).SerializeToString(), "replication", id="item-invalid-spec"),
        pytest.param("/r/assign/a/b#z1#b1#0", b"", pb.Route, id="assignment-new"),
        pytest.param("/r/assign/a/b#z1#b1#2", _route(("z1", "b1"), ("z2", "b2")), pb.Route, id="assignment"),
        pytest.param("/r/assign/a/b#z1#b1#0", _route(("z2", "b2"), ("z1", "b1")), "sorted", id="assign-unsorted"),
        pytest.param("/r/assign/a/b#z1#b1#01", b"", "slot", id="assignment-slot-leading-zero"),
        pytest.param("/r/assign/a/b#z1#b1#-1", b"", "slot", id="assignment-negative-slot"),
        pytest.param("/r/assign/a/b#z1#b1", b"", "item}#{zone}", id="assignment-missing-slot"),
        pytest.param("/r/assign/a//b#z1#b1#0", b"", "empty segment", id="assignment-bad-journal"),
        pytest.param("/r/other/x", b"", "unknown key", id="unknown-sub-prefix"),
        pytest.param("/r/members", b"", "unknown key", id="bare-sub-prefix"),
    ],
)
def test_decoder_types_valid_values_and_rejects_others(key: str, raw: bytes, expect: object) -> None:
    decode = decoder(ROOT)
    if isinstance(expect, type):
        assert isinstance(decode(key, raw), expect)
    else:
        with pytest.raises(ValueError, match=str(expect)):
            decode(key, raw)
