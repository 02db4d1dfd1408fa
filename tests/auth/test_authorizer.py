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
