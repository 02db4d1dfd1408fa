"""Verifying what a restarted broker recovered from its spool files before anyone relies on it.

`fragment.spool.recover()` finds the fragments this broker's previous process committed, and the
spool resumes at their end, so no offset it may have committed (and a client may have heard OK
for) is handed out again. But a commit is not yet a promise: while this broker was down, the
journal's other replicas may have rolled past a commit only it held and written other bytes at
those offsets (a primary that committed, then died before its peers had it; every replica lost and
the journal reset elsewhere). Serving or persisting such content would put two contents at one
offset. So a recovered fragment joins the replica's index and the persister only once checked:

- against every store fragment overlapping it (a fresh listing), byte for byte on the overlap
  (a fragment of the same name is the same content);
- against every other member of the journal's current route, through the member's own fragment
  list and non-proxied reads of what it holds locally: bytes a member serves must be equal; offsets
  no member holds contradict nothing (the other replicas rolled past them: this copy is the one).

A contradiction can be seen at any time (committed bytes never change), but agreement is final only
once no member can still write at those offsets. So a replica checks twice. Before its spool
resumes (`before_sync`, bounded), it drops the first contradicted fragment and every later one (the
same abandoned history) and resumes at that fragment's begin instead of its recovered end: resuming
past them would make the journal roll over offsets nobody holds. It keeps the rest only after a
pipeline of its route synchronized the spool (`after_sync`): every member is then at or past the
recovered end and never commits below it again. A fragment that cannot be checked yet (a member
unreachable, a store failing) is checked again later and meanwhile neither served nor persisted
(readers wait at its offsets).

Fragments a broker recovers for journals it no longer replicates are checked against the route's
members too (`verify_unassigned`), and persisted where some member is already past them. A tail the
journal's brokers have not reached is persisted only if they refuse appends anyway (a zero-byte
append through the journal answers INDEX_HAS_GREATER_OFFSET: every replica was lost and the new ones
refuse to guess, so the tail may be the only copy of acknowledged appends and a reset-head must land
after it); while the journal is live below it (a primary's commit its peers never got), it stays on
disk, since persisting it would leave those brokers refusing appends until a reset-head. A drop
there also lowers the directory's HEAD, so a replica recovering it later does not resume past what
was dropped.

Gazette has no such step: it never recovers spools, so a broker restarted on its disk loses what it
had not persisted. Ours keeps it, and this check is what keeps that from forking the journal. One
window remains: two replicas of diverged histories restarted together may each check the other
before either adopted its content, and both keep theirs (recorded in the README's limits).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from tidings.auth.authorizer import CallMetadata
from tidings.broker.replica import spool_directory, stores_of
from tidings.fragment.fragment import Fragment
from tidings.fragment.spool import SpoolFile, lower_head
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability
from tidings.protocol.labels import name_selector
from tidings.protocol.protocol_pb2_grpc import JournalStub

if TYPE_CHECKING:
    from tidings.broker.host import Host
    from tidings.broker.replica import Replica

log = logging.getLogger(__name__)

CHUNK = 1 << 20
RETRY = (0.5, 10.0)  # first and largest pause between checks of fragments that could not be checked
MEMBER_TIMEOUT = 30.0  # seconds one member may take to answer for one fragment
BEFORE_SYNC_TIMEOUT = 10.0  # seconds a recovering replica spends looking for contradictions before it resumes
UNASSIGNED_GIVE_UP = 3600.0  # seconds a broker keeps checking fragments of a journal it does not replicate


class Verdict(enum.Enum):
    KEEP = "keep"  # nothing contradicts it: serve and persist it
    DROP = "drop"  # another copy of the journal holds other bytes at its offsets
    UNKNOWN = "unknown"  # a member or store could not be asked: ask again later
    AHEAD = "ahead"  # nothing contradicts it, but no member is past it yet (asked with need_past)


class _Contradiction(Exception):
    """Bytes at an offset differ from the recovered fragment's."""


def _overlap(a: Fragment, begin: int, end: int) -> tuple[int, int]:
    return max(a.begin, begin), min(a.end, end)


