"""Clients authorize each call through one interface: keys sign tokens scoped to what the call touches
and renew them before they expire, a bearer token goes as given, no auth sends nothing; and keys rotate
without a refused call."""

from __future__ import annotations

import itertools

import pytest

from tidings.auth import BearerAuthorizer, KeyedAuthorizer, KeySet, NoAuthorizer, Verifier
from tidings.protocol import labels
from tidings.protocol.claims import Capability, Claims
from tidings.protocol.status import ValidationError

OLD, NEW = b"o" * 32, b"n" * 32
NOW = 1_800_000_000.25


class _Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def test_a_keyed_authorizer_signs_the_calls_claims_for_an_hour() -> None:
    clock = _Clock()
    a = KeyedAuthorizer(KeySet((NEW,)), sub="broker-1", clock=clock)
    sel = labels.parse_selector("name=shop/orders")
    md = a.metadata(Capability.APPEND, sel)
    claims = Verifier(KeySet((NEW,))).verify_metadata(md, Capability.APPEND, NOW)
    assert claims == Claims(cap=Capability.APPEND, sel=sel, iat=1_800_000_000, exp=1_800_003_600, sub="broker-1")


def test_a_token_is_reused_until_half_its_life_then_renewed() -> None:
    clock = _Clock()
    a = KeyedAuthorizer(KeySet((NEW,)), clock=clock)
    first = a.metadata(Capability.READ)
    clock.now += 1799
    assert a.metadata(Capability.READ, labels.parse_selector("")) == first  # (an empty selector is none)
    clock.now += 1
    renewed = a.metadata(Capability.READ)
    assert renewed != first
    assert Verifier(KeySet((NEW,))).verify_metadata(renewed, Capability.READ, clock.now).exp == int(clock.now) + 3600


def test_each_capability_and_selector_gets_its_own_token() -> None:
    a = KeyedAuthorizer(KeySet((NEW,)), clock=_Clock())
    tokens = {
        a.metadata(Capability.READ, labels.parse_selector("name=a")),
        a.metadata(Capability.READ, labels.parse_selector("name=b")),
        a.metadata(Capability.APPEND, labels.parse_selector("name=a")),
        a.metadata(Capability.READ),
    }
    assert len(tokens) == 4


def test_keys_rotate_without_a_refused_call() -> None:
    """OLD -> OLD,NEW -> NEW,OLD -> NEW: at each step every process's token verifies at every other
    process still running the step before or after (the rotation in tidings.auth's docstring)."""
    steps = [KeySet((OLD,)), KeySet((OLD, NEW)), KeySet((NEW, OLD)), KeySet((NEW,))]
    for before, after in itertools.pairwise(steps):
        for signer, checker in [(before, after), (after, before)]:
            md = KeyedAuthorizer(signer, clock=_Clock()).metadata(Capability.APPEND)
            Verifier(checker).verify_metadata(md, Capability.APPEND, NOW)


def test_a_bearer_authorizer_sends_its_token_whatever_the_call() -> None:
    a = BearerAuthorizer(" x.y.z\n")
    assert a.metadata(Capability.READ) == a.metadata(Capability.APPEND) == (("authorization", "Bearer x.y.z"),)
    assert "x.y.z" not in repr(a)
    for bad in ("", " \n", "x.y z"):
        with pytest.raises(ValidationError, match="--auth-token: is empty or has spaces"):
            BearerAuthorizer(bad)


def test_no_authorizer_sends_nothing() -> None:
    assert NoAuthorizer().metadata(Capability.ALL) == ()


def test_a_capped_expiry_never_outlives_the_caller() -> None:
    """A broker proxying a call signs a token expiring no later than its caller's (`exp`): it reuses a token
    expiring sooner still, and signs one of its own for a caller whose token ends first."""
    clock = _Clock()
    a = KeyedAuthorizer(KeySet((NEW,)), clock=clock)
    sel = labels.parse_selector("name=shop/orders")
    check = Verifier(KeySet((NEW,)))
    long = a.metadata(Capability.APPEND, sel, exp=NOW + 7200)  # (a caller's token for 2 h: the hour wins)
    assert check.verify_metadata(long, Capability.APPEND, NOW).exp == 1_800_003_600
    short = a.metadata(Capability.APPEND, sel, exp=NOW + 60)
    assert short != long and check.verify_metadata(short, Capability.APPEND, NOW).exp == int(NOW + 60)
    assert a.metadata(Capability.APPEND, sel, exp=NOW + 120) == short  # (it expires sooner: reused)
    clock.now += 31  # (half its life spent: renewed, still within its caller's)
    renewed = a.metadata(Capability.APPEND, sel, exp=NOW + 120)
    assert renewed != short and check.verify_metadata(renewed, Capability.APPEND, clock.now).exp == int(NOW + 120)


