"""Typed decoding of the tidings etcd layout, for ``KeySpace(root, decoder(root))``.

Layout under ``{root}/`` (DESIGN.md, *etcd layout*)::

    members/{zone}#{suffix}                  pb.BrokerSpec (leased); its id must match the key
    items/{journal}                          pb.JournalSpec; its name must match the key
    assign/{journal}#{zone}#{suffix}#{slot}  pb.Route the primary last synchronized (empty: new)

Every rejection is a ValueError (usually a ValidationError naming the field), which the KeySpace
logs and skips, so one bad value written by hand never stops a broker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, overload

from google.protobuf.message import DecodeError, Message

from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate

__all__ = ["Decoders", "decode_assignment", "decode_item", "decode_member", "decoder"]

_M = TypeVar("_M", bound=Message)


def _parse(msg: Message, raw: bytes, what: str) -> None:
    try:
        msg.ParseFromString(raw)
    except DecodeError as err:
        raise ValueError(f"value is not a valid {what}: {err}") from err


@overload
def decode_member(rest: str, raw: bytes) -> pb.BrokerSpec: ...
@overload
def decode_member(rest: str, raw: bytes, spec_type: type[_M]) -> _M: ...
def decode_member(rest: str, raw: bytes, spec_type: type[Message] = pb.BrokerSpec) -> Any:
    """A member's spec (a BrokerSpec, or `spec_type`: any spec with a ProcessId `id`)."""
    parts = rest.split("#")
    if len(parts) != 2:
        raise ValueError(f"member key must end in {{zone}}#{{suffix}}, not {rest!r}")
    spec: Any = spec_type()
    _parse(spec, raw, spec_type.__name__)
    validate.process_id(spec.id, "member.id")
    if (spec.id.zone, spec.id.suffix) != (parts[0], parts[1]):
        raise ValueError(f"member spec id {spec.id.zone}#{spec.id.suffix} does not match its key {rest!r}")
    return spec


def decode_item(rest: str, raw: bytes) -> pb.JournalSpec:
    spec = pb.JournalSpec()
    _parse(spec, raw, "JournalSpec")
    validate.journal_spec(spec, "item")
    if spec.name != rest:
        raise ValueError(f"journal spec name {spec.name!r} does not match its key {rest!r}")
    return spec


@overload
def decode_assignment(rest: str, raw: bytes) -> pb.Route: ...
@overload
def decode_assignment(
    rest: str,
    raw: bytes,
    value_type: type[_M],
    check_item: Callable[[str, str], None] = ...,
    check_value: Callable[[Any, str], None] = ...,
) -> _M: ...
def decode_assignment(
    rest: str,
    raw: bytes,
    value_type: type[Message] = pb.Route,
    check_item: Callable[[str, str], None] = validate.journal_name,
    check_value: Callable[[Any, str], None] = validate.route,
) -> Any:
    """An assignment's value (the Route its primary last synchronized, or `value_type`), its key checked."""
    parts = rest.split("#")
    if len(parts) != 4:
        raise ValueError(f"assignment key must end in {{item}}#{{zone}}#{{suffix}}#{{slot}}, not {rest!r}")
    item, zone, suffix, slot = parts
    check_item(item, "assignment.item")
    validate.token(zone, "assignment.zone")
    validate.token(suffix, "assignment.suffix")
    if not slot.isdigit() or str(int(slot)) != slot:
        raise ValueError(f"assignment slot {slot!r} must be a non-negative integer without leading zeros")
    value: Any = value_type()
    if raw:
        _parse(value, raw, value_type.__name__)
        check_value(value, "assignment.value")
    return value


class Decoders(Protocol):
    """How one use of the layout decodes its values (`tidings.allocator.kind`: journals, shards)."""

    def decode_member(self, rest: str, raw: bytes) -> object: ...
    def decode_item(self, rest: str, raw: bytes) -> object: ...
    def decode_assignment(self, rest: str, raw: bytes) -> object: ...


def decoder(root: str, kind: Decoders | None = None) -> Callable[[str, bytes], object]:
    """A KeySpace decoder for the layout under ``root``: of journals on brokers, or of `kind`'s."""
    prefix = root.rstrip("/") + "/"
    by_kind: dict[str, Callable[[str, bytes], object]] = {
        "members": kind.decode_member if kind else decode_member,
        "items": kind.decode_item if kind else decode_item,
        "assign": kind.decode_assignment if kind else decode_assignment,
    }

    def decode(key: str, raw: bytes) -> object:
        if not key.startswith(prefix):
            raise ValueError(f"key is outside {prefix!r}")
        kind, sep, rest = key[len(prefix) :].partition("/")
        fn = by_kind.get(kind)
        if fn is None or not sep or not rest:
            raise ValueError(f"unknown key {key!r}: expected {prefix}members/, items/ or assign/ keys")
        return fn(rest, raw)

    return decode
