"""No broker RPC acts without a token allowing it, and a refusal reveals nothing of journals outside the
token's selector (DESIGN.md invariant 11; docs/design/production.md §3.7-§3.9), against real brokers on
real etcd: every Journal RPC checks a capability (a walk of the service's methods, so a new RPC without
one fails here); bad tokens are UNAUTHENTICATED, a token lacking the capability PERMISSION_DENIED, and
after each refusal nothing was written and a good call on the same broker works; a journal outside the
selector answers exactly as a missing one; Apply cannot reach outside the selector, by creating,
relabelling or deleting; a broker proxying a call signs its own token for that journal alone; `AA==`
admits calls without a token only; brokers holding two keys take tokens of either; a token expiring
ends a blocking read and rolls back an append still streaming; refusals are logged once per peer and
reason, and counted."""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from typing import Any

import grpc
import pytest

import tidings.auth.jwt as jwt_module
import tidings.auth.verifier as verifier_module
from tests.support.auth import KEY, refusals, unrevisioned, walk_capabilities
from tests.support.auth import bearer as _bearer
from tests.support.auth import token as _token
from tests.support.cluster import TestCluster
from tests.support.waiting import wait_until
from tidings.auth import BearerAuthorizer, KeyedAuthorizer, KeySet, NoAuthorizer
from tidings.broker.service import Broker
from tidings.client import AsyncClient
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability, Claims
from tidings.protocol.protocol_pb2_grpc import JournalStub
from tidings.protocol.specs import spec_from_dict
from tidings.protocol.status import (
    JournalNotFoundError,
    NotAllowedError,
    PermissionDeniedError,
    TransportError,
    UnauthenticatedError,
)

OTHER, THIRD = b"o" * 32, b"t" * 32
KEYS = KeySet((KEY,))
A, B = "auth/a", "auth/b"  # labelled app=a and app=b

# What each Journal RPC needs (docs/design/production.md §3.7): a new RPC must be added here, with its check.
NEEDS = {
    "List": Capability.LIST,
    "Apply": Capability.APPLY,
    "Read": Capability.READ,
    "Append": Capability.APPEND,
    "ListFragments": Capability.READ,
    "ListMembers": Capability.LIST,
}


class _Header:
    """An authorizer sending any `authorization` value (a malformed one too)."""

    def __init__(self, value: str) -> None:
        self.value = value

    def metadata(self, cap: int, selector: Any = None, exp: Any = None) -> tuple[tuple[str, str], ...]:
        return (("authorization", self.value),)


def _alg_none() -> str:
    """A token claiming every capability, 'signed' with the algorithm none (JWT's classic hole)."""

    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    now = int(time.time())
    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part({'cap': 0xFFFFFFFF, 'iat': now, 'exp': now + 60})}."


async def _cluster(brokers: Any, keys: KeySet = KEYS) -> TestCluster:
    """Two brokers holding `keys`; `auth/a` (app=a) and `auth/b` (app=b), one replica each."""
    tc: TestCluster = await brokers(auth_keys=keys)
    await tc.add_broker("zone-a")
    await tc.add_broker("zone-b")
    await tc.create_journal(A, 1, labels={"app": "a"})
    await tc.create_journal(B, 1, labels={"app": "b"})
    return tc


@pytest.fixture
async def tc(brokers: Any) -> TestCluster:
    return await _cluster(brokers)


def _client(tc: TestCluster, auth: Any, i: int = 0) -> AsyncClient:
    return AsyncClient(tc.brokers[i].endpoint, retries=0, auth=auth)


async def _head(tc: TestCluster, journal: str) -> int:
    async with tc.client() as c:  # (the test's own client: it signs with the brokers' keys)
        return await c.write_head(journal)


def _primary(tc: TestCluster, journal: str) -> tuple[Broker, Broker]:
    """The journal's primary, and a broker that is not in its route."""
    route = tc.route(journal)
    lead = route.members[route.primary].suffix
    primary = next(b for b in tc.brokers if b.config.suffix == lead)
    other = next(b for b in tc.brokers if b.config.suffix not in {m.suffix for m in route.members})
    return primary, other


# -- every RPC checks its capability ----------------------------------------------------------------------


