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

from google.protobuf.message import DecodeError, Message

from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import validate

__all__ = ["decoder"]


def _parse(msg: Message, raw: bytes, what: str) -> None:
    try:
        msg.ParseFromString(raw)
    except DecodeError as err:
        raise ValueError(f"value is not a valid {what}: {err}") from err


def decode_member(rest: str, raw: bytes) -> pb.BrokerSpec:
    parts = rest.split("#")
    if len(parts) != 2:
        raise ValueError(f"member key must end in {{zone}}#{{suffix}}, not {rest!r}")
    spec = pb.BrokerSpec()
    _parse(spec, raw, "BrokerSpec")
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


def decode_assignment(rest: str, raw: bytes) -> pb.Route:
    parts = rest.split("#")
    if len(parts) != 4:
        raise ValueError(f"assignment key must end in {{journal}}#{{zone}}#{{suffix}}#{{slot}}, not {rest!r}")
    journal, zone, suffix, slot = parts
    validate.journal_name(journal, "assignment.journal")
    validate.token(zone, "assignment.zone")
    validate.token(suffix, "assignment.suffix")
    if not slot.isdigit() or str(int(slot)) != slot:
        raise ValueError(f"assignment slot {slot!r} must be a non-negative integer without leading zeros")
    route = pb.Route()
    if raw:
        _parse(route, raw, "Route")
        validate.route(route, "assignment.value")
    return route


_BY_KIND: dict[str, Callable[[str, bytes], object]] = {
    "members": decode_member,
    "items": decode_item,
    "assign": decode_assignment,
}


def decoder(root: str) -> Callable[[str, bytes], object]:
    """A KeySpace decoder for the tidings layout under ``root``."""
    prefix = root.rstrip("/") + "/"

    def decode(key: str, raw: bytes) -> object:
        if not key.startswith(prefix):
            raise ValueError(f"key is outside {prefix!r}")
        kind, sep, rest = key[len(prefix) :].partition("/")
        fn = _BY_KIND.get(kind)
        if fn is None or not sep or not rest:
            raise ValueError(f"unknown key {key!r}: expected {prefix}members/, items/ or assign/ keys")
        return fn(rest, raw)

    return decode
