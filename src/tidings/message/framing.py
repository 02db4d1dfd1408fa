"""Framings: how messages are laid out in a journal's bytes, chosen by its ``content-type`` label.

Journals hold only raw bytes; a framing turns messages into bytes and back (gazette-exactly-once.txt, *Message
UUIDs*: "journals themselves hold only raw user data"). Two framings, with Gazette's content types:

* ``application/x-ndjson``: one JSON document per line, encoded and decoded with ``msgspec.json``.
* ``application/x-protobuf-fixed``: Gazette's fixed framing. Each frame is the magic word ``66 33 93 36``, a 4-byte
  little-endian length, then that many bytes of serialized protobuf message.

Decoding is incremental and never raises on bad data: a :class:`Decoder` is fed journal chunks with their offsets
and returns :class:`Frame` records (``begin``/``end`` journal offsets and the decoded value) and :class:`Garbage`
records for byte ranges that are not messages (a bad JSON line, a frame that does not parse, bytes between frames
after a de-synchronization, a frame or line over ``max_message_size``). A partial trailing frame stays buffered
until the next chunk; :meth:`Decoder.finish` reports what is left at the end of the data. After garbage, the fixed
framing resynchronizes at the next magic word; as in Gazette, a magic word inside the garbage with a plausible length
is taken as a frame (and, if its payload does not parse, reported as garbage in turn).

Messages carry their UUID themselves (:func:`get_uuid` / :func:`set_uuid`): a ``dict`` under key ``"uuid"`` (string
form), a msgspec Struct or other object in attribute ``uuid`` (a :class:`uuid.UUID`, or a string if it holds one), a
protobuf message in field ``uuid`` (``bytes``: the 16 raw bytes; ``string``: the canonical form). A type that cannot
carry a UUID opts out with the class attribute ``__tidings_no_uuid__ = True``: its messages are delivered
at-least-once.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from itertools import accumulate, repeat
from operator import add
from typing import Any, Final
from uuid import UUID

import msgspec
from google.protobuf.message import DecodeError as _ProtoDecodeError
from google.protobuf.message import Message as _ProtoMessage

from tidings.message.uuid import uuid_from_str, uuid_to_str
from tidings.protocol.status import ValidationError

__all__ = [
    "CONTENT_TYPE_LABEL",
    "Columns",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "Decoder",
    "FIXED_FRAME_HEADER_LENGTH",
    "FIXED_FRAME_WORD",
    "Frame",
    "Framing",
    "Garbage",
    "NDJSON",
    "PROTOBUF_FIXED",
    "columns_of",
    "framing_for",
    "get_uuid",
    "set_uuid",
    "supports_uuid",
    "uuid_getter",
    "uuid_setter",
]

CONTENT_TYPE_LABEL: Final = "content-type"
NDJSON: Final = "application/x-ndjson"
PROTOBUF_FIXED: Final = "application/x-protobuf-fixed"

FIXED_FRAME_WORD: Final = b"\x66\x33\x93\x36"
FIXED_FRAME_HEADER_LENGTH: Final = 8
DEFAULT_MAX_MESSAGE_SIZE: Final = 64 << 20
"""Largest message (payload or JSON line) a framing writes or accepts; a fixed frame's length field allows 4 GiB."""

_LENGTH = struct.Struct("<I")


class Frame(msgspec.Struct, frozen=True, gc=False):
    """A decoded message and the journal byte range [begin, end) that held it (including framing bytes)."""

    begin: int
    end: int
    value: Any


class Garbage(msgspec.Struct, frozen=True):
    """A journal byte range [begin, end) that held no decodable message, and why."""

    begin: int
    end: int
    error: str


class Columns(msgspec.Struct):
    """What `Decoder.feed_columns` found: the frames as three parallel lists, and the garbage.

    Lists instead of Frame objects let a reader build its own records in one C-level ``map``.
    """

    begins: list[int]
    ends: list[int]
    values: list[Any]
    garbage: list[Garbage]