def test_a_caller_with_a_long_token_never_gets_the_short_one_another_caller_left() -> None:
    """Two callers of a proxying broker: one whose token ends in 20 s, then one whose token lasts a day.
    The second's proxied call gets an hour (it would be cut at 20 s with the first's)."""
    clock = _Clock()
    a = KeyedAuthorizer(KeySet((NEW,)), clock=clock)
    sel = labels.parse_selector("name=shop/orders")
    check = Verifier(KeySet((NEW,)))
    short = a.metadata(Capability.READ, sel, exp=NOW + 20)
    clock.now += 1
    day = a.metadata(Capability.READ, sel, exp=NOW + 86_400)
    assert day != short and check.verify_metadata(day, Capability.READ, clock.now).exp == int(clock.now) + 3600
    assert check.verify_metadata(a.metadata(Capability.READ, sel, exp=NOW + 20), Capability.READ, clock.now).exp <= (
        NOW + 20
    )


def test_a_caller_with_half_an_hour_left_never_gets_a_token_of_seconds() -> None:
    """The reuse bound is half of what this caller allows, not half the broker's TTL: a caller whose token
    has 30 min 10 s left, after one with 20 s left, gets a token of its own (with the 20 s one its
    streaming append would be rolled back at 25 s)."""
    clock = _Clock()
    a = KeyedAuthorizer(KeySet((NEW,)), clock=clock)
    sel = labels.parse_selector("name=shop/orders")
    check = Verifier(KeySet((NEW,)))
    short = a.metadata(Capability.APPEND, sel, exp=NOW + 20)
    clock.now += 1
    longer = a.metadata(Capability.APPEND, sel, exp=NOW + 1810)
    assert longer != short and check.verify_metadata(longer, Capability.APPEND, clock.now).exp == int(NOW + 1810)


def test_clients_claim_what_each_call_touches() -> None:
    """Gazette's per-call claims: an append, a read or a fragments listing `name=<journal>`, a List its
    selector, an Apply everything; a Shard call `id=<shard>` (each shard unassigned), a shard List its
    selector. Each call's token says exactly that."""
    from tidings.client import AsyncClient
    from tidings.consumer.client import ShardClient
    from tidings.protocol import protocol_pb2 as pb

    keys = KeySet((NEW,))
    check = Verifier(keys)
    client = AsyncClient("127.0.0.1:1", auth=KeyedAuthorizer(keys))

    def claimed(md: tuple[tuple[str, str], ...], cap: int) -> tuple[int, str]:
        claims = check.verify_metadata(md, cap)
        return claims.cap, labels.format_selector(claims.sel)

    assert claimed(client._metadata(Capability.APPEND, "shop/orders"), 0) == (Capability.APPEND, "name=shop/orders")
    assert client._metadata(Capability.APPEND, "shop/orders") is client._metadata(Capability.APPEND, "shop/orders")
    sel = labels.parse_selector("app=shop")
    assert claimed(client._metadata(Capability.LIST, selector=sel), 0) == (Capability.LIST, "app=shop")
    assert claimed(client._metadata(Capability.APPLY), 0) == (Capability.APPLY, "")
    shards = ShardClient("127.0.0.1:1", auth=KeyedAuthorizer(keys))
    assert claimed(shards._metadata("Stat", pb.StatRequest(shard="wc/0")), 0) == (Capability.READ, "id=wc/0")
    assert claimed(shards._metadata("GetHints", pb.GetHintsRequest(shard="wc/1")), 0) == (Capability.READ, "id=wc/1")
    assert claimed(shards._metadata("List", pb.ShardListRequest(selector=sel)), 0) == (Capability.LIST, "app=shop")
    unassign = shards._metadata("Unassign", pb.UnassignRequest(shards=["wc/0", "wc/1"]))
    assert claimed(unassign, 0) == (Capability.APPLY, "id=wc/0,id=wc/1")
    assert claimed(shards._metadata("Apply", pb.ShardApplyRequest()), 0) == (Capability.APPLY, "")
