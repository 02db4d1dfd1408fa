"""Claims and capabilities mean what they mean in Gazette: the same bits, the same JSON (so tokens pass
between the two systems), selectors with meta-labels (`name`, `name:prefix`) that hide what they do
not cover, and refusals that name the missing capability (DESIGN.md invariant 11)."""

from __future__ import annotations

import json

import pytest

from tidings.protocol import labels, validate
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import (
    NEVER,
    Capability,
    Claims,
    claims_from_json,
    claims_json,
    covers,
    format_capabilities,
    missing_capability,
    parse_capabilities,
)
from tidings.protocol.status import ValidationError


def test_capability_bits_are_gazettes() -> None:
    assert [(c.name, int(c)) for c in Capability] == [
        ("LIST", 2),
        ("APPLY", 4),
        ("READ", 8),
        ("APPEND", 16),
        ("REPLICATE", 32),
    ]
    assert Capability.ALL == 0xFFFFFFFF and Capability(1 << 16) == 65536  # (an application's bit)


@pytest.mark.parametrize(
    "text,cap,formatted",
    [
        pytest.param("READ,APPEND", 24, "READ,APPEND", id="names"),
        pytest.param(" read , Append ", 24, "READ,APPEND", id="any-case-and-spaces"),
        pytest.param("READ|APPEND", 24, "READ,APPEND", id="bar"),
        pytest.param("ALL", 0xFFFFFFFF, "ALL", id="all"),
        pytest.param("READ,65536", 8 | 65536, "READ,65536", id="application-bit"),
        pytest.param("0x10000", 65536, "65536", id="hex"),
        pytest.param("24", 24, "READ,APPEND", id="number"),
        pytest.param("0", 0, "0", id="none"),
        pytest.param("LIST,APPLY,READ,APPEND,REPLICATE", 62, "LIST,APPLY,READ,APPEND,REPLICATE", id="every-name"),
    ],
)
def test_capabilities_parse_and_format_round_trip(text: str, cap: int, formatted: str) -> None:
    assert parse_capabilities(text) == cap
    assert format_capabilities(cap) == formatted
    assert parse_capabilities(formatted) == cap


@pytest.mark.parametrize(
    "text,said",
    [
        pytest.param("", "no capability given", id="empty"),
        pytest.param("READ,WRITE", "'WRITE' is not a capability: give LIST, APPLY, READ", id="unknown-name"),
        pytest.param("4294967296", "give a number from 0 to 4294967295", id="too-big"),
        pytest.param("-1", "give a number from 0 to 4294967295", id="negative"),
    ],
)
def test_a_bad_capability_is_refused_naming_the_flag(text: str, said: str) -> None:
    with pytest.raises(ValidationError, match=r"^--capability: ") as exc:
        parse_capabilities(text, "--capability")
    assert said in str(exc.value)


@pytest.mark.parametrize(
    "have,need,reason",
    [
        pytest.param(Capability.READ, Capability.APPEND, "token lacks the APPEND capability (it has READ)", id="one"),
        pytest.param(0, Capability.READ, "token lacks the READ capability (it has none)", id="has-none"),
        pytest.param(
            Capability.LIST,
            Capability.READ | Capability.APPEND,
            "token lacks the READ,APPEND capabilities (it has LIST)",
            id="two",
        ),
        pytest.param(Capability.READ, 1 << 16, "token lacks the 65536 capability (it has READ)", id="application-bit"),
    ],
)
def test_a_missing_capability_is_named(have: int, need: int, reason: str) -> None:
    assert missing_capability(have, need) == reason
    assert not Claims(cap=have).allows(need)


def test_a_token_holding_more_than_needed_lacks_nothing() -> None:
    assert missing_capability(Capability.ALL, Capability.REPLICATE) is None
    assert missing_capability(Capability.READ | Capability.APPEND, Capability.APPEND) is None
    assert Claims(cap=Capability.ALL).allows(1 << 20)


# Go's encoding of Gazette's pb.Claims (cap, sel, then jwt.RegisteredClaims: sub, exp, iat).
GAZETTE_JSON = (
    '{"cap":24,"sel":{"include":{"labels":[{"name":"app","value":"orders"}]},"exclude":{"labels":null}},'
    '"sub":"alice@ops","exp":1764303600,"iat":1764300000}'
)