def _same_as(frag: Fragment, file: SpoolFile, offset: int, data: bytes) -> None:
    """Raise _Contradiction unless the recovered file holds `data` at journal offset `offset`."""
    if file.pread(len(data), offset - frag.begin) != data:
        raise _Contradiction(f"offset {offset}")


def _check_store_fragment(frag: Fragment, file: SpoolFile, other: Fragment) -> None:
    """Compare the store's `other` with the recovered content where they overlap (blocking)."""
    begin, end = _overlap(other, frag.begin, frag.end)
    if (other.begin, other.end, other.sum) == (frag.begin, frag.end, frag.sum) or begin >= end:
        return
    stream = store_for(other.backing_store).open(other)
    try:
        skip = begin - other.begin
        while skip > 0:
            n = len(stream.read(min(CHUNK, skip)))
            if not n:
                raise OSError(f"fragment {other.content_name()} is shorter than its name says")
            skip -= n
        offset = begin
        while offset < end:
            data = stream.read(min(CHUNK, end - offset))
            if not data:
                raise OSError(f"fragment {other.content_name()} is shorter than its name says")
            _same_as(frag, file, offset, data)
            offset += len(data)
    finally:
        with contextlib.suppress(Exception):
            stream.close()


async def _check_member(
    channel: grpc.aio.Channel, frag: Fragment, file: SpoolFile, metadata: CallMetadata
) -> int | None:
    """Compare what one member serves of `frag`'s offsets (its spool files, or the store through it) ->
    the end of the member's index, or None if it cannot answer now."""
    stub = JournalStub(channel)  # type: ignore[no-untyped-call]  # generated gRPC stub, untyped
    listing = await stub.ListFragments(pb.FragmentsRequest(journal=frag.journal, do_not_proxy=True), metadata=metadata)
    if listing.status != pb.OK:
        return None
    for entry in listing.fragments:
        other = Fragment.from_proto(entry.spec)
        begin, end = _overlap(other, frag.begin, frag.end)
        if begin >= end or (other.begin, other.end, other.sum) == (frag.begin, frag.end, frag.sum):
            continue
        req = pb.ReadRequest(journal=frag.journal, offset=begin, end_offset=end, do_not_proxy=True)
        reached = begin
        async for resp in stub.Read(req, metadata=metadata):
            if resp.status != pb.OK:
                return None  # it no longer holds them as listed: ask again
            if resp.content:
                _same_as(frag, file, resp.offset, resp.content)
                reached = resp.offset + len(resp.content)
        if reached < end:
            return None  # (the read ended short, e.g. our token expired: what was not compared is no answer)
    return max((e.spec.end for e in listing.fragments), default=0)


def read_token(broker: Host, journal: str) -> CallMetadata:
    """The broker's own token for reading `journal` from its peers (none when it holds no keys)."""
    return broker.authorizer.metadata(Capability.READ, name_selector(journal))


async def check(
    frag: Fragment,
    file: SpoolFile,
    members: Iterable[str],
    channel: Callable[[str], grpc.aio.Channel],
    list_store: Callable[[], Awaitable[list[Fragment] | None]],
    need_past: bool = False,
    metadata: CallMetadata = (),
) -> Verdict:
    """Whether the recovered `frag` (content in `file`) agrees with the journal's members and stores.

    Every member is asked (one that cannot answer does not hide another's contradiction), then the
    store is listed: a fragment a member uploaded and dropped locally meanwhile is in that listing.
    `need_past`: KEEP only if some member's index already reaches past `frag`. `metadata`: the calls' token
    (a broker's own, READ of the journal: `read_token`), for members checking tokens."""
    unknown: list[str] = []
    furthest = -1
    try:
        for endpoint in members:
            try:
                async with asyncio.timeout(MEMBER_TIMEOUT):
                    end = await _check_member(channel(endpoint), frag, file, metadata)
            except (grpc.RpcError, TimeoutError, OSError) as exc:  # OSError: reading our own file failed
                unknown.append(f"{endpoint}: {exc!r}"[:200])
                continue
            if end is None:
                unknown.append(endpoint)
            else:
                furthest = max(furthest, end)
        listed = await list_store()
        if listed is None:
            unknown.append("the store listing failed")
        for other in listed or ():
            if other.begin < frag.end and frag.begin < other.end:
                try:
                    await asyncio.to_thread(_check_store_fragment, frag, file, other)
                except OSError as exc:
                    unknown.append(f"{other.content_name()}: {exc}")
    except _Contradiction as exc:
        log.warning(
            "journal %s: recovered fragment [%d, %d) differs from the journal's content (at %s): dropping it",
            frag.journal,
            frag.begin,
            frag.end,
            exc,
        )
        return Verdict.DROP
    if unknown:
        log.info("journal %s: cannot check recovered [%d, %d) yet: %s", frag.journal, frag.begin, frag.end, unknown)
        return Verdict.UNKNOWN
    return Verdict.AHEAD if need_past and furthest < frag.end else Verdict.KEEP