Record = Frame | Garbage


def columns_of(records: list[Record]) -> Columns:
    """Records as Columns: the frames' fields as parallel lists, the garbage apart."""
    frames = [r for r in records if type(r) is Frame]
    garbage = [r for r in records if type(r) is Garbage]
    return Columns([f.begin for f in frames], [f.end for f in frames], [f.value for f in frames], garbage)


# --- Message UUID adaptors ------------------------------------------------------------------------------------

_Getter = Callable[[Any], UUID | None]
_Setter = Callable[[Any, UUID], None]
_ADAPTORS: dict[type, tuple[_Getter, _Setter]] = {}


def _to_uuid(value: Any) -> UUID | None:
    if value is None or value == "" or value == b"":
        return None
    if isinstance(value, UUID):
        return value
    if isinstance(value, str):
        return uuid_from_str(value)
    if isinstance(value, bytes | bytearray):
        return UUID(bytes=bytes(value))
    raise TypeError(f"a message uuid must be a uuid.UUID, str or 16 bytes, got {type(value).__name__}")


def _no_get(msg: Any) -> None:
    return None


def _no_set(msg: Any, u: UUID) -> None:
    return None


def _dict_get(msg: Any) -> UUID | None:
    value = msg.get("uuid")
    return uuid_from_str(value) if type(value) is str and value else _to_uuid(value)


def _dict_set(msg: Any, u: UUID) -> None:
    msg["uuid"] = uuid_to_str(u)


def _dict_set_str(msg: Any, u: str) -> None:
    msg["uuid"] = u


def _proto_bytes_set(msg: Any, u: UUID) -> None:
    msg.uuid = u.bytes


def _proto_str_set(msg: Any, u: UUID) -> None:
    msg.uuid = uuid_to_str(u)


def _proto_str_set_str(msg: Any, u: str) -> None:
    msg.uuid = u


_STR_SETTERS: dict[Callable[[Any, UUID], None], Callable[[Any, str], None]] = {
    _dict_set: _dict_set_str,
    _proto_str_set: _proto_str_set_str,
}


def _attr_get(msg: Any) -> UUID | None:
    return _to_uuid(msg.uuid)


def _attr_set(msg: Any, u: UUID) -> None:
    try:
        msg.uuid = uuid_to_str(u) if isinstance(msg.uuid, str) else u
    except AttributeError as exc:  # frozen Struct or dataclass, read-only property
        raise TypeError(f"cannot set the uuid of a {type(msg).__qualname__}: {exc}") from exc


def _adaptor(cls: type) -> tuple[_Getter, _Setter]:
    """The (get, set) pair for messages of `cls`, worked out once per type."""
    found = _ADAPTORS.get(cls)
    if found is not None:
        return found
    if getattr(cls, "__tidings_no_uuid__", False):
        found = (_no_get, _no_set)
    elif issubclass(cls, dict):
        found = (_dict_get, _dict_set)
    elif issubclass(cls, _ProtoMessage):
        field = cls.DESCRIPTOR.fields_by_name.get("uuid")
        if field is None or field.type not in (field.TYPE_BYTES, field.TYPE_STRING):
            raise TypeError(
                f"protobuf message {cls.DESCRIPTOR.full_name} has no `bytes uuid` or `string uuid` field; add one, "
                "or set the class attribute __tidings_no_uuid__ = True for at-least-once delivery"
            )
        found = (_attr_get, _proto_bytes_set if field.type == field.TYPE_BYTES else _proto_str_set)
    elif (
        "uuid" in getattr(cls, "__struct_fields__", ())
        or hasattr(cls, "uuid")
        or "uuid" in getattr(cls, "__annotations__", {})
    ):
        found = (_attr_get, _attr_set)
    else:
        return (_missing_uuid, _missing_uuid)  # not cached: instances may still grow the attribute
    _ADAPTORS[cls] = found
    return found