def test_claims_encode_as_gazette_does_byte_for_byte() -> None:
    claims = Claims(cap=24, sel=labels.parse_selector("app=orders"), iat=1764300000, exp=1764303600, sub="alice@ops")
    assert json.dumps(claims_json(claims), separators=(",", ":")) == GAZETTE_JSON
    assert claims_from_json(json.loads(GAZETTE_JSON)) == claims


def test_every_selector_shape_round_trips_through_gazettes_json() -> None:
    sel = labels.parse_selector("app=orders,tier,name:prefix=shop/,!legacy,region!=eu")
    claims = Claims(cap=8, sel=sel, iat=1, exp=2)
    obj = claims_json(claims)
    assert obj["sel"] == {
        "include": {
            "labels": [
                {"name": "app", "value": "orders"},
                {"name": "name", "value": "shop/", "prefix": True},  # (Gazette's Label.Prefix)
                {"name": "tier"},  # (an empty value omitted, as Go's omitempty)
            ]
        },
        "exclude": {"labels": [{"name": "legacy"}, {"name": "region", "value": "eu"}]},
    }
    assert claims_from_json(json.loads(json.dumps(obj))) == claims


@pytest.mark.parametrize(
    "sel",
    [
        pytest.param(None, id="absent"),
        pytest.param({}, id="empty-object"),
        pytest.param({"include": {"labels": None}, "exclude": {"labels": None}}, id="go-nulls"),
        pytest.param({"include": {"labels": []}, "exclude": {}}, id="empty-lists"),
    ],
)
def test_an_empty_selector_covers_everything(sel: object) -> None:
    obj: dict[str, object] = {"cap": 8, "exp": 2}
    if sel is not None:
        obj["sel"] = sel
    claims = claims_from_json(obj)
    assert claims.sel == pb.LabelSelector() and claims == Claims(cap=8, exp=2)
    assert covers(claims, labels.journal_labels("any/journal", labels.label_set({"app": "x"})))


@pytest.mark.parametrize(
    "obj,said",
    [
        pytest.param({"cap": 8, "sel": {"incl": {}}}, "sel: unknown field 'incl'", id="unknown-selector-field"),
        pytest.param({"cap": 8, "sel": {"include": {"label": []}}}, "sel.include: unknown field 'label'", id="set"),
        pytest.param(
            {"cap": 8, "sel": {"include": {"labels": [{"name": "a", "valeu": "b"}]}}},
            "sel.include.labels[0]: unknown field 'valeu'",
            id="unknown-label-field",
        ),
        pytest.param({"cap": 8, "sel": {"include": {"labels": {}}}}, "sel.include.labels: is not a list", id="list"),
        pytest.param({"cap": 8, "sel": []}, "sel: is list, not an object", id="selector-type"),
        pytest.param(
            {"cap": 8, "sel": {"include": {"labels": [{"name": 1}]}}}, "name and value must be strings", id="name"
        ),
        pytest.param({"cap": 2**32}, "cap: 4294967296 is not a whole number from 0 to 4294967295", id="cap-too-big"),
        pytest.param({"cap": -1}, "cap: -1 is not a whole number", id="cap-negative"),
        pytest.param({"cap": "24"}, "cap: '24' is not a whole number", id="cap-text"),
        pytest.param({"cap": True}, "cap: True is not a whole number", id="cap-bool"),
        pytest.param({"cap": 8.0}, "cap: 8.0 is not a whole number", id="cap-float"),
        pytest.param({"cap": 8, "sub": 7}, "sub: is not a string", id="sub"),
        pytest.param({"cap": 8, "exp": -5}, "exp: -5 is not a whole number", id="exp-negative"),
        pytest.param([], "claims: is list, not an object", id="not-an-object"),
    ],
)
def test_malformed_claims_are_refused_naming_the_field(obj: object, said: str) -> None:
    """A typo in a selector must not widen a token: unknown fields are refused, not ignored."""
    with pytest.raises(ValidationError) as exc:
        claims_from_json(obj)
    assert said in str(exc.value)


def test_claims_keep_whole_seconds_of_fractional_times_and_ignore_other_registered_claims() -> None:
    claims = claims_from_json({"cap": 8, "iat": 100.7, "exp": 200.2, "iss": "x", "aud": ["y"], "jti": "z", "nbf": 1})
    assert (claims.iat, claims.exp) == (100, 200)


