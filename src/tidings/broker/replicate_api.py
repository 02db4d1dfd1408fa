"""Replicate: the peer side of a primary's pipeline stream (Gazette's `replicate_api.go`).

For the stream's whole life the peer owns its replica's Spool exclusively, so no other primary can
mutate it meanwhile. It checks the first proposal's Route against its own (answering WRONG_ROUTE
with its own Header when it knows a different Route), validates every chunk and proposal through
the Spool (answering PROPOSAL_MISMATCH with its own Fragment and registers when the proposal asked
for an acknowledgement), records each commit in the spool's HEAD before answering it, and rolls
back uncommitted content when the stream ends, however it ends. A fragment this replica completes
while a new pipeline synchronizes (before any content) is persisted at once rather than after the
replicas' delay: when a primary died between its peers, it may hold bytes the other replicas rolled
past, and their readers wait for it. A proposal that asked for no acknowledgement but does not
apply ends the stream with an error: answering it would pair the answer with the primary's next
proposal.

The stream is served through `transport.PeerStream`, so the same code serves any transport.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from tidings.broker import _metrics as metrics
from tidings.broker.replica import acquire
from tidings.broker.transport import PeerStream
from tidings.fragment.spool import Spool
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.route import routes_equivalent
from tidings.protocol.status import ValidationError

if TYPE_CHECKING:
    from tidings.broker.host import Host

log = logging.getLogger(__name__)


async def serve_replicate(broker: Host, stream: PeerStream) -> None:
    first = await stream.recv()
    if first is None:
        return
    try:
        validate.replicate_request(first)
        if not first.HasField("proposal") or not first.HasField("header"):
            raise ValidationError("replicate", "the first message must carry a Header and a proposal")
    except ValidationError as exc:
        await stream.fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return
    journal = first.proposal.journal
    while True:
        res = await broker.resolver.resolve(journal, first.header.etcd.revision, stream.claims)
        if res.status != pb.OK or res.replica is None or not routes_equivalent(res.route, first.header.route):
            status = res.status if res.status != pb.OK else pb.WRONG_ROUTE
            metrics.RPC_STATUS.labels("replicate", pb.Status.Name(status)).inc()
            await stream.send(pb.ReplicateResponse(status=status, header=res.header))
            return
        replica = res.replica
        ok, spool = await acquire(replica.spool_slot, replica.route_changed, replica.closed)
        if ok:
            break
        if replica.closed.is_set():
            await stream.send(pb.ReplicateResponse(status=pb.WRONG_ROUTE, header=res.header))
            return
        # The route changed while we waited for the spool: resolve again.
    assert isinstance(spool, Spool)
    header: pb.Header | None = res.header
    streamed = False  # the stream has carried content: it is past its synchronization
    try:
        req = first
        while True:
            streamed = streamed or bool(req.content)
            # A fragment completed while a new pipeline synchronizes may be the only copy of its last
            # bytes outside a failed primary (the others roll forward past them): persist it at once.
            resp = spool.apply(req, primary=not streamed)
            spool.flush_head()  # a commit is recorded before the primary counts on it (a restart resumes there)
            if resp.status != pb.OK:
                metrics.RPC_STATUS.labels("replicate", pb.Status.Name(resp.status)).inc()
            elif req.HasField("proposal"):
                replica.synchronized.set()  # a pipeline of the current route holds our spool's end
            if req.acknowledge:
                if header is not None:  # the Header travels with the first response only
                    resp.header.CopyFrom(header)
                    header = None
                await stream.send(resp)
            elif resp.status != pb.OK:
                log.warning("journal %s: an unacknowledged proposal did not apply; ending the stream", journal)
                await stream.fail(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"journal {journal}: proposal {req.proposal.begin}..{req.proposal.end} asked for no "
                    f"acknowledgement but answers {pb.Status.Name(resp.status)}",
                )
                return
            nxt = await stream.recv()
            if nxt is None:
                return
            validate.replicate_request(nxt)
            req = nxt
    except ValidationError as exc:
        log.warning("journal %s: replication stream refused: %s", journal, exc)
        await stream.fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    finally:
        spool.rollback()
        replica.spool_slot.put_nowait(spool)