def _missing_uuid(msg: Any, u: UUID | None = None) -> Any:
    if hasattr(msg, "uuid"):
        return _attr_get(msg) if u is None else _attr_set(msg, u)
    raise TypeError(
        f"a {type(msg).__qualname__} carries no UUID: give it a `uuid` field, or set the class attribute "
        "__tidings_no_uuid__ = True for at-least-once delivery"
    )


def uuid_getter(cls: type) -> Callable[[Any], UUID | None]:
    """The function that reads the UUID of messages of `cls` (what `get_uuid` calls per message)."""
    return _adaptor(cls)[0]


def uuid_setter(cls: type) -> Callable[[Any, UUID], None]:
    """The function that stores a UUID in messages of `cls` (what `set_uuid` calls per message); a no-op for
    types that opt out, and one raising TypeError (with a hint) for types that cannot carry a UUID."""
    return _adaptor(cls)[1]


def uuid_str_setter(cls: type) -> Callable[[Any, str], None] | None:
    """For a type that keeps its UUID as a string (dicts, protobufs with `string uuid`), the function
    that stores one from its string form: the publisher's batch path, with no UUID objects. Else None."""
    return _STR_SETTERS.get(_adaptor(cls)[1])


def get_uuid(msg: Any) -> UUID | None:
    """The UUID a message carries, or None if it has none yet or its type opts out of UUIDs."""
    return _adaptor(type(msg))[0](msg)


def set_uuid(msg: Any, u: UUID) -> None:
    """Store `u` in a message (a no-op for types that opt out). Raises TypeError for a type with no uuid field."""
    _adaptor(type(msg))[1](msg, u)


def supports_uuid(msg_or_type: Any) -> bool:
    """Whether messages of this type carry UUIDs, i.e. can be delivered exactly once."""
    cls = msg_or_type if isinstance(msg_or_type, type) else type(msg_or_type)
    try:
        getter = _adaptor(cls)[0]
    except TypeError:
        return False
    return getter is not _no_get and (getter is not _missing_uuid or hasattr(msg_or_type, "uuid"))


# --- Framings --------------------------------------------------------------------------------------------------