def test_name_prefix_selects_journals_under_a_prefix() -> None:
    """Gazette's meta-label: `name:prefix=shop/` covers shop/a and shop/b/c, not shopping/x nor ashop/."""
    claims = Claims(cap=8, sel=labels.parse_selector("name:prefix=shop/"), exp=NEVER)
    for name, covered in [("shop/a", True), ("shop/b/c", True), ("shopping/x", False), ("a/shop/x", False)]:
        assert covers(claims, labels.journal_labels(name, pb.LabelSet())) is covered, name
    excluded = Claims(cap=8, sel=labels.parse_selector("app=x,!name:prefix=shop/private/"), exp=NEVER)
    app_x = labels.label_set({"app": "x"})
    assert covers(excluded, labels.journal_labels("shop/public/a", app_x))
    assert not covers(excluded, labels.journal_labels("shop/private/a", app_x))
    assert not covers(excluded, labels.journal_labels("shop/public/a", labels.label_set({"app": "y"})))


def test_name_selects_one_journal_and_a_spec_label_cannot_claim_another_name() -> None:
    """`journal_labels` sets the meta-label `name` over a label of that name, so a journal cannot pose as another."""
    one = Claims(cap=8, sel=labels.parse_selector("name=shop/a"), exp=NEVER)
    assert covers(one, labels.journal_labels("shop/a", pb.LabelSet()))
    assert not covers(one, labels.journal_labels("shop/b", labels.label_set({"name": "shop/a"})))


def test_selectors_without_meta_labels_match_as_before() -> None:
    ls = labels.label_set({"app": "orders", "tier": "gold"})
    for text, matched in [("app=orders", True), ("app", True), ("app=shop", False), ("!tier", False), ("", True)]:
        assert labels.matches(labels.parse_selector(text), ls) is matched, text
    assert labels.matches(None, ls)


def test_a_prefix_is_valid_in_a_selector_and_nowhere_else() -> None:
    validate.selector(labels.parse_selector("name:prefix=shop/,!app:prefix=test"))
    with pytest.raises(ValidationError, match="label name 'name:prefix'"):
        validate.label_set(labels.label_set({"name:prefix": "shop/"}))


def test_several_values_of_a_selector_label_are_alternatives_as_in_gazette() -> None:
    """Gazette's matchSelector: an item is selected when, for each name the includes give, it holds one of
    the values given for it (so a token for `id=a,id=b`, what a client unassigning two shards claims,
    covers either shard), and `name` and `name:prefix` are alternatives of one name; excludes still
    exclude on any match."""
    for text, shard, matched in [
        ("id=a,id=b", "a", True),
        ("id=a,id=b", "b", True),
        ("id=a,id=b", "c", False),
        ("id=a,id=b,app=x", "a", True),
        ("id=a,id=b,app=y", "a", False),
        ("id=a,id=b,!app=x", "b", False),
    ]:
        assert labels.matches(
            labels.parse_selector(text), labels.shard_labels(shard, labels.label_set({"app": "x"}))
        ) is (matched), (text, shard)
    either = labels.parse_selector("name=shop/a,name:prefix=billing/")
    for name, matched in [("shop/a", True), ("billing/x", True), ("shop/b", False)]:
        assert labels.matches(either, labels.journal_labels(name, pb.LabelSet())) is matched, name
    tag = labels.label_set([("tag", "blue"), ("tag", "red")])  # (an item with several values of a name)
    assert labels.matches(labels.parse_selector("tag=red,tag=green"), tag)
    assert not labels.matches(labels.parse_selector("tag=green,tag=white"), tag)
    assert labels.matches(labels.parse_selector("tag=blue"), tag) and labels.matches(labels.parse_selector("tag"), tag)


def test_a_token_label_name_with_a_colon_is_refused() -> None:
    """A prefix match is `prefix: true` (Gazette's): a name `app:prefix` would be one here and not there."""
    obj = {"cap": 8, "iat": 1, "exp": 2, "sel": {"include": {"labels": [{"name": "app:prefix", "value": "a"}]}}}
    with pytest.raises(ValidationError, match="has a ':'"):
        claims_from_json(obj)
