"""Rows of the tidings source: the metadata columns, message fields decoded by msgspec, Arrow batches.

With `format` json a DataFrame's columns are, by name: the metadata columns `journal`, `offset`
(the message's byte offset), `uuid`, `producer` (12 hex digits) and `clock` (the UUID's clock),
`_corrupt` (the text of a message that did not decode, as Spark's JSON reader's corrupt-record
column: its other fields are then null), and every other column is a field of the messages' JSON
objects, decoded with msgspec straight into typed values (a value of the wrong type makes the
message corrupt rather than guessing). With `format` raw: `journal`, `offset`, `value` (the
message's bytes as written: the JSON line without its newline, or a fixed frame's payload).

TIMESTAMP fields are RFC 3339 strings; one without a UTC offset is taken as UTC (the sink writes
Spark's timestamps with their offset). NaN and infinities have no JSON form: the sink writes null.
"""

from __future__ import annotations

import datetime
import decimal
import functools
import json
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import and_, attrgetter, rshift
from typing import Annotated, Any
from uuid import UUID

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from tidings.message.uuid import uuid_fields, uuid_from_str, uuid_to_str
from tidings.protocol.status import UsageError

METADATA_DDL = "journal STRING NOT NULL, offset BIGINT NOT NULL, uuid STRING, producer STRING, clock BIGINT"
METADATA = ("journal", "offset", "uuid", "producer", "clock")
CORRUPT = "_corrupt"
RAW_DDL = "journal STRING NOT NULL, offset BIGINT NOT NULL, value BINARY NOT NULL"

_INT_RANGES: dict[type[DataType], int] = {ByteType: 8, ShortType: 16, IntegerType: 32, LongType: 64}
_BUILTINS = (datetime.datetime, datetime.date, decimal.Decimal, bytes, bytearray)


def arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark checks our batches against (nullability included)."""
    return to_arrow_schema(schema, timezone="UTC")


def _field_type(dt: DataType, where: str) -> Any:
    """The msgspec type that decodes a JSON value into what the Spark type `dt` holds (None allowed)."""
    t: Any
    if isinstance(dt, StringType):
        t = str
    elif type(dt) in _INT_RANGES:
        bits = _INT_RANGES[type(dt)]
        t = Annotated[int, msgspec.Meta(ge=-(1 << (bits - 1)), le=(1 << (bits - 1)) - 1)]
    elif isinstance(dt, FloatType | DoubleType):
        t = float
    elif isinstance(dt, BooleanType):
        t = bool
    elif isinstance(dt, BinaryType):
        t = bytes  # base64 in JSON
    elif isinstance(dt, DecimalType):
        t = decimal.Decimal
    elif isinstance(dt, TimestampType | TimestampNTZType):
        t = datetime.datetime
    elif isinstance(dt, DateType):
        t = datetime.date
    elif isinstance(dt, ArrayType):
        t = list[_field_type(dt.elementType, f"{where}[]")]  # type: ignore[misc]  # (a type built at run time, for msgspec)
    elif isinstance(dt, MapType) and isinstance(dt.keyType, StringType):
        t = dict[str, _field_type(dt.valueType, f"{where}{{}}")]  # type: ignore[misc]  # (a type built at run time, for msgspec)
    elif isinstance(dt, StructType):
        t = _struct_type(dt, where)
    else:
        raise UsageError(
            f"tidings source: column {where!r} has type {dt.simpleString()}, which JSON messages cannot hold; use "
            "string, integer types, float, double, boolean, binary, decimal, date, timestamp, array, "
            "map<string, …> or struct"
        )
    return t | None


def _struct_type(schema: StructType, where: str = "", with_uuid: bool = False) -> type:
    """A msgspec Struct decoding a JSON object into the fields of `schema` (f0, f1, … renamed to the
    columns' names, which need not be Python identifiers); unknown keys are ignored."""
    fields: list[tuple[str, Any, Any]] = [
        (f"f{i}", _field_type(f.dataType, f"{where}{f.name}"), None) for i, f in enumerate(schema.fields)
    ]
    rename = {f"f{i}": f.name for i, f in enumerate(schema.fields)}
    if with_uuid:
        fields.append(("uuid", str | None, None))
    return msgspec.defstruct("Message", fields, rename=rename, frozen=True, gc=False)


def _text(line: Any) -> str:
    return bytes(line).decode("utf-8", errors="replace")


def _needs_builtins(dt: DataType) -> bool:
    if isinstance(dt, StructType):
        return True
    if isinstance(dt, ArrayType):
        return _needs_builtins(dt.elementType)
    if isinstance(dt, MapType):
        return _needs_builtins(dt.valueType)
    return False


def _not_null(dt: DataType, where: str, nullable: bool) -> str | None:
    """The first place in a column's type that may not hold null (Spark trusts our batches on it), or None."""
    if not nullable:
        return where
    if isinstance(dt, StructType):
        return next((w for f in dt.fields if (w := _not_null(f.dataType, f"{where}.{f.name}", f.nullable))), None)
    if isinstance(dt, ArrayType):
        return _not_null(dt.elementType, f"{where}[]", dt.containsNull)
    if isinstance(dt, MapType):
        return _not_null(dt.valueType, f"{where}{{}}", dt.valueContainsNull)
    return None


class _Uuid(msgspec.Struct, gc=False):
    uuid: UUID | None = None  # (msgspec decodes it in C: the usual case)


class UuidText(msgspec.Struct, gc=False):
    """A JSON line's UUID field alone, as text ("" for no UUID, braces, urn:uuid:): the other fields
    are only checked to be JSON."""

    uuid: str | None = None


_UUIDS, _UUID_TEXTS = msgspec.json.Decoder(list[_Uuid]), msgspec.json.Decoder(list[UuidText])


def line_uuids(lines: list[Any]) -> list[UUID | None]:
    """The UUIDs of JSON lines (`msgspec.Raw`), decoded in one call; ValueError for an invalid one."""
    joined = b"[" + b",".join(lines) + b"]"
    try:
        return [u.uuid for u in _UUIDS.decode(joined)]
    except msgspec.DecodeError:
        pass
    try:
        found = _UUID_TEXTS.decode(joined)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
    return [uuid_from_str(u.uuid) if u.uuid else None for u in found]  # ("" is no UUID, as for other readers)


def text_uuid_ints(values: list[UuidText]) -> Any:
    """The UUIDs of lines decoded as `UuidText`, for `Sequencer.advance`: as 128-bit ints (None: no UUID;
    0: an invalid one, which a reader skips as garbage), or in the usual case, every one canonical
    (8-4-4-4-12 hex digits), as a numpy array of (high, low) 64-bit rows made in a few C calls on the
    joined text: per-message Python work is what limits a driver's scan."""
    texts = list(map(_UUID, values))
    n = len(texts)
    try:
        joined = "".join(texts)  # (TypeError: a line without a UUID)
        if set(map(len, texts)) == {36} and all(joined[at::36].count("-") == n for at in (8, 13, 18, 23)):
            packed = bytes.fromhex(joined.replace("-", ""))  # (ValueError: not hex; one short: whitespace)
            return np.frombuffer(packed, dtype=">u8").reshape(n, 2).astype(np.uint64)
    except (TypeError, ValueError):
        pass
    return [_text_uuid_int(t) for t in texts]


def _text_uuid_int(text: str | None) -> int | None:
    if not text:
        return None  # ("" is no UUID, as for other readers)
    try:
        return uuid_from_str(text).int
    except ValueError:
        return 0


_JOURNAL, _BEGIN, _MESSAGE = attrgetter("journal"), attrgetter("begin"), attrgetter("message")
_UUID = attrgetter("uuid")  # (an envelope's UUID, or a Struct's uuid field as written)
_INT = attrgetter("int")
_INT64_MAX = (1 << 63) - 1
_CANONICAL = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"


def _clock_of(u: UUID | None) -> int | None:
    """A v1 UUID's clock (get_clock); None for no UUID or another kind (a message delivered at-least-once)."""
    fields = None if u is None else uuid_fields(u.int)
    return None if fields is None or fields[1] > _INT64_MAX else fields[1]


def _clocks(uuids: list[UUID | None]) -> pa.Array | list[int | None]:
    """`_clock_of` each UUID, computed by Arrow on their high 64 bits and the byte of their variant
    and sequence: per row only C-level maps (a Python call per row cost as much as the rest of the
    row's columns)."""
    try:
        ints = list(map(_INT, uuids))
    except AttributeError:  # (a message without a UUID)
        return list(map(_clock_of, uuids))
    u = functools.partial(pa.scalar, type=pa.uint64())
    hi = pa.array(map(rshift, ints, repeat(64)), pa.uint64(), size=len(ints))
    byte = pa.array(map(and_, map(rshift, ints, repeat(56)), repeat(0xFF)), pa.uint64(), size=len(ints))
    parts = (
        pc.shift_left(pc.bit_wise_and(hi, u(0xFFF)), u(52)),
        pc.shift_left(pc.bit_wise_and(pc.shift_right(hi, u(16)), u(0xFFFF)), u(36)),
        pc.shift_left(pc.shift_right(hi, u(32)), u(4)),
        pc.bit_wise_and(pc.shift_right(byte, u(2)), u(0xF)),
    )
    clock = functools.reduce(pc.bit_wise_or, parts)
    v1 = pc.and_(
        pc.equal(pc.bit_wise_and(pc.shift_right(hi, u(12)), u(0xF)), u(1)),  # version 1
        pc.equal(pc.shift_right(byte, u(6)), u(0b10)),  # RFC 4122 variant
    )
    fits = pc.less_equal(clock, u(_INT64_MAX))  # (a LongType column)
    return pc.if_else(pc.and_(v1, fits), clock, pa.scalar(None, pa.uint64())).cast(pa.int64())


class _Rows:
    """A batch's delivered envelopes and their decoded Structs, what every column is built from."""

    def __init__(self, envs: Sequence[Any], msgs: Sequence[Any]) -> None:
        self.envs, self.msgs = envs, msgs

    @functools.cached_property
    def uuids(self) -> pa.Array:
        """The UUIDs as canonical strings (for the uuid and producer columns, made once): the lines'
        own when all are written so (as every publisher writes them; checked in bulk), else formatted."""
        written = pa.array(list(map(_UUID, self.msgs)), pa.string())
        if written.null_count == 0 and pc.all(pc.match_substring_regex(written, _CANONICAL)).as_py():
            return written
        return pa.array([None if e.uuid is None else uuid_to_str(e.uuid) for e in self.envs], pa.string())


Column = Callable[[_Rows], Any]  # a column's values (a list or an Array) from a batch's rows


class RowBuilder:
    """Turns envelopes of JSON lines (and corrupt messages) into RecordBatches of a DataFrame's schema.

    Lines are read as `msgspec.Raw` and sequenced by their UUIDs alone (`line_uuids`); only the
    messages delivered are decoded into the schema's types, in one call per batch. So a line whose
    fields do not fit the schema is a `_corrupt` row only if its message is delivered (committed),
    with its exact text.
    """

    message_type = msgspec.Raw

    def __init__(self, schema: StructType) -> None:
        for f in schema.fields:
            where = _not_null(f.dataType, f.name, f.nullable or f.name in ("journal", "offset"))
            if where is not None:
                raise UsageError(
                    f"tidings source: column {where!r} is declared NOT NULL, but a message may lack it or not "
                    "decode (its fields are then null): declare it nullable, and filter nulls in the query"
                )
        self.schema = schema
        self.arrow = arrow_schema(schema)
        names = schema.fieldNames()
        self.body = StructType([f for f in schema.fields if f.name not in METADATA and f.name != CORRUPT])
        self.struct = _struct_type(self.body, with_uuid=True)
        self._decode_all = msgspec.json.Decoder(list[self.struct]).decode  # type: ignore[name-defined]  # (a run-time type)
        self._decode_one: Callable[[bytes], Any] = msgspec.json.Decoder(self.struct).decode
        body_index = {f.name: i for i, f in enumerate(self.body.fields)}
        self._columns: list[Column] = []
        for name, field in zip(names, schema.fields, strict=True):
            self._columns.append(self._column(name, field.dataType, body_index.get(name)))

    def _column(self, name: str, dt: DataType, body_at: int | None) -> Column:
        """How a column's values come from a batch's envelopes and their decoded messages (one C-level map each)."""
        if name == "journal":
            return lambda rows: list(map(_JOURNAL, rows.envs))
        if name == "offset":
            return lambda rows: list(map(_BEGIN, rows.envs))
        if name == "uuid":
            return lambda rows: rows.uuids
        if name == "producer":
            return lambda rows: pc.utf8_slice_codeunits(rows.uuids, 24, 36)
        if name == "clock":
            return lambda rows: _clocks(list(map(_UUID, rows.envs)))
        if name == CORRUPT:
            return lambda rows: pa.nulls(len(rows.envs), pa.string())
        assert body_at is not None
        get = attrgetter(f"f{body_at}")
        if _needs_builtins(dt):
            return lambda rows: msgspec.to_builtins(list(map(get, rows.msgs)), builtin_types=_BUILTINS)
        return lambda rows: list(map(get, rows.msgs))

    def batches(self, envelopes: Sequence[Any]) -> list[pa.RecordBatch]:
        """RecordBatches of delivered messages (Envelopes of `msgspec.Raw` lines), decoded now.

        A line that does not fit the schema, or a value Arrow refuses (a decimal that needs
        rounding, say), makes its message a corrupt row rather than failing the task, which every
        retry of it would do again."""
        envs, msgs, bad = self._decoded(envelopes)
        try:
            return [self._batch(envs, msgs), *([self.corrupt(bad)] if bad else [])]
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
            pass
        good_envs, good_msgs = [], []
        for env, msg in zip(envs, msgs, strict=True):
            try:
                self._batch([env], [msg])
                good_envs.append(env)
                good_msgs.append(msg)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as exc:
                bad.append((env.journal, env.begin, f"{_text(env.message)} ({type(exc).__name__}: {exc})"))
        return [self._batch(good_envs, good_msgs), self.corrupt(bad)]

    def _decoded(self, envelopes: Sequence[Any]) -> tuple[list[Any], list[Any], list[tuple[str, int, str]]]:
        """The envelopes whose lines decode into the schema's Struct, those Structs, and the other lines as text."""
        try:
            return list(envelopes), self._decode_all(b"[" + b",".join(map(_MESSAGE, envelopes)) + b"]"), []
        except msgspec.DecodeError:
            pass
        envs, msgs, bad = [], [], []
        for e in envelopes:
            try:
                msgs.append(self._decode_one(e.message))
                envs.append(e)
            except msgspec.DecodeError:
                bad.append((e.journal, e.begin, _text(e.message)))
        return envs, msgs, bad

    def _batch(self, envs: Sequence[Any], msgs: Sequence[Any]) -> pa.RecordBatch:
        rows = _Rows(envs, msgs)
        arrays = [pa.array(col(rows), type=field.type) for col, field in zip(self._columns, self.arrow, strict=True)]
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow)

    def corrupt(self, rows: Sequence[tuple[str, int, str]]) -> pa.RecordBatch:
        """A RecordBatch of messages that did not decode: (journal, offset, text); other columns null."""
        arrays = []
        for field in self.arrow:
            if field.name == "journal":
                arrays.append(pa.array([r[0] for r in rows], type=field.type))
            elif field.name == "offset":
                arrays.append(pa.array([r[1] for r in rows], type=field.type))
            elif field.name == CORRUPT:
                arrays.append(pa.array([r[2] for r in rows], type=field.type))
            else:
                arrays.append(pa.nulls(len(rows), type=field.type))
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow)


