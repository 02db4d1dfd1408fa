"""Read RPC: committed content from an offset (or the write head), optionally blocking and tailing.

Any replica serves reads, from its local spool files or from persisted fragments (proxied from
the store); a broker not holding the journal proxies to one that does. Each fragment's metadata
(the Fragment, its store URL if persisted, the write head) precedes its content frames. Only
committed bytes are served: the index learns of spool content only when it commits. A journal the
caller's token does not cover is JOURNAL_NOT_FOUND (the resolver); a proxied read carries the broker's
own token for that journal alone; a blocking read ends (cleanly: its client opens it again with its
current token) once the caller's token expires.

A read never skips committed bytes silently: over an offset no fragment covers it moves on only
as the index allows (to a persisted fragment at the journal's start or persisted long ago, see
`FragmentIndex.query`), and then its metadata frame's `offset` is past the requested one, which
clients report as an offset jump. Otherwise a blocking read waits and a non-blocking one answers
OFFSET_NOT_YET_AVAILABLE. Local content is read through the spool file's open descriptor, which
stays valid whatever happens to the file's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import zlib
from typing import TYPE_CHECKING, BinaryIO

import grpc
import zstandard

from tidings.auth import seconds_left
from tidings.broker import _metrics as metrics
from tidings.fragment.spool import SpoolFile
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.claims import Capability, Claims
from tidings.protocol.labels import name_selector
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.status import ValidationError

if TYPE_CHECKING:
    from prometheus_client import Counter

    from tidings.broker.host import Host
    from tidings.broker.resolver import Resolution
    from tidings.fragment.fragment import Fragment
    from tidings.fragment.index import FragmentIndex

log = logging.getLogger(__name__)

CHUNK = 256 * 1024
READ_REFRESH_TIMEOUT = 10.0  # seconds a read at a hole below the write head waits for a store listing


def _expired(claims: Claims) -> bool:
    left = seconds_left(claims)
    return left is not None and left <= 0


async def serve_read(broker: Host, req: pb.ReadRequest, context: grpc.aio.ServicerContext, claims: Claims) -> int:
    """Serve one Read RPC for the holder of `claims`; the Status it ended with (for the RPC counter)."""
    try:
        validate.read_request(req)
    except ValidationError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    rev = req.header.etcd.revision if req.HasField("header") else 0
    res = await broker.resolver.resolve(req.journal, rev, claims)
    if res.status != pb.OK:  # (a fully suspended journal holds nothing: its next append lands at its offset)
        head = res.spec.suspend.offset if res.status == pb.SUSPENDED and res.spec is not None else 0
        await context.write(pb.ReadResponse(status=res.status, header=res.header, write_head=head))
        return res.status
    assert res.spec is not None  # resolved OK: the journal's spec is known
    if res.spec.flags == pb.JournalSpec.O_WRONLY:
        await context.write(pb.ReadResponse(status=pb.NOT_ALLOWED, header=res.header))
        return pb.NOT_ALLOWED
    replica = res.replica
    if replica is None:
        if req.do_not_proxy or not res.route.members:
            status = pb.NOT_JOURNAL_BROKER if res.route.members else pb.NO_JOURNAL_PRIMARY_BROKER
            await context.write(pb.ReadResponse(status=status, header=res.header))
            return status
        await _proxy(broker, req, res, context, claims)
        return pb.OK
    index = replica.index
    store_error = await replica.wait_ready()
    if store_error is not None:
        await context.write(pb.ReadResponse(status=pb.FRAGMENT_STORE_UNHEALTHY, header=res.header))
        return pb.FRAGMENT_STORE_UNHEALTHY
    offset = req.offset if req.offset >= 0 else replica.write_head
    first = True
    listed = False
    vanished = None  # a listed fragment found missing from its store
    counter = metrics.JOURNAL_READ_BYTES.labels(req.journal) if broker.config.metrics_journals else None
    # (a token expiring ends a read of a backlog too, as it ends a blocking one: the client reopens)
    while (req.end_offset == 0 or offset < req.end_offset) and not _expired(claims):
        found = index.query(offset)
        if found is None:
            if not listed and offset < index.end_offset:
                # Committed content below the write head that this replica's index lacks (it rolled past
                # another replica's bytes, which that one persists at once): list the stores now, not at
                # the next refresh interval. A non-blocking read still answers OFFSET_NOT_YET_AVAILABLE
                # if the hole remains (Gazette's semantics); a blocking one waits for it to fill.
                listed = True
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(READ_REFRESH_TIMEOUT):
                        await replica.refresh_soon()
                continue
            if not req.block:
                await context.write(
                    pb.ReadResponse(
                        status=pb.OFFSET_NOT_YET_AVAILABLE,
                        header=res.header if first else None,
                        offset=offset,
                        write_head=replica.write_head,
                        spool_end=replica.synchronized_spool_end,
                    )
                )
                return pb.OFFSET_NOT_YET_AVAILABLE
            if not await _wait_for_change(index, replica.closed, seconds_left(claims)) or replica.closed.is_set():
                return pb.OK  # the token expired, or the replica moved away: the client opens the read again
            continue
        frag, file = found
        stream: BinaryIO | None = None
        if file is None and not req.metadata_only:
            try:
                stream = await asyncio.to_thread(store_for(frag.backing_store).open, frag)
            except FileNotFoundError:
                # Removed from its store since the last listing (retention, `journals prune`): list the
                # stores again, after which the read moves on from the journal's new first byte.
                if frag == vanished:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, f"fragment {frag.content_name()} of {req.journal!r} is gone"
                    )
                vanished = frag
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(READ_REFRESH_TIMEOUT):
                        await replica.refresh_now()
                continue
        if frag.begin > offset:
            log.info("journal %s: read skips [%d, %d): no fragment holds it", req.journal, offset, frag.begin)
            offset = frag.begin
        until = frag.end if req.end_offset == 0 else min(frag.end, req.end_offset)
        try:
            await context.write(
                pb.ReadResponse(
                    status=pb.OK,
                    header=res.header if first else None,
                    offset=offset,
                    write_head=replica.write_head,
                    spool_end=replica.synchronized_spool_end,
                    fragment=frag.to_proto(),
                    fragment_url=store_for(frag.backing_store).url(frag) if frag.backing_store else "",
                )
            )
            first = False
            if req.metadata_only:
                return pb.OK
            source = file if file is not None else stream
            assert source is not None  # a store's file was opened above (not a metadata_only read)
            offset = await _send_content(context, frag, source, offset, until, counter)
        except _CORRUPT as exc:  # the fragment's content itself is bad: no retry mends it (DATA_LOSS is definite)
            log.error("journal %s: fragment %s is corrupt: %s", req.journal, frag.content_name(), exc)
            await context.abort(
                grpc.StatusCode.DATA_LOSS,
                f"journal {req.journal!r}: fragment {frag.content_name()} is corrupt at {offset} ({exc}); replace the "
                "file in its store with a good copy",
            )
        except OSError as exc:  # a store that fails mid-read: the client retries from its offset
            log.warning("journal %s: reading fragment %s failed: %s", req.journal, frag.content_name(), exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"reading journal {req.journal!r} at {offset}: {exc}")
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(stream.close)
    return pb.OK


class FragmentCorruptError(Exception):
    """A fragment file does not hold what its name says (shorter, or not valid for its codec)."""


# What reading a fragment raises when its file is bad (gzip's BadGzipFile is an OSError: listed first).
_CORRUPT = (FragmentCorruptError, gzip.BadGzipFile, zlib.error, zstandard.ZstdError, EOFError)


async def _wait_for_change(index: FragmentIndex, closed: asyncio.Event, timeout: float | None) -> bool:
    """Wait for the index to change or the replica to close, at most `timeout` seconds (None: no limit):
    False once that passed with neither."""
    waiter = asyncio.ensure_future(index.wait_for_change())
    stop = asyncio.ensure_future(closed.wait())
    try:
        done, _ = await asyncio.wait([waiter, stop], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (waiter, stop):
            t.cancel()
    return bool(done)


async def _send_content(
    context: grpc.aio.ServicerContext,
    frag: Fragment,
    source: SpoolFile | BinaryIO,
    offset: int,
    until: int,
    counter: Counter | None = None,
) -> int:
    """Stream [offset, until) of `frag` from its local file or its opened store file; returns the new offset."""
    if isinstance(source, SpoolFile):
        while offset < until:
            data = source.pread(min(CHUNK, until - offset), offset - frag.begin)
            if not data:
                raise OSError(f"spool file {source.path} ends before the committed offset {offset}")
            offset = await _send(context, offset, data, counter)
        return offset
    skip = offset - frag.begin
    while skip > 0:
        data = await asyncio.to_thread(source.read, min(CHUNK, skip))
        if not data:
            raise FragmentCorruptError(f"fragment {frag.content_name()} is shorter than its name says")
        skip -= len(data)
    while offset < until:
        data = await asyncio.to_thread(source.read, min(CHUNK, until - offset))
        if not data:
            raise FragmentCorruptError(f"fragment {frag.content_name()} is shorter than its name says")
        offset = await _send(context, offset, data, counter)
    return offset


async def _send(context: grpc.aio.ServicerContext, offset: int, data: bytes, counter: Counter | None) -> int:
    """Send `data` read at `offset`, counted (and per journal, with a `counter`); the offset after it."""
    await context.write(pb.ReadResponse(offset=offset, content=data))
    metrics.READ_BYTES.inc(len(data))
    if counter is not None:
        counter.inc(len(data))
    return offset + len(data)


async def _proxy(
    broker: Host, req: pb.ReadRequest, res: Resolution, context: grpc.aio.ServicerContext, claims: Claims
) -> None:
    """Relay the read from a replica of the route (preferring one in our zone), with the broker's own token
    for this journal alone, expiring no later than the caller's (never the caller's token)."""
    route = res.route
    order = sorted(range(len(route.members)), key=lambda i: route.members[i].zone != broker.process_id.zone)
    endpoint = route.endpoints[order[0]]
    fwd = pb.ReadRequest()
    fwd.CopyFrom(req)
    fwd.header.CopyFrom(res.header)
    fwd.do_not_proxy = True
    metadata = broker.authorizer.metadata(Capability.READ, name_selector(req.journal), claims.exp)
    call = JournalStub(broker.channel(endpoint)).Read(fwd, metadata=metadata)  # type: ignore[no-untyped-call]  # generated gRPC stub, untyped
    try:
        async for resp in call:
            await context.write(resp)
    except grpc.RpcError as exc:  # the replica failed: say so with its code (UNAVAILABLE: the client retries)
        await context.abort(exc.code(), f"proxied read from {endpoint}: {exc.details()}")
    finally:
        call.cancel()
