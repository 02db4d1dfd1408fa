"""Capabilities and the claims a token grants (Gazette's `broker/protocol/auth.go`).

A token grants `cap`, a bit set of capabilities, over the journals (or shards, targets) its
selector `sel` matches; an empty selector matches everything. Capabilities are JWT claims, not
proto fields, so they live here in Python; the claims' JSON is Go's encoding of Gazette's (its key
order, empty values omitted, `null` for an empty label set: the same bytes for ASCII labels without
`<>&`, which Go escapes), so a token Gazette signs verifies here and one we sign verifies in Gazette:

    {"cap":24,"sel":{"include":{"labels":[{"name":"app","value":"orders"}]},"exclude":{"labels":null}},
     "sub":"alice@ops","exp":1764303600,"iat":1764300000}

A selector label named `NAME:prefix` (Gazette's `prefix: true` in JSON) matches a label NAME whose
value starts with the selector's value: `name:prefix=shop/` covers every journal under shop/.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Final

from tidings.protocol import labels as lbl
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError

MAX_CAPABILITY: Final = 0xFFFFFFFF  # (Gazette's Capability is a uint32)
NEVER: Final = 2**63 - 1  # the `exp` of claims that do not expire: NoVerifier's, when auth is off


class Capability(enum.IntFlag):
    """What a token allows: Gazette's bits, so tokens mean the same in both systems.

    Applications may use bits from 1 << 16 (they have no name here: give them as numbers).
    """

    LIST = 1 << 1
    APPLY = 1 << 2
    READ = 1 << 3
    APPEND = 1 << 4
    REPLICATE = 1 << 5
    ALL = MAX_CAPABILITY


_NAMED = (Capability.LIST, Capability.APPLY, Capability.READ, Capability.APPEND, Capability.REPLICATE)


@dataclass(frozen=True, repr=False, eq=False)
class Claims:
    """The verified scope of a request: capabilities `cap` over what `sel` matches (all when empty),
    issued at `iat` and expiring at `exp` (Unix seconds); `sub` names the holder, for logs only.

    `sel` is a protobuf message, so it cannot be frozen: treat it as read-only. Claims compare and hash
    by the selector's labels (a message's `==` would see whether an empty set was assigned).
    """

    cap: int
    sel: pb.LabelSelector = field(default_factory=pb.LabelSelector)
    iat: int = 0
    exp: int = 0
    sub: str = ""

    def _key(self) -> tuple[object, ...]:
        return (
            self.cap,
            *(tuple(lbl.pairs(ls)) for ls in (self.sel.include, self.sel.exclude)),
            self.iat,
            self.exp,
            self.sub,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Claims) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:  # (the selector on one line, as `--selector` takes it)
        cap, sel = format_capabilities(self.cap), lbl.format_selector(self.sel)
        return f"Claims(cap={cap}, sel={sel!r}, iat={self.iat}, exp={self.exp}, sub={self.sub!r})"

    def allows(self, cap: int) -> bool:
        """Whether every bit of `cap` is granted (Gazette's `actual & require == require`)."""
        return self.cap & cap == cap


def covers(claims: Claims, labels: pb.LabelSet) -> bool:
    """Whether `claims` reach an item with `labels`, meta-labels included (`journal_labels`): an item
    they do not cover is to be treated as absent."""
    return lbl.matches(claims.sel, labels)


def missing_capability(have: int, need: int) -> str | None:
    """None when `have` holds every bit of `need`; else the refusal's reason, naming what lacks and what
    the token has: "token lacks the APPEND capability (it has READ)"."""
    lacking = need & ~have
    if not lacking:
        return None
    what = format_capabilities(lacking)
    noun = "capability" if lacking.bit_count() == 1 or lacking == MAX_CAPABILITY else "capabilities"
    return f"token lacks the {what} {noun} (it has {format_capabilities(have) if have else 'none'})"


def parse_capabilities(text: str, ctx: str = "capability") -> int:
    """`READ,APPEND` (names, any case, or numbers: `65536`, `0x10000`) as a bit set."""
    cap = 0
    items = [t.strip() for t in text.replace("|", ",").split(",") if t.strip()]
    if not items:
        raise ValidationError(ctx, "no capability given: name some, e.g. READ,APPEND")
    for item in items:
        if item.upper() in Capability.__members__:
            cap |= Capability[item.upper()]
            continue
        try:
            value = int(item, 0)
        except ValueError:
            names = ", ".join(Capability.__members__)
            raise ValidationError(ctx, f"{item!r} is not a capability: give {names} or a number") from None
        if not 0 <= value <= MAX_CAPABILITY:
            raise ValidationError(ctx, f"{item} is not a capability: give a number from 0 to {MAX_CAPABILITY}")
        cap |= value
    return cap


def format_capabilities(cap: int) -> str:
    """The names `parse_capabilities` reads back: `READ,APPEND`, `ALL`, `0` for none; bits without a
    name (an application's) as one number: `READ,65536`."""
    if cap == MAX_CAPABILITY:
        return "ALL"
    names = [c.name or "" for c in _NAMED if cap & c]
    rest = cap & ~sum(_NAMED)
    return ",".join(names + ([str(rest)] if rest else [])) or "0"


# Gazette's JSON (Go's encoding of pb.Claims: `cap`, `sel`, then jwt.RegisteredClaims' `sub`, `exp`,
# `iat` in that order; a label's empty `value` and false `prefix` omitted, an empty label set `null`).

_PREFIX = ":prefix"


def _label_set_json(ls: pb.LabelSet) -> dict[str, Any]:
    if not ls.labels:
        return {"labels": None}
    out = []
    for label in ls.labels:
        name, prefix = (label.name[: -len(_PREFIX)], True) if label.name.endswith(_PREFIX) else (label.name, False)
        item: dict[str, Any] = {"name": name} if name else {}
        if label.value:
            item["value"] = label.value
        if prefix:
            item["prefix"] = True
        out.append(item)
    return {"labels": out}


def selector_json(sel: pb.LabelSelector) -> dict[str, Any]:
    """A selector as Gazette's LabelSelector JSON."""
    return {"include": _label_set_json(sel.include), "exclude": _label_set_json(sel.exclude)}


def claims_json(claims: Claims) -> dict[str, Any]:
    """The claims as Gazette encodes them (key order too: a token signs these bytes)."""
    out: dict[str, Any] = {"cap": claims.cap, "sel": selector_json(claims.sel)}
    if claims.sub:
        out["sub"] = claims.sub
    out["exp"] = claims.exp
    if claims.iat:
        out["iat"] = claims.iat
    return out


def _strict(obj: Any, keys: frozenset[str], ctx: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValidationError(ctx, f"is {type(obj).__name__}, not an object")
    if unknown := sorted(set(obj) - keys):
        raise ValidationError(ctx, f"unknown field {unknown[0]!r}")
    return obj


def _label_set_from_json(obj: Any, ctx: str) -> pb.LabelSet:
    if obj is None:
        return pb.LabelSet()
    items = _strict(obj, frozenset({"labels"}), ctx).get("labels")
    if items is None:
        return pb.LabelSet()
    if not isinstance(items, list):
        raise ValidationError(f"{ctx}.labels", "is not a list")
    pairs = []
    for i, item in enumerate(items):
        label = _strict(item, frozenset({"name", "value", "prefix"}), f"{ctx}.labels[{i}]")
        name, value, prefix = label.get("name", ""), label.get("value", ""), label.get("prefix", False)
        if not isinstance(name, str) or not isinstance(value, str) or not isinstance(prefix, bool):
            raise ValidationError(f"{ctx}.labels[{i}]", "name and value must be strings, prefix true or false")
        if ":" in name:  # (a prefix is `prefix: true`, as Gazette's: a name with ':' would be one here only)
            raise ValidationError(f"{ctx}.labels[{i}]", f"name {name!r} has a ':' (a prefix match is prefix: true)")
        pairs.append((name + _PREFIX if prefix else name, value))
    return lbl.label_set(pairs)


def selector_from_json(obj: Any, ctx: str = "sel") -> pb.LabelSelector:
    """Gazette's LabelSelector JSON, strictly: an unknown field is refused (a typo must not widen a token)."""
    if obj is None:
        return pb.LabelSelector()
    sel = _strict(obj, frozenset({"include", "exclude"}), ctx)
    include = _label_set_from_json(sel.get("include"), f"{ctx}.include")
    exclude = _label_set_from_json(sel.get("exclude"), f"{ctx}.exclude")
    return pb.LabelSelector(  # (an empty set left unset: `==` on messages sees presence)
        include=include if include.labels else None, exclude=exclude if exclude.labels else None
    )


def _int(obj: dict[str, Any], key: str, least: int, most: int, date: bool = False) -> int:
    value = obj.get(key, 0)
    if date and isinstance(value, float) and least <= value <= most:
        value = int(value)  # (a NumericDate may have a fraction of a second: Go's jwt reads one)
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ValidationError(key, f"{value!r} is not a whole number from {least} to {most}")
    return value


def claims_from_json(obj: Any) -> Claims:
    """Claims from Gazette's JSON: `cap` 0..2^32-1, `sel` strict (absent: all), whole-second `iat` and
    `exp` (0 when absent: the verifier decides what absence means), `sub` a string. Other registered
    JWT claims (`iss`, `aud`, `jti`, `nbf`) are accepted and not kept, as Gazette does."""
    if not isinstance(obj, dict):
        raise ValidationError("claims", f"is {type(obj).__name__}, not an object")
    sub = obj.get("sub", "")
    if not isinstance(sub, str):
        raise ValidationError("sub", "is not a string")
    return Claims(
        cap=_int(obj, "cap", 0, MAX_CAPABILITY),
        sel=selector_from_json(obj.get("sel")),
        iat=_int(obj, "iat", 0, NEVER, date=True),
        exp=_int(obj, "exp", 0, NEVER, date=True),
        sub=sub,
    )