async def test_every_journal_rpc_checks_its_capability_first(tc: TestCluster) -> None:
    """A walk of the Journal service: each RPC without a token is UNAUTHENTICATED, with a token lacking its
    capability PERMISSION_DENIED, and with a token of exactly its capability gets past the check."""
    async with grpc.aio.insecure_channel(tc.brokers[0].endpoint) as ch:
        await walk_capabilities(ch, "Journal", NEEDS)


# -- refusals: their codes, nothing written -------------------------------------------------------------


@pytest.mark.parametrize(
    "auth,reason",
    [
        pytest.param(NoAuthorizer(), "no token: pass --auth-token (TIDINGS_AUTH_TOKEN)", id="no-token"),
        pytest.param(BearerAuthorizer(_token(Capability.ALL, ttl=-60)), "token expired ", id="expired"),
        pytest.param(BearerAuthorizer(_token(Capability.ALL, key=OTHER)), "token signature does not", id="other-key"),
        pytest.param(BearerAuthorizer(_alg_none()), "token algorithm none is not accepted", id="alg-none"),
        pytest.param(BearerAuthorizer("not.a-token"), "malformed token", id="malformed"),
        pytest.param(_Header("Basic Ym9iOnB3"), "invalid or unsupported Authorization header", id="basic"),
    ],
)
async def test_a_bad_token_is_unauthenticated_and_writes_nothing(tc: TestCluster, auth: Any, reason: str) -> None:
    before = await _head(tc, A)
    async with _client(tc, auth) as c:
        with pytest.raises(UnauthenticatedError) as exc:
            await c.append(A, b"refused\n")
    assert str(exc.value).startswith(f"UNAUTHENTICATED from {tc.brokers[0].endpoint}: {reason}"), exc.value
    assert await _head(tc, A) == before
    async with _client(tc, BearerAuthorizer(_token(Capability.APPEND, f"name={A}"))) as c:
        assert (await c.append(A, b"good\n")).begin == before  # (the same broker, then a good call)


async def test_a_read_token_cannot_append(tc: TestCluster) -> None:
    before = await _head(tc, A)
    async with _client(tc, BearerAuthorizer(_token(Capability.READ | Capability.LIST))) as c:
        with pytest.raises(NotAllowedError) as exc:
            await c.append(A, b"refused\n")
        assert await c.read_all(A) == b""  # (reading: what it may do)
    assert isinstance(exc.value, PermissionDeniedError)
    endpoint = tc.brokers[0].endpoint
    assert str(exc.value) == f"NOT_ALLOWED from {endpoint}: token lacks the APPEND capability (it has LIST,READ)"
    assert exc.value.reason == "token lacks the APPEND capability (it has LIST,READ)"
    assert await _head(tc, A) == before
    async with _client(tc, BearerAuthorizer(_token(Capability.APPEND))) as c:
        await c.append(A, b"good\n")


# -- a journal outside the selector is missing --------------------------------------------------------------


async def test_a_journal_outside_the_selector_answers_exactly_as_a_missing_one(tc: TestCluster) -> None:
    """Through each broker (the one holding `auth/b` too): Append, Read and ListFragments of `auth/b` with a
    token for app=a give the very response a journal that does not exist gives; List leaves it out, and
    ListMembers does not count it."""
    token = _token(Capability.APPEND | Capability.READ | Capability.LIST, "app=a")
    before = await _head(tc, B)
    for broker in tc.brokers:
        async with grpc.aio.insecure_channel(broker.endpoint) as ch:
            stub, md = JournalStub(ch), _bearer(token)

            async def append(journal: str, stub: Any = stub, md: Any = md) -> pb.AppendResponse:
                whole = pb.AppendRequest(journal=journal, content=b"hidden\n", commit=True)
                return await stub.Append(iter([whole]), metadata=md)

            async def read(journal: str, stub: Any = stub, md: Any = md) -> pb.ReadResponse:
                async for resp in stub.Read(pb.ReadRequest(journal=journal, block=True), metadata=md):
                    return resp
                raise AssertionError("no response")

            async def fragments(journal: str, stub: Any = stub, md: Any = md) -> pb.FragmentsResponse:
                return await stub.ListFragments(pb.FragmentsRequest(journal=journal), metadata=md)

            for call in (append, read, fragments):
                hidden, missing = await call(B), await call("auth/missing")
                assert hidden.status == pb.JOURNAL_NOT_FOUND, (broker.who, call.__name__)
                assert unrevisioned(hidden) == unrevisioned(missing), (broker.who, call.__name__)
            assert (await append(A)).status == pb.OK  # (its own journal, on the same broker)
    assert await _head(tc, B) == before
    async with _client(tc, BearerAuthorizer(token)) as c:
        assert [j.spec.name for j in (await c.list()).journals] == [A]
        assert list((await c.list(labels.parse_selector(f"name={B}"))).journals) == []
        assert list((await c.list(labels.parse_selector("app=b"))).journals) == []
        with pytest.raises(JournalNotFoundError):
            await c.append(B, b"x")
        members = (await c.members()).members  # (the brokers, and a count of only the journals it may see)
        assert len(members) == 2 and sum(m.journals for m in members) == sum(m.primaries for m in members) == 1


