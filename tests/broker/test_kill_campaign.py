"""The kill -9 campaign: brokers as processes killed and restarted under concurrent appends.

Four brokers over three zones serve journals at R=3 (one broker spare). Writers append unique
records through every broker; a chaos loop meanwhile kills a broker with SIGKILL (often a
primary), or stops one gracefully while its journals are idle, and restarts it after a moment,
sometimes on an empty disk. Readers tail every journal throughout. At the end:

- every append answered OK reads back byte for byte at its offsets, from every replica and from
  the fragment store (DESIGN.md invariant 1);
- no two OK spans overlap (invariant 2);
- no read ever skipped an offset (the tailing readers saw no jump, and replicas serve every
  offset below their write head);
- every RPC returned a status: no append waited until its deadline (the "lost answer").

It runs twice: plaintext, and secured as a production cluster is (mutual TLS on gRPC and on the
replication port, capability tokens on every call: brokers sign their own for proxying, replication
and recovery checks), where a restart must find its peers and clients through the same checks.

`TIDINGS_CAMPAIGN_SECONDS` sets how long the chaos runs (default 20, each; an hour:
``TIDINGS_CAMPAIGN_SECONDS=3600 .venv/bin/pytest tests/broker/test_kill_campaign.py``).
`TIDINGS_CAMPAIGN_SEED` replays a run's choices.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import time
from dataclasses import dataclass, field

import grpc
import pytest

from tests.support.cluster import FAST_BROKER_FLAGS
from tests.support.waiting import wait_until
from tidings.auth import Authorizer, KeyedAuthorizer, KeySet, generate_key
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.cluster.etcd import free_port
from tidings.fragment.fragment import Fragment
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import IndexHasGreaterOffsetError, StatusError, TransportError
from tidings.tls import TLS, channel

SECONDS = float(os.environ.get("TIDINGS_CAMPAIGN_SECONDS", "20"))
SEED = int(os.environ.get("TIDINGS_CAMPAIGN_SEED", str(random.randrange(1 << 30))))
BUSY = [f"campaign/j{i}" for i in range(3)]
IDLE = "campaign/idle"  # an append now and then: it changes hands while idle
JOURNALS = [*BUSY, IDLE]
APPEND_DEADLINE = 60.0  # no append may take this long, retries included: that would be a lost answer


@dataclass
class Ledger:
    ok: dict[str, list[tuple[int, int, bytes]]] = field(default_factory=lambda: {j: [] for j in JOURNALS})
    unknown: int = 0
    hung: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    jumps: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)


@dataclass
class Access:
    """What the campaign's clients hold: a client certificate and a keyed signer (None: plaintext)."""

    tls: TLS | None = None
    auth: Authorizer | None = None

    def client(self, endpoint: str) -> AsyncClient:
        return AsyncClient(endpoint, tls=self.tls, auth=self.auth)


def _ports(n: int) -> int:
    """A first port with `n` free ports after it (the brokers keep their ports across restarts)."""
    while True:
        base = free_port()
        if base + n < 65000 and all(_free(base + i) for i in range(n)):
            return base


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def _writer(
    lc: LocalCluster, access: Access, i: int, ledger: Ledger, stop: asyncio.Event, idle: bool = False
) -> None:
    rng = random.Random(SEED + i)
    async with access.client(lc.brokers[i % len(lc.brokers)].endpoint) as c:
        k = 0
        while not stop.is_set():
            if idle:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), rng.uniform(1.0, 4.0))
            journal = IDLE if idle else BUSY[rng.randrange(len(BUSY))]
            body = f"<w{i} #{k} ".encode() + os.urandom(rng.randrange(1, 600)).hex().encode() + b">"
            k += 1
            try:
                r = await asyncio.wait_for(c.append(journal, body), APPEND_DEADLINE)
            except TimeoutError:
                ledger.hung.append(f"{journal} writer {i} #{k}")
                continue
            except IndexHasGreaterOffsetError as exc:
                ledger.refused.append(str(exc))
                continue
            except (StatusError, TransportError) as exc:
                if isinstance(exc, TransportError) and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    ledger.hung.append(f"{journal} writer {i} #{k}: {exc}")
                ledger.unknown += 1
                continue
            ledger.ok[journal].append((r.begin, r.end, body))


async def _tail(
    lc: LocalCluster, access: Access, journal: str, ledger: Ledger, stop: asyncio.Event, seen: bytearray
) -> None:
    async with access.client(lc.brokers[0].endpoint) as c:
        reader = c.reader(journal, 0, block=True, on_jump=lambda a, b: ledger.jumps.append(f"{journal} {a}->{b}"))
        with contextlib.suppress(asyncio.CancelledError):
            async for chunk in reader:
                assert chunk.offset == len(seen), f"{journal}: read at {chunk.offset}, expected {len(seen)}"
                seen += chunk.content
                if stop.is_set():
                    return


async def _chaos(lc: LocalCluster, ledger: Ledger, stop: asyncio.Event) -> None:
    rng = random.Random(SEED)
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline:
        await asyncio.sleep(rng.uniform(0.5, 2.0))
        i = rng.randrange(len(lc.brokers))
        victim = lc.brokers[i]
        wipe = rng.random() < 0.25
        if rng.random() < 0.75:
            ledger.events.append(f"kill -9 broker-{i}" + (" (empty disk)" if wipe else ""))
            victim.kill()
        else:
            ledger.events.append(f"SIGTERM broker-{i}" + (" (empty disk)" if wipe else ""))
            await asyncio.to_thread(victim.terminate, 30)
        if wipe:
            shutil.rmtree(victim.data_dir, ignore_errors=True)
        await asyncio.sleep(rng.uniform(0.2, 3.0))
        lc.brokers[i] = await asyncio.to_thread(lc.broker(i).start, 60)
    stop.set()


