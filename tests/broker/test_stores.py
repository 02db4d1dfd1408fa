"""How brokers use their fragment stores: what one persists (to S3 too: a real local S3 server, moto's, on
loopback) reads back from any broker, only the primary uploads at once, and a listing never deletes a
live spool file (DESIGN.md invariant 1); a store that cannot work is refused in one line or answered
FRAGMENT_STORE_UNHEALTHY instead of hanging the journal (and takes appends again once it lists), and a
corrupt fragment is DATA_LOSS, which no reader retries.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.broker._support import assert_replicas_hold, peers_of, primary_of
from tests.support.fragments import write_foreign_fragment
from tests.support.missing import shadow_path
from tests.support.moto_s3 import MotoS3
from tests.support.waiting import wait_until
from tidings.client import AsyncClient
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import FragmentStoreUnhealthyError, TransportError

J = "s3/orders"


async def test_fragments_persist_to_s3_and_are_read_back_by_a_broker_that_never_held_them(
    cluster, moto_s3: MotoS3
) -> None:
    url = moto_s3.url()
    await cluster.create_journal(J, 1, fragment={"length": "1KiB", "stores": [url]})
    first = os.urandom(2000)
    async with cluster.client(0) as c:
        await c.append(J, first)
        await c.append(J, b"rolls the first fragment")  # the spool is past 1 KiB: this append rolls it
    store = store_for(url)
    await wait_until(lambda: any(f.begin == 0 and f.end == 2000 for f in store.list(J)), 30)
    listed = [f for f in store.list(J) if f.begin == 0]
    assert listed[0].backing_store == url and listed[0].mod_time > 0

    holder = next(b for b in cluster.brokers if J in b.resolver.replicas)
    # Stop it outright (no hand-off): the broker that takes the journal over never had its spool.
    # (Outright also because a graceful stop of an R=1 journal's only broker hangs today, in Resolver.aclose.)
    await holder.stop(graceful=False)
    others = [b for b in cluster.brokers if b is not holder]

    def new_primary():
        st = others[0].resolver.state
        rt = st.route(J)
        if rt.primary < 0:
            return None
        member = rt.members[rt.primary]
        return next((b for b in others if (b.config.zone, b.config.suffix) == (member.zone, member.suffix)), None)

    taker = await wait_until(new_primary, 30)
    assert J in taker.resolver.replicas

    # Through the new primary's Read: it streams the content from S3 itself.
    channel = grpc.aio.insecure_channel(taker.endpoint)
    try:
        got = bytearray()
        async for resp in pb_grpc.JournalStub(channel).Read(pb.ReadRequest(journal=J, offset=0, end_offset=2000)):
            assert resp.status == pb.OK, pb.Status.Name(resp.status)
            if resp.HasField("fragment"):
                assert resp.fragment.backing_store == url
            got += resp.content
        assert bytes(got) == first
    finally:
        await channel.close()

    # Through a client: it reads the persisted fragment straight from S3.
    async with cluster.client(cluster.brokers.index(taker)) as c:
        reader = c.reader(J, 0, block=False, direct=True, end_offset=2000)
        assert b"".join([chunk.content async for chunk in reader]) == first
        assert reader.direct_reads >= 1


def _spec(store: str, name: str = "s3/refused") -> pb.JournalSpec:
    return spec_from_dict({"name": name, "replication": 1, "fragment": {"length": "1MiB", "stores": [store]}})


async def test_apply_with_a_store_fsspec_cannot_load_is_invalid_argument(cluster) -> None:
    async with cluster.client(0) as c:
        with pytest.raises(TransportError) as exc:
            await c.apply([pb.ApplyRequest.Change(upsert=_spec("nosuchfs://bucket/"))])
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
        msg = str(exc.value)
        assert "changes[0].upsert.fragment.stores[0]: fragment store 'nosuchfs://bucket/'" in msg, msg
        assert "fsspec has no protocol 'nosuchfs'" in msg and "\n" not in msg
        assert [j.spec.name for j in (await c.list()).journals] == [], "nothing was applied"


def _tidings(*args: str, broker: str, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    path = os.pathsep.join([*map(str, pythonpath), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TIDINGS_BROKER": broker, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "tidings.cli", *args], capture_output=True, env=env, timeout=60)


@pytest.mark.parametrize(
    "store,hidden,line",
    [
        pytest.param(
            "s3://bucket/journals/",
            "s3fs",
            "error: journals.yaml[0].fragment.stores[0]: fragment store 's3://bucket/journals/': fsspec cannot load "
            "protocol 's3' (No module named 's3fs'); install it with pip install 'tidings[s3]'",
            id="s3-without-s3fs",
        ),
        pytest.param(
            "nosuchfs://bucket/",
            "",
            "error: journals.yaml[0].fragment.stores[0]: fragment store 'nosuchfs://bucket/': fsspec has no protocol "
            "'nosuchfs'; use file://, s3://, gs://, az:// or memory://, or install the fsspec package for nosuchfs://",
            id="unknown-protocol",
        ),
    ],
)
async def test_journals_apply_refuses_a_store_it_cannot_load_in_one_line(
    cluster, tmp_path: Path, store: str, hidden: str, line: str
) -> None:
    f = tmp_path / "journals.yaml"
    f.write_text(f"name: s3/refused\nreplication: 1\nfragment:\n  length: 1MiB\n  stores: ['{store}']\n")
    pythonpath = [shadow_path(tmp_path, hidden)] if hidden else []
    r = await asyncio.to_thread(
        _tidings, "journals", "apply", str(f), broker=cluster.brokers[0].endpoint, pythonpath=pythonpath
    )
    err = r.stderr.decode()
    assert r.returncode == 2, (r.stdout, err)  # (a spec field: a usage error)
    assert err.splitlines() == [line], err
    async with cluster.client(0) as c:
        assert [j.spec.name for j in (await c.list()).journals] == [], "nothing was applied"


async def test_a_corrupt_fragment_is_data_loss_at_once_even_for_a_reader_that_retries_for_ever(
    cluster, tmp_path
) -> None:
    """A persisted fragment whose file does not hold what its name says (truncated in its store) is
    answered DATA_LOSS naming it, which no client retries: a consumer or Spark task (a client made with
    retries=None) fails with the reason instead of waiting for ever."""
    url = f"file://{tmp_path / 'store'}/"
    await cluster.create_journal("bad/frag", 1, fragment={"length": "1KiB", "stores": [url]})
    async with cluster.client(0) as c:
        await c.append("bad/frag", os.urandom(2000))
        await c.append("bad/frag", b"rolls the first fragment")
    store = store_for(url)
    first = await wait_until(lambda: next((f for f in store.list("bad/frag") if f.begin == 0), None), 30)
    path = tmp_path / "store" / "bad" / "frag" / first.content_name()
    path.write_bytes(path.read_bytes()[:100])  # (truncated)
    holder = next(b for b in cluster.brokers if "bad/frag" in b.resolver.replicas)
    await holder.stop(graceful=False)  # the next primary never held the spool: it reads the store
    others = [b for b in cluster.brokers if b is not holder]
    async with AsyncClient(others[0].endpoint, retries=None) as c:
        with pytest.raises(TransportError) as caught:
            async with asyncio.timeout(30):
                async for _ in c.reader("bad/frag", 0, block=True):
                    pass
    assert caught.value.code == grpc.StatusCode.DATA_LOSS
    assert first.content_name() in str(caught.value)


# -- a store listing never deletes a live spool file ----------------------------------------------


async def test_a_listing_that_covers_the_live_spool_never_deletes_it(cluster) -> None:
    """The old primary of an idle journal persists [b, e) while the new primary and its peers still
    hold [b, e) as their current spool fragment. Their next listing covers it: the spool files must
    survive, appends resume into them, reads of them work, and the next roll loses nothing."""
    j = "it/live-spool"
    await cluster.create_journal(j, 3, fragment={"length": "1KiB"})
    async with cluster.client(0) as c:
        first = await c.append(j, b"first")
        second = await c.append(j, b"hello")  # the first fragment rolled: [5, 10) is the live spool fragment
        assert (second.begin, second.end) == (5, 10)
        write_foreign_fragment(cluster, j, 5, b"hello")  # what the old primary persists as it leaves
        for b in cluster.brokers:
            await b.resolver.replicas[j].refresh_now()
        for b in cluster.brokers:
            live = b.resolver.replicas[j]
            spool = (
                live.spool_slot.peek()
                if live.spool_slot.full()
                else primary_of(cluster, j).resolver.replicas[j].pipeline_slot.peek().spool
            )
            if spool.file is not None:
                assert spool.file.path.exists(), f"{b.process_id.suffix}: the live spool file was deleted"
        third = await c.append(j, b" world")
        assert third.begin == 10
        big = await c.append(j, b"x" * 2000)  # past the fragment length: the next append rolls
        last = await c.append(j, b"!")
        spans = [
            (first.begin, first.end, b"first"),
            (5, 10, b"hello"),
            (10, 16, b" world"),
            (big.begin, big.end, b"x" * 2000),
            (last.begin, last.end, b"!"),
        ]
        await assert_replicas_hold(cluster, j, spans)

        async def stored() -> bool:
            return max((f.end for f in store_for(cluster.store_url).list(j)), default=0) >= big.end

        await wait_until(stored, 20)
        assert await c.read_all(j) == b"firsthello world" + b"x" * 2000 + b"!"


# -- only the primary persists at once ------------------------------------------------------------


async def test_only_the_primary_uploads_a_fragment(cluster) -> None:
    j = "it/one-upload"
    await cluster.create_journal(j, 3, fragment={"length": "1KiB"})
    async with cluster.client(0) as c:
        for k in range(6):
            await c.append(j, bytes([65 + k]) * 1500)  # each append past 1 KiB rolls the fragment
    store = store_for(cluster.store_url)
    await wait_until(lambda: len(store.list(j)) >= 5, 20)
    primary = primary_of(cluster, j)
    # (its statistics count an upload once the upload's thread returns, a moment after the file appears)
    await wait_until(lambda: primary.persister.statistics().uploaded >= 5, 20)
    for peer in peers_of(cluster, j):
        assert peer.persister.statistics().uploaded == 0, "a replica uploaded what the primary already had"
        assert peer.persister.statistics().queued >= 5, "replicas keep theirs for later, in case"


# -- a store that cannot be listed answers with a status ------------------------------------------


async def test_an_unusable_store_answers_fragment_store_unhealthy(cluster, tmp_path) -> None:
    """A store listing that fails (here a file:// store whose root is a plain file) answers appends and
    reads with FRAGMENT_STORE_UNHEALTHY instead of leaving them waiting forever."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"in the way")
    j = "it/bad-store"
    spec_store = f"file://{blocker}/"
    await cluster.create_journal(j, 3, fragment={"stores": [spec_store]})
    async with AsyncClient(cluster.brokers[0].endpoint, retries=0) as c:
        with pytest.raises(FragmentStoreUnhealthyError):
            await asyncio.wait_for(c.append(j, b"x"), 30)


async def test_a_store_that_fails_after_its_first_listing_refuses_appends_until_it_lists_again(
    cluster, tmp_path
) -> None:
    """A primary store whose listings start failing after the journal was listed refuses appends with
    FRAGMENT_STORE_UNHEALTHY (an accepted append might never persist: DESIGN.md invariant 1), and takes
    them again, with no operator step, once the replica's own refresh loop lists the store again."""
    folder = tmp_path / "outage"
    j = "it/store-outage"
    await cluster.create_journal(j, 1, fragment={"stores": [f"file://{folder}/"]})
    replica = primary_of(cluster, j).resolver.replicas[j]
    async with AsyncClient(cluster.brokers[0].endpoint, retries=0) as c:
        first = await asyncio.wait_for(c.append(j, b"before"), 30)

        folder.mkdir(exist_ok=True)  # (the store's folder goes away, and a file takes its place)
        folder.rename(tmp_path / "outage-aside")
        folder.write_bytes(b"in the way")
        await wait_until(lambda: replica.primary_store_error() is not None, timeout=30)
        with pytest.raises(FragmentStoreUnhealthyError):
            await asyncio.wait_for(c.append(j, b"refused"), 30)

        folder.unlink()  # (the persister, retrying, may make the folder again at once: merge into it)
        shutil.copytree(tmp_path / "outage-aside", folder, dirs_exist_ok=True)
        await wait_until(lambda: replica.store_error is None, timeout=30)
        after = await asyncio.wait_for(c.append(j, b"after"), 30)
    assert after.begin == first.end