async def test_a_watched_list_answers_only_changes_it_may_see(tc: TestCluster) -> None:
    """A change of `auth/b` sends nothing to a watch for app=a (the next answer is the change of `auth/a`
    made after it); the list it shows never holds `auth/b`."""
    async with _client(tc, BearerAuthorizer(_token(Capability.LIST, "app=a"))) as c, tc.client() as admin:
        watch = c.watch()
        first = await anext(watch)
        assert [j.spec.name for j in first.journals] == [A]
        revisions = await _specs(tc)
        for journal, app in ((B, "b"), (A, "a")):
            spec = _spec(journal, app, tc)
            spec.labels.labels.append(pb.Label(name="tier", value="changed"))
            await admin.apply([pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=revisions[journal][1])])
        nxt = await anext(watch)
        assert [j.spec.name for j in nxt.journals] == [A]
        assert labels.pairs(nxt.journals[0].spec.labels) == [("app", "a"), ("tier", "changed")]
        await watch.aclose()


# -- Apply ---------------------------------------------------------------------------------------------


def _spec(name: str, app: str, tc: TestCluster) -> pb.JournalSpec:
    return spec_from_dict(
        {"name": name, "replication": 1, "labels": {"app": app}, "fragment": {"stores": [tc.store_url]}}
    )


async def _specs(tc: TestCluster) -> dict[str, tuple[list[tuple[str, str]], int]]:
    async with tc.client() as c:
        return {j.spec.name: (labels.pairs(j.spec.labels), j.mod_revision) for j in (await c.list()).journals}


async def test_apply_cannot_reach_outside_the_selector(tc: TestCluster) -> None:
    """An APPLY token for app=a creates no app=b journal, relabels no journal into or out of app=a, and
    deletes no app=b journal (that delete answers as one of a missing journal); its own journals it may
    change."""
    token = _token(Capability.APPLY | Capability.LIST, "app=a")
    before = await _specs(tc)
    async with grpc.aio.insecure_channel(tc.brokers[0].endpoint) as ch:
        stub, md = JournalStub(ch), _bearer(token)
        for name, app in (("auth/new-b", "b"), (B, "a"), (A, "b")):
            revision = before[name][1] if name in before else 0
            change = pb.ApplyRequest.Change(upsert=_spec(name, app, tc), expect_mod_revision=revision)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=md)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert exc.value.details() == f"not allowed to apply journal {name} (outside your token's selector)"
        for expect in (before[B][1], 0):  # (a delete expecting its revision fails as for a missing journal; 0 passes)
            hidden = await stub.Apply(
                pb.ApplyRequest(changes=[pb.ApplyRequest.Change(delete=B, expect_mod_revision=expect)]), metadata=md
            )
            missing = await stub.Apply(
                pb.ApplyRequest(changes=[pb.ApplyRequest.Change(delete="auth/missing", expect_mod_revision=expect)]),
                metadata=md,
            )
            assert unrevisioned(hidden) == unrevisioned(missing)
            assert hidden.status == (pb.ETCD_TRANSACTION_FAILED if expect else pb.OK)
        assert await _specs(tc) == before  # (nothing written)
        mine = _spec(A, "a", tc)
        mine.labels.labels.append(pb.Label(name="tier", value="gold"))
        change = pb.ApplyRequest.Change(upsert=mine, expect_mod_revision=before[A][1])
        assert (await stub.Apply(pb.ApplyRequest(changes=[change]), metadata=md)).status == pb.OK
    assert (await _specs(tc))[A][0] == [("app", "a"), ("tier", "gold")]