def drop(frag: Fragment, file: SpoolFile) -> None:
    """Remove a contradicted fragment's file (readers never saw it)."""
    file.unlinked = True
    with contextlib.suppress(FileNotFoundError):
        os.unlink(file.path)


def drop_from(pending: list[tuple[Fragment, SpoolFile]], i: int) -> int:
    """Drop pending[i] and every later fragment (the same abandoned history); -> the first one's begin."""
    begin = pending[i][0].begin
    for frag, file in pending[i:]:
        drop(frag, file)
    del pending[i:]
    return begin


async def _journal_refuses_appends(broker: Host, journal: str) -> bool | None:
    """Whether a zero-byte append (a barrier: it writes nothing) through this broker answers
    INDEX_HAS_GREATER_OFFSET (None: no answer now). It resumes a suspended journal, as any append
    does: asked without resuming, a suspended journal answers SUSPENDED, no answer, and the tail would
    wait on disk until the check gives up. Asked only for a recovered tail past the journal's brokers
    (rare), and a resumed journal costs replicas, not data."""
    stub = JournalStub(broker.channel(broker.endpoint))  # type: ignore[no-untyped-call]  # generated gRPC stub, untyped
    try:
        barrier = iter([pb.AppendRequest(journal=journal, commit=True)])
        metadata = broker.authorizer.metadata(Capability.APPEND, name_selector(journal))
        resp = await stub.Append(barrier, timeout=MEMBER_TIMEOUT, metadata=metadata)
    except grpc.RpcError:
        return None
    if resp.status == pb.INDEX_HAS_GREATER_OFFSET:
        return True
    return False if resp.status == pb.OK else None


def _members(route: pb.Route, me: pb.ProcessId) -> list[str]:
    return [
        route.endpoints[i]
        for i, m in enumerate(route.members)
        if (m.zone, m.suffix) != (me.zone, me.suffix) and i < len(route.endpoints) and route.endpoints[i]
    ]


class RecoveryChecks:
    """A broker's checks of its replicas' recovered fragments (see the module docstring)."""

    def __init__(self, broker: Host) -> None:
        self.broker = broker

    async def _members(self, replica: Replica) -> list[str] | None:
        res = await self.broker.resolver.resolve(replica.journal)
        if res.status != pb.OK or res.replica is not replica:
            return None
        return _members(res.route, self.broker.process_id)

    async def _check(self, replica: Replica, frag: Fragment, file: SpoolFile, members: list[str]) -> Verdict:
        """`check` of a fragment the replica recovered, asking its members with the broker's own token."""
        listed, token = functools.partial(_listed, replica), read_token(self.broker, frag.journal)
        return await check(frag, file, members, self.broker.channel, listed, metadata=token)

    async def before_sync(self, replica: Replica) -> int | None:
        """Drop the first recovered fragment the journal contradicts and every later one, before the
        spool resumes -> where the spool must resume instead (None: nothing dropped). Bounded."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(BEFORE_SYNC_TIMEOUT):
                members = await self._members(replica)
                if members is None:
                    return None
                for i, (frag, file) in enumerate(replica.unverified):
                    verdict = await self._check(replica, frag, file, members)
                    if verdict is Verdict.DROP:
                        return drop_from(replica.unverified, i)
        return None

    async def after_sync(self, replica: Replica) -> None:
        """Check the replica's recovered fragments until none is left, adopting or dropping each. Runs
        as one of the replica's tasks."""
        pause = RETRY[0]
        while replica.unverified:
            changed = replica.route_changed
            members = await self._members(replica)
            if members is not None and (replica.synchronized.is_set() or not members):
                for frag, file in list(replica.unverified):
                    verdict = await self._check(replica, frag, file, members)
                    if verdict is Verdict.KEEP:
                        replica.adopt(frag, file)
                    elif verdict is Verdict.DROP:
                        replica.unverified.remove((frag, file))
                        drop(frag, file)
                if not replica.unverified:
                    return
            waits = [asyncio.ensure_future(e.wait()) for e in (changed, replica.synchronized)]
            try:
                await asyncio.wait(waits, timeout=pause)
            finally:
                for w in waits:
                    w.cancel()
            pause = min(pause * 2, RETRY[1])


