"""Test support for capability tokens: tokens signed with a test key, their metadata, and a walk of a
gRPC service's methods calling each with an empty request (what a server answers a call without a
token, or with one lacking the capability), for tests/auth."""

from __future__ import annotations

import time
from typing import Any

import grpc

from tidings.auth import sign
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability, Claims

KEY = bytes(range(32))  # the key test servers hold (KeySet((KEY,)))


def token(cap: int, sel: str = "", *, key: bytes = KEY, ttl: int = 3600, sub: str = "tester") -> str:
    """A token for `cap` over `sel` (selector text), signed with `key`, expiring in `ttl` seconds."""
    now = int(time.time())
    return sign(Claims(cap=cap, sel=labels.parse_selector(sel), iat=now, exp=now + ttl, sub=sub), key)


def bearer(tok: str) -> tuple[tuple[str, str], ...]:
    """A call's metadata carrying `tok`."""
    return (("authorization", f"Bearer {tok}"),)


def unrevisioned(resp: Any) -> Any:
    """`resp` without its header's etcd revision (the KeySpace may move on between two calls)."""
    out = type(resp)()
    out.CopyFrom(resp)
    if "header" in out.DESCRIPTOR.fields_by_name:  # (an UnassignResponse has none)
        out.header.etcd.revision = 0
    return out


def methods(service: str) -> list[Any]:
    """The methods of the gRPC `service` (Journal, Shard, Target) as protocol.proto declares them."""
    return list(pb.DESCRIPTOR.services_by_name[service].methods)


def _multicallable(ch: grpc.aio.Channel, method: Any) -> Any:
    request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
    kind = {
        (False, False): ch.unary_unary,
        (False, True): ch.unary_stream,
        (True, False): ch.stream_unary,
        (True, True): ch.stream_stream,
    }[(method.client_streaming, method.server_streaming)]
    path = f"/{method.containing_service.full_name}/{method.name}"
    return kind(path, request_serializer=request.SerializeToString, response_deserializer=response.FromString)


async def outcome(ch: grpc.aio.Channel, method: Any, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    """The code an empty request of `method` ends with."""
    request = getattr(pb, method.input_type.name)()
    call = _multicallable(ch, method)(iter([request]) if method.client_streaming else request, metadata=metadata)
    try:
        if method.server_streaming:
            async for _ in call:
                call.cancel()
                break
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def walk_capabilities(ch: grpc.aio.Channel, service: str, needs: dict[str, int], sel: str = "") -> None:
    """Every RPC of `service` (each in `needs`, with the capability it needs) called without a token is
    UNAUTHENTICATED, with a token lacking its capability PERMISSION_DENIED, and with a token of exactly
    its capability (over `sel`) gets past the check."""
    walked = methods(service)
    assert sorted(m.name for m in walked) == sorted(needs), f"a {service} RPC without its capability in `needs`"
    for m in walked:
        assert await outcome(ch, m, ()) == grpc.StatusCode.UNAUTHENTICATED, m.name
        lacking = bearer(token(Capability.ALL & ~needs[m.name]))
        assert await outcome(ch, m, lacking) == grpc.StatusCode.PERMISSION_DENIED, m.name
        exact = await outcome(ch, m, bearer(token(needs[m.name], sel)))
        assert exact not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), m.name


def refusals(service: str, code: str) -> float:
    """How many refusals of `service` with `code` the process counted (tidings_auth_refusals_total)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("tidings_auth_refusals_total", {"service": service, "code": code}) or 0.0