_METADATA_TYPES = {
    "journal": StringType(), "offset": LongType(), "uuid": StringType(), "producer": StringType(),
    "clock": LongType(), CORRUPT: StringType(),
}  # fmt: skip


def check_schema(fmt: str, schema_json: str) -> None:
    """Refuse a query's schema that `fmt` cannot fill (an unsupported type; raw's columns; a
    metadata column of another type), in one line."""
    if fmt == "raw":
        raw_schema(schema_json)
        return
    for f in StructType.fromJson(json.loads(schema_json)).fields:
        want = _METADATA_TYPES.get(f.name)
        if want is not None and f.dataType != want:
            raise UsageError(
                f"tidings source: column {f.name!r} is filled by the source as {want.simpleString()}, not "
                f"{f.dataType.simpleString()}: declare it {want.simpleString()}, or leave it out of the schema"
            )
    row_builder(schema_json)


_RAW_COLUMNS = [("journal", StringType()), ("offset", LongType()), ("value", BinaryType())]


@functools.lru_cache(maxsize=16)
def raw_schema(schema_json: str) -> pa.Schema:
    """The Arrow schema of format raw's batches for the query's schema, which must hold raw's columns
    (a user's `.schema()` may declare them nullable, as a DDL string does: batches follow it)."""
    schema = StructType.fromJson(json.loads(schema_json))
    if [(f.name, f.dataType) for f in schema.fields] != _RAW_COLUMNS:
        raise UsageError(
            "tidings source: format raw gives the columns journal, offset, value (string, bigint, binary), not "
            f"{schema.simpleString()}: drop .schema(...) (or declare exactly those), or use format json"
        )
    return arrow_schema(schema)


@functools.lru_cache(maxsize=16)
def row_builder(schema_json: str) -> RowBuilder:
    """One RowBuilder per schema per process (building the msgspec types is not free)."""
    return RowBuilder(StructType.fromJson(json.loads(schema_json)))
