"""Replicate: the peer side of a primary's pipeline stream.

For the stream's whole life the peer owns its replica's Spool exclusively, so no other
primary can mutate it meanwhile. It checks the first proposal's Route against its own (answering
WRONG_ROUTE with its own Header when it knows a different Route), validates every chunk and
proposal through the Spool (answering PROPOSAL_MISMATCH with its own Fragment and registers),
and rolls back uncommitted content when the stream ends, however it ends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from tidings.allocator.state import routes_equivalent
from tidings.broker import _metrics as metrics
from tidings.broker.replica import acquire
from tidings.fragment.spool import Spool
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate
from tidings.protocol.status import ValidationError

if TYPE_CHECKING:
    from tidings.broker.service import Broker

log = logging.getLogger(__name__)


async def serve_replicate(broker: Broker, context: grpc.aio.ServicerContext) -> None:
    first = await context.read()
    if first is grpc.aio.EOF:
        return
    try:
        validate.replicate_request(first)
        if not first.HasField("proposal") or not first.HasField("header"):
            raise ValidationError("replicate", "the first message must carry a Header and a proposal")
    except ValidationError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    journal = first.proposal.journal
    res = await broker.resolver.resolve(journal, first.header.etcd.revision)
    if res.status != pb.OK or res.replica is None or not routes_equivalent(res.route, first.header.route):
        status = res.status if res.status != pb.OK else pb.WRONG_ROUTE
        metrics.RPC_STATUS.labels("replicate", pb.Status.Name(status)).inc()
        await context.write(pb.ReplicateResponse(status=status, header=res.header))
        return
    replica = res.replica
    ok, spool = await acquire(replica.spool_slot, replica.closed)
    if not ok:
        await context.write(pb.ReplicateResponse(status=pb.WRONG_ROUTE, header=res.header))
        return
    assert isinstance(spool, Spool)
    try:
        req = first
        while True:
            resp = spool.apply(req)
            if resp.status != pb.OK:
                metrics.RPC_STATUS.labels("replicate", pb.Status.Name(resp.status)).inc()
                resp.header.CopyFrom(res.header)
            if req.acknowledge or resp.status != pb.OK:
                await context.write(resp)
            req = await context.read()
            if req is grpc.aio.EOF:
                return
            validate.replicate_request(req)
    except ValidationError as exc:
        log.warning("journal %s: replication stream refused: %s", journal, exc)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    finally:
        spool.rollback()
        replica.spool_slot.put_nowait(spool)
