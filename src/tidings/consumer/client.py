"""ShardClient: a consumer's Shard service, from any of its processes (what `tidings shards` uses).

`stat` goes to the shard's primary: asked of another process, it follows the route that one
answers with. Transient failures (a process restarting, no primary yet) are retried with backoff
for `deadline` seconds; definite refusals raise the StatusError naming the status. `get_hints` is
answered by any process (from etcd). With `auth`, each call carries Gazette's claims for it: READ of
the shard (`id=<shard>`) for Stat and GetHints, LIST of the selector, APPLY (of each shard unassigned).
"""

from __future__ import annotations

import asyncio
import builtins
import time
from typing import Any

import grpc

from tidings.auth.authorizer import Authorizer, CallMetadata, NoAuthorizer
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.claims import Capability
from tidings.protocol.status import (
    PermissionDeniedError,
    TransportError,
    UnauthenticatedError,
    map_grpc_error,
    raise_for_status,
)
from tidings.tls import TLS
from tidings.tls import channel as tls_channel

__all__ = ["ShardClient"]

RETRIABLE = {pb.NO_SHARD_PRIMARY, pb.NOT_SHARD_PRIMARY}
STAT_MARGIN = 1.0  # seconds a Stat answers before the caller's deadline (with what it has read through)


class ShardClient:
    """The Shard service of the consumer at `endpoint` (HOST:PORT)."""

    def __init__(
        self, endpoint: str, deadline: float = 30.0, tls: TLS | None = None, auth: Authorizer | None = None
    ) -> None:
        self.endpoint = endpoint
        self.deadline = deadline
        self.tls = tls
        self.auth: Authorizer = auth if auth is not None else NoAuthorizer()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, endpoint: str | None = None) -> pb_grpc.ShardStub:
        endpoint = endpoint or self.endpoint
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = tls_channel(endpoint, self.tls)
        return pb_grpc.ShardStub(channel)  # type: ignore[no-untyped-call]  # generated gRPC stub, untyped

    async def aclose(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    async def __aenter__(self) -> ShardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _metadata(self, method: str, request: Any) -> CallMetadata:
        """The call's authorization: Gazette's claims per Shard RPC (consumer/protocol/auth.go)."""
        if method in ("Stat", "GetHints"):
            return self.auth.metadata(Capability.READ, labels.name_selector(request.shard, "id"))
        if method == "List":
            return self.auth.metadata(Capability.LIST, request.selector)
        if method == "Unassign":
            ids = labels.label_set([("id", shard) for shard in request.shards])
            return self.auth.metadata(Capability.APPLY, pb.LabelSelector(include=ids))
        return self.auth.metadata(Capability.APPLY)

    async def _call(self, method: str, request: Any, endpoint: str | None = None, timeout: float | None = 30.0) -> Any:
        try:
            metadata = self._metadata(method, request)
            return await getattr(self._stub(endpoint), method)(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            retriable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            where = endpoint or self.endpoint
            err = map_grpc_error(exc, where, role="consumer")
            if isinstance(err, UnauthenticatedError | PermissionDeniedError):
                raise err from None  # (a refusal of the token: its one line, definite)
            if err.unreachable or code == grpc.StatusCode.UNIMPLEMENTED or "Failed parsing HTTP/2" in str(err):
                err.retriable = retriable and err.unreachable  # (nobody there, or not a consumer: it says which)
                raise err from None
            raise TransportError(f"consumer {where}: {exc.details() or code.name}", code, retriable) from None

    async def list(self, selector: pb.LabelSelector | None = None) -> pb.ShardListResponse:
        resp: pb.ShardListResponse = await self._call("List", pb.ShardListRequest(selector=selector))
        raise_for_status(resp.status)
        return resp

    async def apply(self, changes: builtins.list[pb.ShardApplyRequest.Change]) -> pb.ShardApplyResponse:
        resp: pb.ShardApplyResponse = await self._call("Apply", pb.ShardApplyRequest(changes=changes))
        raise_for_status(resp.status, detail=resp.detail)
        return resp

    async def unassign(
        self, shards: builtins.list[str], only_failed: bool = False, dry_run: bool = False
    ) -> builtins.list[str]:
        req = pb.UnassignRequest(shards=shards, only_failed=only_failed, dry_run=dry_run)
        resp: pb.UnassignResponse = await self._call("Unassign", req)
        raise_for_status(resp.status, detail=", ".join(resp.shards))
        return list(resp.shards)

    async def get_hints(self, shard: str) -> pb.GetHintsResponse:
        """The shard's recovery hints as etcd holds them (any process answers): SHARD_NOT_FOUND and
        NO_RECOVERY_LOG raise their StatusError."""
        resp: pb.GetHintsResponse = await self._call("GetHints", pb.GetHintsRequest(shard=shard))
        raise_for_status(resp.status, detail=resp.detail)
        return resp

    async def replica_stat(self, shard: str, endpoint: str, timeout: float = 5.0) -> pb.StatResponse:
        """Stat(any_replica) of the process at `endpoint`: its replica of `shard` as it stands (a standby's
        recovery-log offset); NOT_SHARD_PRIMARY when it has none."""
        resp: pb.StatResponse = await self._call(
            "Stat", pb.StatRequest(shard=shard, any_replica=True), endpoint, timeout=timeout
        )
        return resp

    async def stat(
        self, shard: str, read_through: dict[str, int] | None = None, timeout: float = 30.0
    ) -> pb.StatResponse:
        """The shard's read-through offsets, once it has read through `read_through` (at most `timeout` s)."""
        req = pb.StatRequest(shard=shard, read_through=read_through or {})
        give_up = time.monotonic() + max(timeout, self.deadline)
        endpoint: str | None = None
        attempt = 0
        resp: pb.StatResponse
        while True:
            left = max(0.1, give_up - time.monotonic())
            try:
                resp = await self._call("Stat", req, endpoint, timeout=min(timeout, left) + STAT_MARGIN + 0.5)
            except TransportError as exc:
                if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and "has not read through" in str(
                    exc
                ):  # (the primary)
                    raise TimeoutError(f"shard {shard!r} has not read through {dict(req.read_through)} within "
                                       f"{timeout:g}s") from None  # fmt: skip
                if not exc.retriable or time.monotonic() >= give_up:
                    raise
                endpoint = None  # (ask the first consumer again where the primary is)
            else:
                route = resp.header.route
                if resp.status == pb.NOT_SHARD_PRIMARY and route.primary >= 0 and route.endpoints:
                    primary = route.endpoints[route.primary]
                    if primary and primary != endpoint:
                        endpoint = primary
                        continue
                if resp.status not in RETRIABLE or time.monotonic() >= give_up:
                    detail = f"shard {shard!r}" + (f": {resp.detail}" if resp.detail else "")
                    raise_for_status(resp.status, detail=detail)
                    behind = {j: o for j, o in req.read_through.items() if 0 < resp.read_through.get(j, o) < o}
                    if behind:
                        raise TimeoutError(f"shard {shard!r} has not read through {behind} within {timeout:g}s")
                    return resp
            attempt += 1
            await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