async def _replica_bytes(access: Access, endpoint: str, journal: str) -> bytes:
    """Everything one broker itself serves of `journal` (no proxying), checking it never skips."""
    out = bytearray()
    metadata = access.auth.metadata(Capability.READ) if access.auth is not None else ()
    async with channel(endpoint, access.tls) as ch:
        req = pb.ReadRequest(journal=journal, offset=0, block=False, do_not_proxy=True)
        async for resp in JournalStub(ch).Read(req, metadata=metadata):
            if resp.content:
                assert resp.offset == len(out), f"{journal} at {endpoint}: read skipped to {resp.offset}"
                out += resp.content
    return bytes(out)


async def _verify(lc: LocalCluster, access: Access, ledger: Ledger, tails: dict[str, bytearray]) -> None:
    async with access.client(lc.brokers[0].endpoint) as c:
        for journal in JOURNALS:
            spans = sorted(ledger.ok[journal])
            for (b0, e0, _), (b1, _e1, _) in itertools.pairwise(spans):
                assert e0 <= b1, f"{journal}: OK spans [{b0}, {e0}) and [{b1}, ...) overlap"
            end = max((e for _, e, _ in spans), default=0)
            barrier = await c.append(journal, b"")  # through the primary's synchronized pipeline
            route = next(j.route for j in (await c.list()).journals if j.spec.name == journal)

            async def replicas_whole(route=route, journal=journal, head=barrier.end) -> list[bytes] | None:
                views = [await _replica_bytes(access, ep, journal) for ep in route.endpoints]
                return views if all(len(v) == head for v in views) else None

            views = await wait_until(replicas_whole, 60, interval=0.25)  # holes fill as fragments persist
            assert all(v == views[0] for v in views), f"{journal}: replicas disagree"
            data = views[0]
            assert len(data) >= end
            for b, e, body in spans:
                assert data[b:e] == body, f"{journal}: OK append [{b}, {e}) does not read back"
            tail = tails[journal]
            assert data.startswith(bytes(tail)), f"{journal}: the tailing reader saw other bytes"
            await _assert_store_matches(c, journal, data)


async def _assert_store_matches(c: AsyncClient, journal: str, data: bytes) -> None:
    """Every persisted fragment holds exactly the journal's bytes at its offsets."""
    resp = await c.fragments(journal)
    checked = 0
    for entry in resp.fragments:
        spec = entry.spec
        if not spec.backing_store or spec.end > len(data):
            continue
        frag = Fragment.from_proto(spec)
        with store_for(spec.backing_store).open(frag) as f:
            content = await asyncio.to_thread(f.read)
        assert content == data[spec.begin : spec.end], f"{journal}: stored {frag.content_name()} differs"
        checked += 1
    assert checked, f"{journal}: nothing was persisted"


@pytest.mark.timeout(SECONDS + 270)  # the campaign's own length, beyond the suite's per-test limit
@pytest.mark.parametrize("secured", [False, True], ids=["plaintext", "tls-and-tokens"])
async def test_kill_9_campaign(etcd, etcd_root, tmp_path, request, secured: bool) -> None:
    keys, access, tls = "", Access(), None
    if secured:
        certs = request.getfixturevalue("certs")
        keys, tls = generate_key(), certs.tls("campaign-broker")
        access = Access(certs.tls("campaign-client", server=False), KeyedAuthorizer(KeySet.parse(keys), sub="campaign"))
    lc = LocalCluster(
        brokers=4,
        zones=3,
        data_dir=tmp_path,
        port=_ports(4),
        etcd=etcd.endpoint,
        root=etcd_root,
        auth_keys=keys,
        tls=tls,
    )
    lc.extra = [*FAST_BROKER_FLAGS, "--persist-delay", "5"]
    ledger = Ledger()
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    try:
        await asyncio.to_thread(lc.start)
        async with access.client(lc.brokers[0].endpoint) as c:
            for j in JOURNALS:
                spec = spec_from_dict({"name": j, "replication": 3, "fragment": {"length": "16KiB"}})
                await c.apply([pb.ApplyRequest.Change(upsert=spec)])

            async def primaries() -> bool:
                listed = (await c.list()).journals
                return all(any(x.spec.name == j and x.route.primary >= 0 for x in listed) for j in JOURNALS)

            await wait_until(primaries, 30)
        tails = {j: bytearray() for j in JOURNALS}
        tasks = [asyncio.ensure_future(_writer(lc, access, i, ledger, stop)) for i in range(6)]
        tasks.append(asyncio.ensure_future(_writer(lc, access, 6, ledger, stop, idle=True)))
        writers = len(tasks)
        tasks += [asyncio.ensure_future(_tail(lc, access, j, ledger, stop, tails[j])) for j in JOURNALS]
        await _chaos(lc, ledger, stop)
        await asyncio.wait_for(asyncio.gather(*tasks[:writers]), APPEND_DEADLINE + 30)
        for t in tasks[writers:]:
            t.cancel()
        await asyncio.gather(*tasks[writers:], return_exceptions=True)
        oks = sum(len(v) for v in ledger.ok.values())
        summary = f"seed {SEED}: {oks} OK, {ledger.unknown} unknown; chaos: {ledger.events}"
        assert not ledger.hung, f"appends that never got an answer: {ledger.hung[:5]} ({summary})"
        assert not ledger.refused, f"consistency lost under single faults: {ledger.refused[:3]} ({summary})"
        assert not ledger.jumps, f"reads skipped offsets: {ledger.jumps} ({summary})"
        assert oks > 50, summary
        await _verify(lc, access, ledger, tails)
        print(summary)  # shown with -s: what this run did
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(lc.stop)