# -- proxies sign their own tokens ---------------------------------------------------------------------------


def _verified(broker: Broker) -> dict[str, Claims]:
    """The tokens `broker` verified, with their claims (its verified-token cache: every one, in a test)."""
    return dict(broker.verifier._cache)  # type: ignore[union-attr]


async def test_a_token_for_one_journal_works_through_a_broker_that_is_not_its_primary(tc: TestCluster) -> None:
    """The broker in the middle verifies the client's token, then calls the primary with a token of its own
    for that journal and capability alone, expiring no later than the client's: never the client's."""
    primary, via = _primary(tc, A)
    mine = _token(Capability.APPEND | Capability.READ, f"name={A}", ttl=600)
    until = int(time.time()) + 600
    before = _verified(primary)
    async with AsyncClient(via.endpoint, retries=0, auth=BearerAuthorizer(mine)) as c:
        span = await c.append(A, b"through the middle\n")  # (no route known yet: `via` proxies)
    async with AsyncClient(via.endpoint, retries=0, auth=BearerAuthorizer(mine)) as c:
        assert await c.read_all(A, span.begin) == b"through the middle\n"
    async with AsyncClient(via.endpoint, retries=0, auth=BearerAuthorizer(mine)) as c:
        assert [f.spec.end for f in (await c.fragments(A)).fragments][-1] == span.end
    seen = [(token, claims) for token, claims in _verified(primary).items() if token not in before]
    assert seen and all(token != mine for token, _ in seen)
    caps = {claims.cap for _, claims in seen}
    assert caps == {Capability.APPEND, Capability.READ}
    for _, claims in seen:
        assert claims.sub == via.who and labels.format_selector(claims.sel) == f"name={A}"
        assert claims.exp <= until


# -- rollout and rotation ------------------------------------------------------------------------------------


async def test_aa_admits_calls_without_a_token_but_verifies_a_token_that_is_there(brokers: Any) -> None:
    tc = await _cluster(brokers, KeySet((KEY,), allow_missing=True))
    _primary_broker, via = _primary(tc, A)
    async with AsyncClient(via.endpoint, retries=0) as c:  # (no token; `via` proxies with one of its own)
        span = await c.append(A, b"no token\n")
        assert await c.read_all(A, span.begin) == b"no token\n"
    before = await _head(tc, A)
    async with _client(tc, BearerAuthorizer(_token(Capability.ALL, key=OTHER))) as c:
        with pytest.raises(UnauthenticatedError, match="token signature does not verify"):
            await c.append(A, b"refused\n")
    async with _client(tc, BearerAuthorizer(_token(Capability.READ))) as c:
        with pytest.raises(NotAllowedError, match="token lacks the APPEND capability"):
            await c.append(A, b"refused\n")
    assert await _head(tc, A) == before


async def test_brokers_holding_two_keys_take_tokens_of_either(brokers: Any) -> None:
    """Rotation's middle step: brokers with `K2,K1` (K2 signs) accept what K1 signed and what K2 signed."""
    tc = await _cluster(brokers, KeySet((OTHER, KEY)))
    for key in (KEY, OTHER):
        async with _client(tc, BearerAuthorizer(_token(Capability.APPEND, key=key)), 1) as c:
            await c.append(A, b"either key\n")
    async with _client(tc, BearerAuthorizer(_token(Capability.APPEND, key=THIRD))) as c:
        with pytest.raises(UnauthenticatedError):
            await c.append(A, b"refused\n")
    async with _client(tc, KeyedAuthorizer(KeySet((KEY,)))) as c:  # (a process still signing with the old key)
        await c.append(A, b"old key\n")


# -- expiry ---------------------------------------------------------------------------------------------------