async def _listed(replica: Replica) -> list[Fragment] | None:
    """The replica's stores listed afresh (a store written meanwhile must be seen); None if that failed."""
    try:
        await replica.refresh_now()
    except Exception:  # the refresh loop reports it
        return None
    return [f for f, fl in replica.index.fragments() if fl is None]


async def _list_store(url: str, journal: str) -> list[Fragment] | None:
    try:
        return await asyncio.to_thread(store_for(url).list, journal)
    except Exception as exc:
        log.info("journal %s: listing %s to check recovered fragments failed: %s", journal, url, exc)
        return None


async def verify_unassigned(broker: Host, journal: str, fragments: list[tuple[Fragment, SpoolFile]]) -> None:
    """Check fragments recovered for a journal this broker does not replicate against its route's
    members and stores; persist those some member is already past (see the module docstring). The
    broker cancels it when the journal is assigned here (the replica recovers the directory itself);
    it gives up after `UNASSIGNED_GIVE_UP`, leaving what is left on disk."""
    pending = list(fragments)
    said: set[int] = set()
    directory = spool_directory(Path(broker.config.data_dir), journal)
    pause = RETRY[0]
    deadline = asyncio.get_running_loop().time() + UNASSIGNED_GIVE_UP
    while pending and asyncio.get_running_loop().time() < deadline:
        res = await broker.resolver.resolve(journal)
        item = broker.resolver.state.items.get(journal)
        if item is None or res.replica is not None:
            return  # deleted meanwhile, or assigned here
        stores = stores_of(item.spec, broker.config.default_store)
        if not stores:
            return  # nowhere to persist them: they wait on disk for the journal to come back
        members = _members(res.route, broker.process_id) if res.status == pb.OK else []
        list_store = functools.partial(_list_store, stores[0], journal)
        # In offset order, and only a prefix: a later fragment persisted before an earlier one is dropped
        # would stay in the store, past a hole.
        while pending and members:
            frag, file = pending[0]
            verdict = await check(
                frag,
                file,
                members,
                broker.channel,
                list_store,
                need_past=True,
                metadata=read_token(broker, frag.journal),
            )
            if verdict is Verdict.AHEAD and await _journal_refuses_appends(broker, journal):
                verdict = Verdict.KEEP  # the only copy, maybe of acknowledged appends: a reset-head goes past it
            if verdict is Verdict.KEEP:
                broker.persister.submit(frag, file, stores[0], delay=0.01)
                pending.pop(0)
                continue
            if verdict is Verdict.DROP:
                lower_head(directory, journal, drop_from(pending, 0))
            elif verdict is Verdict.AHEAD and frag.begin not in said:
                said.add(frag.begin)
                log.info(
                    "journal %s: recovered [%d, %d) is past the journal's end at its brokers; "
                    "left on disk until they reach it or the journal is assigned here",
                    journal,
                    frag.begin,
                    frag.end,
                )
            break
        if pending:
            await asyncio.sleep(pause)  # a member or store was unavailable, or the journal is not past them yet
            pause = min(pause * 2, RETRY[1])
