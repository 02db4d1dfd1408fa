"""Framings: round trips, journal offsets of every record, garbage resynchronization, partial frames, size limits.

A reader must never crash on a journal's bytes (DESIGN.md invariant 7 needs every committed message, so a bad
range is reported with its offsets and decoding goes on), and must never invent a message from a partial frame.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import msgspec
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from tidings.message import (
    FIXED_FRAME_WORD,
    NDJSON,
    PROTOBUF_FIXED,
    Frame,
    Garbage,
    build_uuid,
    framing_for,
    get_uuid,
    new_producer_id,
    set_uuid,
    supports_uuid,
)
from tidings.protocol.status import ValidationError


def _proto_classes() -> tuple[type, type, type]:
    """Three small protobuf message classes built at run time: uuid as bytes, uuid as string, no uuid."""
    fdp = descriptor_pb2.FileDescriptorProto(name="tidings_test_framing.proto", package="tidings_test", syntax="proto3")
    for name, uuid_type in (
        ("BytesEvent", descriptor_pb2.FieldDescriptorProto.TYPE_BYTES),
        ("StringEvent", descriptor_pb2.FieldDescriptorProto.TYPE_STRING),
        ("Plain", None),
    ):
        m = fdp.message_type.add(name=name)
        if uuid_type is not None:
            m.field.add(name="uuid", number=1, type=uuid_type, label=1)
        m.field.add(name="body", number=2, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    get = message_factory.GetMessageClass
    return tuple(get(pool.FindMessageTypeByName(f"tidings_test.{n}")) for n in ("BytesEvent", "StringEvent", "Plain"))


BytesEvent, StringEvent, PlainProto = _proto_classes()


class Event(msgspec.Struct):
    body: str
    n: int = 0
    uuid: uuid.UUID | None = None


class StrEvent(msgspec.Struct):
    body: str
    uuid: str = ""


class Metric(msgspec.Struct):
    __tidings_no_uuid__ = True
    value: float


class NoField(msgspec.Struct):
    value: int


U = build_uuid(new_producer_id(), 0x1234567890ABCDEF, 1)


# --- framing_for -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label", "content_type"),
    [
        pytest.param("application/x-ndjson", NDJSON, id="ndjson"),
        pytest.param("application/x-protobuf-fixed", PROTOBUF_FIXED, id="protobuf-fixed"),
        pytest.param("Application/X-NDJSON; charset=utf-8", NDJSON, id="ndjson-with-parameters"),
    ],
)
def test_framing_for_picks_by_content_type(label: str, content_type: str) -> None:
    assert framing_for(label).content_type == content_type


def test_framing_for_unknown_content_type_names_it_and_the_supported_ones() -> None:
    with pytest.raises(ValidationError) as info:
        framing_for("text/csv")
    msg = str(info.value)
    assert "'text/csv'" in msg and NDJSON in msg and PROTOBUF_FIXED in msg and "content-type" in msg
    assert isinstance(info.value, ValueError)


# --- ndjson ----------------------------------------------------------------------------------------------------


def test_ndjson_round_trips_dicts_and_structs_with_offsets() -> None:
    f = framing_for(NDJSON)
    msgs = [{"uuid": str(U), "n": 1}, {"n": 2, "s": "é\n"}, {}]
    data = f.encode_batch(msgs)
    assert data == b"".join(f.marshal(m) for m in msgs)
    assert data.count(b"\n") == 3  # embedded newlines are escaped
    records = f.decoder(offset=100).feed(data, 100)
    assert [r.value for r in records] == msgs
    ends = [100 + data.index(b"\n", 0) + 1]
    assert records[0] == Frame(100, ends[0], msgs[0])
    assert records[-1].end == 100 + len(data)
    assert all(a.end == b.begin for a, b in itertools.pairwise(records))

    events = [Event("a", 1, U), Event("b", 2)]
    decoded = f.decoder(Event).feed(f.encode_batch(events), 0)
    assert [r.value for r in decoded] == events


def test_ndjson_bad_line_is_garbage_with_its_offsets_and_decoding_continues() -> None:
    f = framing_for(NDJSON)
    good1, bad, good2 = f.marshal({"a": 1}), b'{"a": \n', f.marshal({"a": 2})
    records = f.decoder().feed(good1 + bad + good2, 10)
    assert records[0] == Frame(10, 10 + len(good1), {"a": 1})
    assert isinstance(records[1], Garbage)
    assert (records[1].begin, records[1].end) == (10 + len(good1), 10 + len(good1) + len(bad))
    assert "invalid JSON" in records[1].error
    assert records[2] == Frame(10 + len(good1) + len(bad), 10 + len(good1 + bad + good2), {"a": 2})


def test_ndjson_line_of_the_wrong_shape_is_garbage() -> None:
    f = framing_for(NDJSON)
    records = f.decoder(Event).feed(b'{"body": 3}\n[1, 2]\n{"body": "ok"}\n', 0)
    assert [type(r) for r in records] == [Garbage, Garbage, Frame]
    assert records[2].value == Event("ok")
    assert records[0].end == records[1].begin == 12


def test_ndjson_blank_lines_are_skipped_not_garbage() -> None:
    records = framing_for(NDJSON).decoder().feed(b'\n  \n{"a":1}\r\n\n', 0)
    assert records == [Frame(4, 13, {"a": 1})]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_ndjson_partial_lines_wait_for_the_rest_whatever_the_chunking(data: st.DataObject) -> None:
    f = framing_for(NDJSON)
    msgs = [{"i": i, "s": "x" * i} for i in range(12)]
    raw = f.encode_batch(msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    dec = f.decoder(offset=7)
    records: list[Any] = []
    for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True):
        records += dec.feed(raw[a:b], 7 + a)
        assert dec.offset == 7 + (records[-1].end - 7 if records else 0)
    assert records == f.decoder(offset=7).feed(raw, 7)
    assert [r.value for r in records] == msgs
    assert dec.finish() == [] and dec.buffered == 0


def test_ndjson_partial_trailing_line_is_reported_only_at_finish() -> None:
    dec = framing_for(NDJSON).decoder()
    assert dec.feed(b'{"a": 1}\n{"a":', 0) == [Frame(0, 9, {"a": 1})]
    assert dec.buffered == 5 and dec.offset == 9 and dec.end == 14
    assert dec.finish() == [Garbage(9, 14, "unexpected end of data inside a message")]


def test_ndjson_too_large_messages() -> None:
    f = framing_for(NDJSON, max_message_size=32)
    with pytest.raises(ValidationError, match="max_message_size 32"):
        f.marshal({"s": "x" * 40})
    with pytest.raises(ValidationError, match="max_message_size 32"):
        f.encode_batch([{"s": "y"}, {"s": "x" * 40}])
    long_line = b'{"s": "' + b"x" * 60 + b'"}\n'
    ok = b'{"s": 1}\n'
    dec = f.decoder()
    # An over-long line arriving in pieces is skipped up to its newline, without buffering it.
    out = dec.feed(ok + long_line[:40], 0)
    out += dec.feed(long_line[40:50])
    assert dec.buffered == 0
    out += dec.feed(long_line[50:] + ok)
    n = len(ok) + len(long_line)
    assert out == [
        Frame(0, len(ok), {"s": 1}),
        Garbage(len(ok), n, "line exceeds max_message_size 32"),
        Frame(n, n + len(ok), {"s": 1}),
    ]
    # A complete over-long line in one chunk is garbage too.
    assert [type(r) for r in f.decoder().feed(long_line + ok, 0)] == [Garbage, Frame]


def test_ndjson_refuses_protobuf_messages() -> None:
    with pytest.raises(TypeError, match="cannot encode"):
        framing_for(NDJSON).marshal(BytesEvent(body="x"))


# --- protobuf fixed ----------------------------------------------------------------------------------------------


def test_fixed_frame_layout_is_gazettes() -> None:
    msg = BytesEvent(uuid=U.bytes, body="hello")
    frame = framing_for(PROTOBUF_FIXED).marshal(msg)
    payload = msg.SerializeToString()
    assert frame[:4] == bytes([0x66, 0x33, 0x93, 0x36]) == FIXED_FRAME_WORD
    assert frame[4:8] == len(payload).to_bytes(4, "little")
    assert frame[8:] == payload


def test_fixed_round_trips_messages_and_raw_payloads() -> None:
    f = framing_for(PROTOBUF_FIXED)
    msgs = [BytesEvent(uuid=U.bytes, body=f"m{i}" * i) for i in range(5)]
    data = f.encode_batch(msgs)
    assert data == b"".join(f.marshal(m) for m in msgs)
    records = f.decoder(BytesEvent, offset=1000).feed(data, 1000)
    assert [r.value for r in records] == msgs
    assert records[0].begin == 1000 and records[-1].end == 1000 + len(data)
    raw = f.decoder().feed(f.encode_batch([b"abc", b"", bytearray(b"z")]), 0)
    assert raw == [Frame(0, 11, b"abc"), Frame(11, 19, b""), Frame(19, 28, b"z")]
    well_known = struct_pb2.Value(string_value="wk")
    assert f.decoder(struct_pb2.Value).feed(f.marshal(well_known), 0)[0].value == well_known


def test_fixed_resynchronizes_after_garbage_and_reports_the_skipped_range() -> None:
    f = framing_for(PROTOBUF_FIXED)
    a, b = f.marshal(b"first"), f.marshal(b"second")
    junk = b"\x00junk\x66\x33 more junk"  # includes a partial magic word
    records = f.decoder().feed(a + junk + b, 50)
    start = 50 + len(a)
    assert records == [
        Frame(50, start, b"first"),
        Garbage(start, start + len(junk), "de-synchronization: no frame header"),
        Frame(start + len(junk), start + len(junk) + len(b), b"second"),
    ]


@settings(max_examples=60, deadline=None)
@given(junk=st.binary(max_size=40), data=st.data())
def test_fixed_garbage_and_chunking_never_lose_the_frames_around_it(junk: bytes, data: st.DataObject) -> None:
    f = framing_for(PROTOBUF_FIXED)
    junk = junk.replace(FIXED_FRAME_WORD[:1], b"\x00")  # junk that cannot contain a magic word
    a, b = f.marshal(b"A" * 9), f.marshal(b"B" * 3)
    raw = a + junk + b
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=6)))
    dec = f.decoder()
    records: list[Any] = []
    for lo, hi in zip([0, *cuts], [*cuts, len(raw)], strict=True):
        records += dec.feed(raw[lo:hi], lo)
    records += dec.finish()
    expect = [Frame(0, len(a), b"A" * 9)]
    if junk:
        expect.append(Garbage(len(a), len(a) + len(junk), "de-synchronization: no frame header"))
    expect.append(Frame(len(a) + len(junk), len(raw), b"B" * 3))
    assert records == expect


def test_fixed_partial_frame_waits_for_more_bytes() -> None:
    f = framing_for(PROTOBUF_FIXED)
    frame = f.marshal(BytesEvent(body="partial"))
    dec = f.decoder(BytesEvent)
    for i in range(len(frame) - 1):
        assert dec.feed(frame[i : i + 1]) == []
    assert dec.buffered == len(frame) - 1 and dec.offset == 0
    assert dec.feed(frame[-1:]) == [Frame(0, len(frame), BytesEvent(body="partial"))]
    assert dec.buffered == 0 and dec.offset == len(frame)


def test_fixed_truncated_frame_at_end_is_garbage_on_finish() -> None:
    f = framing_for(PROTOBUF_FIXED)
    frame = f.marshal(b"0123456789")
    dec = f.decoder()
    assert dec.feed(frame[:12], 0) == []
    assert dec.finish() == [Garbage(0, 12, "unexpected end of data inside a message")]
    assert dec.feed(b"\n", 12) == [] and dec.finish() == []  # a lone trailing newline is tolerated


def test_fixed_undecodable_payload_is_garbage_spanning_its_frame() -> None:
    f = framing_for(PROTOBUF_FIXED)
    bad, good = f.marshal(b"\xff\xff\xff"), f.marshal(BytesEvent(body="ok"))
    records = f.decoder(BytesEvent).feed(bad + good, 0)
    assert isinstance(records[0], Garbage) and (records[0].begin, records[0].end) == (0, len(bad))
    assert "protobuf decode (tidings_test.BytesEvent)" in records[0].error
    assert records[1] == Frame(len(bad), len(bad) + len(good), BytesEvent(body="ok"))


def test_fixed_too_large_messages() -> None:
    f = framing_for(PROTOBUF_FIXED, max_message_size=16)
    with pytest.raises(ValidationError, match="over max_message_size 16"):
        f.marshal(b"x" * 17)
    with pytest.raises(ValidationError, match="over max_message_size 16"):
        f.encode_batch([b"ok", b"x" * 17])
    assert f.marshal(b"x" * 16)
    # A header claiming more than the limit is not trusted: it is garbage, and decoding resyncs after it.
    lying = FIXED_FRAME_WORD + (1 << 30).to_bytes(4, "little") + b"tail"
    good = f.marshal(b"fine")
    records = f.decoder().feed(lying + good, 0)
    assert records == [
        Garbage(0, len(lying), "frame length 1073741824 exceeds max_message_size 16"),
        Frame(len(lying), len(lying) + len(good), b"fine"),
    ]


def test_fixed_refuses_other_types() -> None:
    f = framing_for(PROTOBUF_FIXED)
    with pytest.raises(TypeError, match="protobuf messages or bytes"):
        f.marshal({"a": 1})
    with pytest.raises(TypeError, match="protobuf message classes"):
        f.decoder(dict)


@pytest.mark.parametrize("content_type", [NDJSON, PROTOBUF_FIXED])
def test_discontinuity_reports_the_buffered_bytes_and_restarts_at_the_new_offset(content_type: str) -> None:
    f = framing_for(content_type)
    msg = {"a": 1} if content_type == NDJSON else b"payload"
    frame = f.marshal(msg)
    dec = f.decoder()
    assert dec.feed(frame[:5], 0) == []
    out = dec.feed(frame, 500)
    assert out[0] == Garbage(0, 5, "discontinuity: the next chunk starts at offset 500")
    assert out[1] == Frame(500, 500 + len(frame), msg)


# --- message UUID adaptors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("msg", "stored"),
    [
        pytest.param({"body": "x"}, lambda m: m["uuid"] == str(U), id="dict"),
        pytest.param(Event("x"), lambda m: m.uuid == U, id="struct-uuid"),
        pytest.param(StrEvent("x"), lambda m: m.uuid == str(U), id="struct-str"),
        pytest.param(BytesEvent(body="x"), lambda m: m.uuid == U.bytes, id="protobuf-bytes"),
        pytest.param(StringEvent(body="x"), lambda m: m.uuid == str(U), id="protobuf-string"),
    ],
)
def test_set_and_get_uuid(msg: Any, stored: Any) -> None:
    assert supports_uuid(msg)
    assert get_uuid(msg) is None
    set_uuid(msg, U)
    assert stored(msg)
    assert get_uuid(msg) == U


def test_uuid_survives_a_round_trip_through_each_framing() -> None:
    for content_type, msg, mtype in (
        (NDJSON, {"body": "x"}, None),
        (NDJSON, Event("x"), Event),
        (PROTOBUF_FIXED, BytesEvent(body="x"), BytesEvent),
        (PROTOBUF_FIXED, StringEvent(body="x"), StringEvent),
    ):
        set_uuid(msg, U)
        f = framing_for(content_type)
        (record,) = f.decoder(mtype).feed(f.marshal(msg), 0)
        assert get_uuid(record.value) == U, content_type


def test_types_opt_out_of_uuids_for_at_least_once() -> None:
    m = Metric(1.0)
    assert not supports_uuid(m) and not supports_uuid(Metric)
    set_uuid(m, U)  # a no-op
    assert get_uuid(m) is None

    class OptedOutDict(dict):  # the attribute works on any type, dicts included
        __tidings_no_uuid__ = True

    assert get_uuid(OptedOutDict(uuid=str(U))) is None


def test_types_without_a_uuid_field_are_refused_with_a_hint() -> None:
    assert not supports_uuid(NoField(1)) and not supports_uuid(PlainProto())
    with pytest.raises(TypeError, match="__tidings_no_uuid__"):
        set_uuid(NoField(1), U)
    with pytest.raises(TypeError, match="no `bytes uuid` or `string uuid` field"):
        get_uuid(PlainProto())


def test_frozen_struct_uuid_cannot_be_set() -> None:
    class Frozen(msgspec.Struct, frozen=True):
        uuid: uuid.UUID | None = None

    with pytest.raises(TypeError, match="cannot set the uuid"):
        set_uuid(Frozen(), U)
    assert get_uuid(Frozen(U)) == U