@pytest.fixture
def no_leeway(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens expire at their `exp` to the second (not 5 s later): the tests wait for it."""
    monkeypatch.setattr(jwt_module, "LEEWAY", 0)
    monkeypatch.setattr(verifier_module, "LEEWAY", 0)


async def test_a_blocking_read_ends_when_its_token_expires(tc: TestCluster, no_leeway: None) -> None:
    """The broker ends the read at the token's expiry; the client opens it again with its token, which is
    refused now (a keyed client would have signed a fresh one)."""
    token, exp = _token(Capability.READ | Capability.APPEND, ttl=2), int(time.time()) + 2
    async with _client(tc, BearerAuthorizer(token)) as c:
        await c.append(A, b"before\n")
        got: list[bytes] = []
        with pytest.raises(UnauthenticatedError, match="token expired"):
            async for chunk in c.read(A, block=True):  # (it waits at the head until the token expires)
                got.append(chunk.content)
    assert got == [b"before\n"] and time.time() >= exp


async def test_a_backlog_read_cut_by_its_tokens_expiry_is_never_taken_for_the_whole(
    tc: TestCluster, no_leeway: None
) -> None:
    """A non-blocking read of a backlog whose token expires midway: the broker ends it early, and the client
    opens it again (refused now: a keyed client would have signed a fresh token) instead of returning a
    part of the journal as if it were all of it."""
    async with _client(tc, KeyedAuthorizer(KeySet((KEY,)))) as w:
        for _ in range(24):
            await w.append(A, os.urandom(1 << 20))
        head = await w.write_head(A)
    token, exp = _token(Capability.READ, ttl=2), int(time.time()) + 2
    got = 0
    async with _client(tc, BearerAuthorizer(token)) as c:
        with pytest.raises(UnauthenticatedError, match="token expired"):
            async for chunk in c.read(A, 0):
                if not got:  # (a slow reader: the token expires while most of the backlog is unread)
                    await wait_until(lambda: time.time() > exp + 0.5, timeout=10)
                got += len(chunk.content)
    assert got < head


async def test_an_append_streaming_past_its_token_expiry_is_rolled_back(tc: TestCluster, no_leeway: None) -> None:
    token, exp = _token(Capability.APPEND, ttl=2), int(time.time()) + 2
    before = await _head(tc, A)
    async with _client(tc, BearerAuthorizer(token)) as c:
        appender = c.appender(A)
        await appender.write(b"first half, ")
        await wait_until(lambda: time.time() > exp + 0.5, timeout=10)
        with pytest.raises(TransportError, match="token expired during the append"):
            await appender.write(b"second half\n")
            await appender.commit()
    assert await _head(tc, A) == before


# -- the operator's view -------------------------------------------------------------------------------------


async def test_refusals_are_logged_once_per_peer_and_reason_and_all_counted(
    tc: TestCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tidings.auth.verifier")
    unauthenticated, hidden = refusals("journal", "UNAUTHENTICATED"), refusals("journal", "JOURNAL_NOT_FOUND")
    bad = _token(Capability.ALL, key=OTHER, sub="mallory")
    for _ in range(3):
        async with _client(tc, BearerAuthorizer(bad)) as c:
            with pytest.raises(UnauthenticatedError):
                await c.append(A, b"refused\n")
    lines = [r.getMessage() for r in caplog.records if r.name == "tidings.auth.verifier"]
    assert len(lines) == 1 and lines[0].startswith("refused Append from 127.0.0.1:"), lines
    assert "token signature does not verify" in lines[0] and bad not in lines[0] and bad not in caplog.text
    assert refusals("journal", "UNAUTHENTICATED") == unauthenticated + 3
    caplog.clear()
    token = _token(Capability.APPEND, "app=a", sub="alice@ops")
    async with _client(tc, BearerAuthorizer(token)) as c:
        with pytest.raises(JournalNotFoundError):
            await c.append(B, b"hidden\n")
    lines = [r.getMessage() for r in caplog.records if r.name == "tidings.auth.verifier"]
    assert len(lines) == 1 and "refused Append from 127.0.0.1:" in lines[0], lines
    assert f"(sub alice@ops): journal {B} outside the token's selector" in lines[0] and token not in caplog.text
    assert refusals("journal", "JOURNAL_NOT_FOUND") == hidden + 1
