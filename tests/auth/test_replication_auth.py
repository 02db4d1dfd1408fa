"""The replication port of a broker with keys serves only primaries whose HELLO carries a token with the
REPLICATE capability: no token, a token of another key, one lacking REPLICATE, or a HELLO of the old
form are refused before any stream (UNAUTHENTICATED or PERMISSION_DENIED, the reason sent back and
logged), the port serving good primaries on; brokers with the same keys replicate to each other."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.broker.test_transport import echo, req
from tidings.auth import BearerAuthorizer, KeyedAuthorizer, KeySet, Verifier, generate_key, sign
from tidings.broker.transport import HEADER, HELLO, HELLO_PAYLOAD, Dialer, ReplicationServer, StreamError
from tidings.protocol.claims import Capability, Claims

KEYS = KeySet.parse(generate_key())
OTHER = KeySet.parse(generate_key())


def _token(keys: KeySet, cap: int) -> str:
    now = int(time.time())
    return sign(Claims(cap=cap, iat=now, exp=now + 600, sub="tester"), keys.signing_key)


async def _stream_through(server: ReplicationServer, dialer: Dialer) -> int:
    stream = dialer.open(server.endpoint, "zone-a/b1")
    stream.send(req(b"hello"))
    resp = await asyncio.wait_for(stream.recv(), 10)
    return resp.fragment.end


@pytest.mark.parametrize(
    ("authorizer", "says"),
    [
        (None, "UNAUTHENTICATED: no token: this broker has --auth-keys"),
        (BearerAuthorizer(_token(OTHER, Capability.REPLICATE)), "UNAUTHENTICATED"),
        (
            BearerAuthorizer(_token(KEYS, Capability.APPEND | Capability.READ)),
            "PERMISSION_DENIED: token lacks the REPLICATE",
        ),
    ],
    ids=["no-token", "other-key", "no-replicate"],
)
async def test_a_primary_without_a_replicate_token_is_refused_before_any_stream(authorizer, says: str) -> None:
    served = []

    async def handler(stream) -> None:
        served.append(stream)
        await echo(stream)

    server = await ReplicationServer(handler, "zone-a/b1", verifier=Verifier(KEYS)).start("127.0.0.1:0")
    refused, good = Dialer(authorizer=authorizer), Dialer(authorizer=KeyedAuthorizer(KEYS, sub="broker b0"))
    try:
        with pytest.raises(StreamError, match=f"the peer refused the connection: {says}"):
            await _stream_through(server, refused)
        assert not served
        assert await _stream_through(server, good) == 5  # (the port serves on)
    finally:
        await refused.aclose()
        await good.aclose()
        await server.aclose()


async def test_a_hello_of_the_old_form_is_refused_by_a_broker_with_keys() -> None:
    server = await ReplicationServer(echo, "zone-a/b1", verifier=Verifier(KEYS)).start("127.0.0.1:0")
    host, port = server.endpoint.rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        old = HELLO_PAYLOAD + b" zone-a/b1"
        writer.write(HEADER.pack(len(old), 0, HELLO) + old)
        answer = await asyncio.wait_for(reader.read(), 10)  # (its HELLO, its END on stream 0, then EOF)
        assert b"no token: this broker has --auth-keys" in answer
        writer.close()
    finally:
        await server.aclose()


async def test_brokers_with_the_same_keys_replicate(brokers) -> None:
    tc = await brokers(auth_keys=KEYS)
    for zone in ("zone-a", "zone-b"):
        await tc.add_broker(zone)
    await tc.create_journal("auth/replicated", 2)
    async with tc.client() as c:
        await c.append("auth/replicated", b"to both replicas")
        assert await c.read_all("auth/replicated") == b"to both replicas"


async def test_a_replicate_token_scoped_to_some_journals_sees_no_other_replica(brokers) -> None:
    """A REPLICATE token's selector scopes the connection: a stream for a journal outside it is answered
    as for a missing journal (no route, nothing of it), never served."""
    import hashlib

    from tidings.protocol import protocol_pb2 as pb

    tc = await brokers(auth_keys=KEYS)
    for zone in ("zone-a", "zone-b"):
        await tc.add_broker(zone)
    await tc.create_journal("auth/b2", 2, labels={"app": "b"})
    route = tc.route("auth/b2")
    peer = next(b for b in tc.brokers if b.config.suffix == route.members[1 - route.primary].suffix)
    scoped = _token(KEYS, Capability.ALL)  # (no selector: to show the same stream served, below)
    now = int(time.time())
    narrow = sign(Claims(cap=Capability.ALL, sel=_selector("app=a"), iat=now, exp=now + 600), KEYS.signing_key)
    empty = hashlib.sha1().digest()
    proposal = pb.Fragment(journal="auth/b2", begin=0, end=0, sum=empty, compression_codec=pb.NONE)
    stale = pb.Header(route=pb.Route(primary=-1), etcd=pb.Header.Etcd(revision=1))  # (answered at once: WRONG_ROUTE)
    first = pb.ReplicateRequest(header=stale, proposal=proposal, acknowledge=True).SerializeToString()
    answers = {}
    for name, tok in (("narrow", narrow), ("wide", scoped)):
        dialer = Dialer(authorizer=BearerAuthorizer(tok))
        try:
            stream = dialer.open(peer.replication.endpoint, f"{peer.config.zone}/{peer.config.suffix}")
            stream.send(first)
            answers[name] = await asyncio.wait_for(stream.recv(), 10)
            stream.abort()
        finally:
            await dialer.aclose()
    assert answers["narrow"].status == pb.JOURNAL_NOT_FOUND and not answers["narrow"].header.route.members
    wide = answers["wide"]  # (the same stream, with a token covering the journal: told its route)
    assert wide.status == pb.WRONG_ROUTE and len(wide.header.route.members) == 2


def _selector(text: str):
    from tidings.protocol.labels import parse_selector

    return parse_selector(text)