class Framing:
    """Encodes messages into a journal's bytes and returns incremental decoders; one subclass per content type.

    Use :func:`framing_for` to get the framing of a journal's ``content-type`` label value.

    **Parameters:**

    * **max_message_size** - the largest message (JSON line, or protobuf payload) written or accepted.
    """

    content_type: str = ""

    def __init__(self, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        if max_message_size <= 0:
            raise ValueError(f"max_message_size must be positive, got {max_message_size}")
        self.max_message_size = max_message_size

    def marshal(self, msg: Any) -> bytes:
        """The framed bytes of one message."""
        raise NotImplementedError

    def encode_batch(self, msgs: Iterable[Any]) -> bytes:
        """The framed bytes of many messages, back to back: the fast path for a batch append."""
        return b"".join(self.marshal(m) for m in msgs)

    def decoder(self, message_type: Any = None, offset: int = 0) -> Decoder:
        """An incremental decoder of this framing, starting at journal `offset` (see :class:`Decoder`)."""
        raise NotImplementedError

    def _too_large(self, size: int) -> ValidationError:
        return ValidationError(
            "message", f"encodes to {size} bytes, over max_message_size {self.max_message_size} ({self.content_type})"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_message_size={self.max_message_size})"


class NdjsonFraming(Framing):
    """Newline-delimited JSON via ``msgspec.json``: dicts, msgspec Structs and anything msgspec can encode."""

    content_type = NDJSON

    def __init__(self, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        super().__init__(max_message_size)
        self._encoder = msgspec.json.Encoder()

    def marshal(self, msg: Any) -> bytes:
        try:
            line = self._encoder.encode(msg)
        except TypeError as exc:
            raise TypeError(f"{NDJSON} cannot encode a {type(msg).__qualname__}: {exc}") from exc
        if len(line) >= self.max_message_size:
            raise self._too_large(len(line) + 1)
        return line + b"\n"

    def encode_batch(self, msgs: Iterable[Any]) -> bytes:
        msgs = msgs if isinstance(msgs, list) else list(msgs)
        try:
            out = self._encoder.encode_lines(msgs)
        except TypeError as exc:
            raise TypeError(f"{NDJSON} cannot encode a message of this batch: {exc}") from exc
        if len(out) >= self.max_message_size:  # only then may one line be too large: find it
            for m in msgs:
                self.marshal(m)
        return out

    def decoder(self, message_type: Any = None, offset: int = 0) -> Decoder:
        """A decoder of JSON lines into dicts, or into `message_type` (a msgspec Struct or other decodable type)."""
        return _NdjsonDecoder(
            msgspec.json.Decoder(dict if message_type is None else message_type), self.max_message_size, offset
        )


class ProtobufFixedFraming(Framing):
    """Gazette's fixed framing of protobuf messages: magic word, 4-byte little-endian length, payload.

    ``marshal`` also accepts ``bytes`` (an already serialized payload); a decoder without a message type yields
    payload ``bytes``.
    """

    content_type = PROTOBUF_FIXED

    def marshal(self, msg: Any) -> bytes:
        payload = self._payload(msg)
        return FIXED_FRAME_WORD + _LENGTH.pack(len(payload)) + payload

    def encode_batch(self, msgs: Iterable[Any]) -> bytes:
        out = bytearray()
        word, pack, payload_of = FIXED_FRAME_WORD, _LENGTH.pack, self._payload
        for msg in msgs:
            payload = payload_of(msg)
            out += word
            out += pack(len(payload))
            out += payload
        return bytes(out)

    def _payload(self, msg: Any) -> bytes:
        if isinstance(msg, _ProtoMessage):
            payload = msg.SerializeToString()
        elif isinstance(msg, bytes | bytearray | memoryview):
            payload = bytes(msg)
        else:
            raise TypeError(f"{PROTOBUF_FIXED} frames protobuf messages or bytes, not a {type(msg).__qualname__}")
        if len(payload) > self.max_message_size:
            raise self._too_large(len(payload))
        return payload

    def decoder(self, message_type: Any = None, offset: int = 0) -> Decoder:
        """A decoder of frames into instances of the protobuf class `message_type`, or into payload bytes if None."""
        if message_type is not None and not (
            isinstance(message_type, type) and issubclass(message_type, _ProtoMessage)
        ):
            raise TypeError(f"{PROTOBUF_FIXED} decodes into protobuf message classes, not {message_type!r}")
        return _FixedDecoder(message_type, self.max_message_size, offset)


_FRAMINGS: dict[str, type[Framing]] = {NDJSON: NdjsonFraming, PROTOBUF_FIXED: ProtobufFixedFraming}
_DEFAULTS: dict[str, Framing] = {}


def framing_for(content_type: str, *, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> Framing:
    """The framing of a journal's ``content-type`` label value (parameters such as ``; charset=utf-8`` ignored).

    Raises :class:`~tidings.protocol.status.ValidationError` naming the content type and the supported ones.
    """
    key = content_type.split(";", 1)[0].strip().lower()
    cls = _FRAMINGS.get(key)
    if cls is None:
        raise ValidationError(
            f"labels.{CONTENT_TYPE_LABEL}",
            f"unsupported content type {content_type!r}; supported: {', '.join(sorted(_FRAMINGS))}",
        )
    if max_message_size != DEFAULT_MAX_MESSAGE_SIZE:
        return cls(max_message_size)
    framing = _DEFAULTS.get(key)
    if framing is None:
        framing = _DEFAULTS[key] = cls()
    return framing


# --- Decoders --------------------------------------------------------------------------------------------------


class Decoder:
    """Turns journal chunks into :class:`Frame` and :class:`Garbage` records, keeping a partial tail buffered.

    Feed chunks in journal order. A chunk at an offset other than where the last one ended (a journal offset jump,
    or a re-read) reports any buffered bytes as garbage and restarts there.
    """

    def __init__(self, max_message_size: int, offset: int) -> None:
        self.max_message_size = max_message_size
        self._buf = bytearray()
        self._base = offset  # journal offset of _buf[0]
        self._garbage_begin: int | None = None  # start of a run of garbage not yet reported
        self._garbage_why = ""

    @property
    def offset(self) -> int:
        """Journal offset of the first byte not yet reported in a record (buffered or pending garbage)."""
        return self._base if self._garbage_begin is None else self._garbage_begin

    @property
    def end(self) -> int:
        """Journal offset just past the last byte fed."""
        return self._base + len(self._buf)

    @property
    def buffered(self) -> int:
        """Bytes held for the next chunk (a partial frame or line)."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview, offset: int | None = None) -> list[Record]:
        """Decode a chunk that starts at journal `offset` (default: where the last chunk ended)."""
        out: list[Record] = []
        columns = self._feed(data, offset, out)
        if columns is not None:
            out.extend(map(Frame, columns.begins, columns.ends, columns.values))
        return out

    def feed_columns(self, data: bytes | bytearray | memoryview, offset: int | None = None) -> Columns:
        """Like `feed`, with the frames as parallel lists (garbage apart): the fast form for bulk readers."""
        out: list[Record] = []
        columns = self._feed(data, offset, out)
        return columns if columns is not None else columns_of(out)

    def _feed(self, data: bytes | bytearray | memoryview, offset: int | None, out: list[Record]) -> Columns | None:
        """Scan a chunk: records go to `out`, unless the whole chunk took the fast path (returned as Columns)."""
        if offset is not None and offset != self.end:
            self._flush(out, f"discontinuity: the next chunk starts at offset {offset}")
            self._base = offset
        if self._buf:
            self._buf += data
            work: bytes | bytearray = self._buf
        else:
            work = data if isinstance(data, bytes | bytearray) else bytes(data)
        columns = None
        with memoryview(work) as view:
            fast = self._scan_fast(work, view) if not out and self._garbage_begin is None else None
            if fast is not None:
                used, columns = fast
            else:
                used = self._scan(work, view, out)
            rest = bytes(view[used:]) if used < len(view) else b""
        self._base += used
        self._buf = bytearray(rest)
        return columns

    def _scan_fast(self, work: bytes | bytearray, view: memoryview) -> tuple[int, Columns] | None:
        """Decode the chunk's complete messages without per-message Python work, or None: use `_scan`."""
        return None

    def finish(self) -> list[Record]:
        """Report whatever is left at the end of the data (a partial frame or line, pending garbage) as garbage."""
        out: list[Record] = []
        self._flush(out, "unexpected end of data inside a message")
        return out

    def _flush(self, out: list[Record], why: str) -> None:
        end = self.end
        if self._garbage_begin is not None:
            out.append(Garbage(self._garbage_begin, end, self._garbage_why))
        elif self._buf and self._buf.strip():
            out.append(Garbage(self._base, end, why))
        self._garbage_begin = None
        self._base = end
        self._buf = bytearray()

    def _scan(self, work: bytes | bytearray, view: memoryview, out: list[Record]) -> int:
        """Append the records found in `work` (which starts at self._base); return how many bytes were used."""
        raise NotImplementedError


class _NdjsonDecoder(Decoder):
    def __init__(self, decoder: msgspec.json.Decoder[Any], max_message_size: int, offset: int) -> None:
        super().__init__(max_message_size, offset)
        self._decode = decoder.decode
        self._decode_lines = decoder.decode_lines

    def _scan_fast(self, work: bytes | bytearray, view: memoryview) -> tuple[int, Columns] | None:
        """Every complete line decoded in one msgspec call and its offsets computed in C: the common case of
        a chunk of valid, non-blank lines under the size limit."""
        last = work.rfind(b"\n")
        if last < 0:
            return None
        try:
            values = self._decode_lines(view[: last + 1])
        except msgspec.DecodeError:
            return None
        lengths = list(map(len, bytes(view[: last + 1]).split(b"\n")))
        lengths.pop()  # (what follows the last newline)
        if len(values) != len(lengths) or max(lengths) >= self.max_message_size:
            return None  # blank lines (which decode_lines skips), or an over-long one
        bounds = list(accumulate(map(add, lengths, repeat(1)), initial=self._base))
        return last + 1, Columns(bounds[:-1], bounds[1:], values, [])

    def _scan(self, work: bytes | bytearray, view: memoryview, out: list[Record]) -> int:
        base, decode, limit = self._base, self._decode, self.max_message_size
        n, pos = len(work), 0
        append = out.append
        if self._garbage_begin is not None:  # skipping the rest of an over-long line
            nl = work.find(b"\n")
            if nl < 0:
                return n
            append(Garbage(self._garbage_begin, base + nl + 1, self._garbage_why))
            self._garbage_begin = None
            pos = nl + 1
        while pos < n:
            nl = work.find(b"\n", pos)
            if nl < 0:
                if n - pos > limit:
                    self._garbage_begin = base + pos
                    self._garbage_why = f"line exceeds max_message_size {limit}"
                    return n
                return pos
            if nl + 1 - pos > limit:
                append(Garbage(base + pos, base + nl + 1, f"line exceeds max_message_size {limit}"))
            else:
                line = view[pos:nl]
                try:
                    append(Frame(base + pos, base + nl + 1, decode(line)))
                except msgspec.DecodeError as exc:
                    if line.tobytes().strip():
                        append(Garbage(base + pos, base + nl + 1, f"invalid JSON line: {exc}"))
            pos = nl + 1
        return pos


class _FixedDecoder(Decoder):
    def __init__(self, message_type: type[_ProtoMessage] | None, max_message_size: int, offset: int) -> None:
        super().__init__(max_message_size, offset)
        self._type = message_type

    def _scan(self, work: bytes | bytearray, view: memoryview, out: list[Record]) -> int:
        base, limit, mtype = self._base, self.max_message_size, self._type
        word, header = FIXED_FRAME_WORD, FIXED_FRAME_HEADER_LENGTH
        unpack = _LENGTH.unpack_from
        n, pos = len(work), 0
        while n - pos >= header:
            if work.startswith(word, pos):
                (length,) = unpack(work, pos + 4)
                if length <= limit:
                    end = pos + header + length
                    if end > n:
                        break  # partial frame: wait for more bytes
                    if self._garbage_begin is not None:
                        out.append(Garbage(self._garbage_begin, base + pos, self._garbage_why))
                        self._garbage_begin = None
                    out.append(self._frame(base + pos, base + end, view[pos + header : end], mtype))
                    pos = end
                    continue
                why = f"frame length {length} exceeds max_message_size {limit}"
            else:
                why = "de-synchronization: no frame header"
            # Not at a frame boundary: skip to the next magic word, remembering where the garbage began.
            if self._garbage_begin is None:
                self._garbage_begin, self._garbage_why = base + pos, why
            nxt = work.find(word, pos + 1)
            if nxt < 0:
                pos = max(pos + 1, n - (len(word) - 1))  # the last bytes may begin a magic word
                break
            pos = nxt
        return pos

    @staticmethod
    def _frame(begin: int, end: int, payload: memoryview, mtype: type[_ProtoMessage] | None) -> Record:
        if mtype is None:
            return Frame(begin, end, payload.tobytes())
        msg = mtype()
        try:
            msg.ParseFromString(payload)  # type: ignore[arg-type]  # (any buffer parses: no copy of the payload)
        except _ProtoDecodeError as exc:
            return Garbage(begin, end, f"protobuf decode ({mtype.DESCRIPTOR.full_name}): {exc}")
        return Frame(begin, end, msg)
