"""ListFragments RPC: a journal's fragments as its replica's index knows them (local spool files
and persisted fragments, with their store URLs), once the replica has listed its stores; a broker
not holding the journal proxies to one that does (unless `do_not_proxy`), with its own token for that
journal. A journal the caller's token does not cover is JOURNAL_NOT_FOUND (the resolver)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from tidings.broker import _metrics as metrics
from tidings.fragment.store import store_for
from tidings.member import counted
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol import validate
from tidings.protocol.claims import Capability, Claims
from tidings.protocol.labels import name_selector
from tidings.protocol.status import ValidationError

if TYPE_CHECKING:
    from tidings.broker.host import Host


async def serve_list_fragments(
    broker: Host, req: pb.FragmentsRequest, context: grpc.aio.ServicerContext, claims: Claims
) -> pb.FragmentsResponse:
    with counted(metrics.RPC_STATUS, "list_fragments", context) as outcome:
        try:
            resp = await list_fragments(broker, req, claims)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        outcome.append(resp.status)
        return resp


async def list_fragments(broker: Host, req: pb.FragmentsRequest, claims: Claims) -> pb.FragmentsResponse:
    validate.journal_name(req.journal, "fragments.journal")
    rev = req.header.etcd.revision if req.HasField("header") else 0
    res = await broker.resolver.resolve(req.journal, rev, claims)
    if res.status != pb.OK:
        return pb.FragmentsResponse(status=res.status, header=res.header)
    if res.replica is None:
        if req.do_not_proxy or not res.route.members:
            return pb.FragmentsResponse(status=pb.NOT_JOURNAL_BROKER, header=res.header)
        fwd = pb.FragmentsRequest(header=res.header, journal=req.journal, do_not_proxy=True)
        stub = pb_grpc.JournalStub(broker.channel(res.route.endpoints[0]))  # type: ignore[no-untyped-call]  # generated gRPC stub, untyped
        metadata = broker.authorizer.metadata(Capability.READ, name_selector(req.journal), claims.exp)
        proxied: pb.FragmentsResponse = await stub.ListFragments(fwd, metadata=metadata)
        return proxied
    await res.replica.index.wait_first_refresh()
    resp = pb.FragmentsResponse(status=pb.OK, header=res.header)
    for frag, _path in res.replica.index.fragments():
        url = store_for(frag.backing_store).url(frag) if frag.backing_store else ""
        resp.fragments.append(pb.FragmentsResponse.Entry(spec=frag.to_proto(), url=url))
    return resp
