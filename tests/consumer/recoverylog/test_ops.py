"""Recorded operations on the wire (consumer/recoverylog/ops.py): whatever chunks the log is read in,
the reader gives back exactly the operations written, with their data and exact offsets; bytes that
are no operation are reported as garbage and the operations after them are still found; the author
fence is a register the brokers can check."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidings.consumer.recoverylog.ops import (
    MAX_OP_SIZE,
    MAX_WRITE_OP,
    Decoded,
    Garbage,
    OpReader,
    checksum,
    encode,
    fence,
    new_author,
)
from tidings.protocol import labels, validate
from tidings.protocol import protocol_pb2 as pb

_paths = st.text(alphabet="abcdefgh-_.", min_size=1, max_size=12)


@st.composite
def ops(draw: st.DrawFn) -> tuple[pb.RecordedOp, bytes]:
    op = pb.RecordedOp(seq_no=draw(st.integers(1, 1 << 40)), checksum=draw(st.integers(0, 0xFFFFFFFF)))
    op.author = draw(st.integers(1, 0xFFFFFFFF))
    kind = draw(st.sampled_from(["create", "link", "unlink", "write", "truncate", "noop"]))
    data = b""
    if kind == "create":
        op.create.path = draw(_paths)
    elif kind in ("link", "unlink"):
        getattr(op, kind).CopyFrom(pb.RecordedOp.Link(fnode=draw(st.integers(1, 1 << 40)), path=draw(_paths)))
    elif kind == "write":
        data = draw(st.binary(max_size=300))
        op.write.CopyFrom(pb.RecordedOp.Write(fnode=3, offset=draw(st.integers(0, 1 << 30)), length=len(data)))
    elif kind == "truncate":
        op.truncate.CopyFrom(pb.RecordedOp.Truncate(fnode=3, size=draw(st.integers(0, 1 << 30))))
    return op, data


def read_in_chunks(log: bytes, cuts: list[int], start: int = 0) -> tuple[list[Decoded | Garbage], OpReader]:
    reader = OpReader(start)
    out: list[Decoded | Garbage] = []
    bounds = sorted({0, len(log), *(c % (len(log) + 1) for c in cuts)})
    for a, b in itertools.pairwise(bounds):
        out.extend(reader.feed(log[a:b]))
    return out, reader


@settings(max_examples=200, deadline=None)
@given(st.lists(ops(), max_size=20), st.lists(st.integers(0, 1 << 16), max_size=30), st.integers(0, 1 << 40))
def test_every_operation_comes_back_with_its_data_and_offsets_whatever_the_chunks(written, cuts, start) -> None:
    frames = [encode(op, data) for op, data in written]
    out, reader = read_in_chunks(b"".join(frames), cuts, start)
    assert all(isinstance(d, Decoded) for d in out)
    assert [(d.op, d.data) for d in out] == written  # type: ignore[union-attr]
    offset = start
    for d, frame in zip(out, frames, strict=True):
        assert (d.first_offset, d.last_offset) == (offset, offset + len(frame))  # type: ignore[union-attr]
        offset += len(frame)
    assert (reader.offset, reader.pending) == (offset, 0)


@settings(max_examples=100, deadline=None)
@given(st.lists(ops(), min_size=1, max_size=8), st.binary(min_size=1, max_size=50), st.lists(st.integers(0, 1 << 12)))
def test_garbage_between_operations_is_reported_and_the_rest_is_found(written, junk, cuts) -> None:
    junk = junk.replace(b"\x66", b"\x00")  # (junk holding the magic word's first byte could fake a frame)
    mid = len(written) // 2
    before = b"".join(encode(op, data) for op, data in written[:mid])
    after = b"".join(encode(op, data) for op, data in written[mid:])
    out, _ = read_in_chunks(before + junk + after, cuts)
    decoded = [d for d in out if isinstance(d, Decoded)]
    garbage = [g for g in out if isinstance(g, Garbage)]
    assert [(d.op, d.data) for d in decoded] == written
    assert garbage and garbage[0].first_offset == len(before)
    assert sum(g.last_offset - g.first_offset for g in garbage) == len(junk)


def test_a_partial_operation_waits_for_the_rest() -> None:
    op = pb.RecordedOp(seq_no=1, author=7, write=pb.RecordedOp.Write(fnode=1, offset=0, length=5))
    frame = encode(op, b"hello")
    reader = OpReader(100)
    assert list(reader.feed(frame[:-1])) == []
    assert (reader.offset, reader.pending) == (100, len(frame) - 1)
    (d,) = reader.feed(frame[-1:])
    assert isinstance(d, Decoded) and d.data == b"hello" and (d.first_offset, d.last_offset) == (100, 100 + len(frame))


TOO_LONG = pb.RecordedOp(seq_no=1, write=pb.RecordedOp.Write(fnode=1, length=MAX_WRITE_OP + 1))


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(b"\x66\x33\x93\x36" + (MAX_OP_SIZE + 1).to_bytes(4, "little"), id="frame too long"),
        pytest.param(encode(TOO_LONG, b"x" * (MAX_WRITE_OP + 1)), id="write too long"),
        pytest.param(b"\x66\x33\x93\x36\x03\x00\x00\x00\xff\xff\xff", id="undecodable"),
    ],
)  # fmt: skip
def test_what_cannot_be_an_operation_is_garbage_not_a_wait_or_a_crash(frame: bytes) -> None:
    good = encode(pb.RecordedOp(seq_no=2, author=1, create=pb.RecordedOp.Create(path="a")))
    out = list(OpReader(0).feed(frame + good))
    assert isinstance(out[0], Garbage) and out[0].first_offset == 0
    assert isinstance(out[-1], Decoded) and out[-1].op.create.path == "a"


def test_encode_refuses_a_write_whose_data_is_not_its_length() -> None:
    with pytest.raises(ValueError, match="write of 3 bytes given 2 bytes"):
        encode(pb.RecordedOp(write=pb.RecordedOp.Write(fnode=1, length=3)), b"ab")


def test_the_checksum_covers_the_write_data() -> None:
    payload = pb.RecordedOp(seq_no=1, write=pb.RecordedOp.Write(fnode=1, length=4)).SerializeToString()
    assert checksum(0, payload, b"page") != checksum(0, payload, b"pagf")
    assert checksum(5, payload) != checksum(0, payload)


def test_an_authors_fence_is_a_valid_register_only_it_matches() -> None:
    a, b = new_author(), new_author()
    assert a != b and 0 < a <= 0xFFFFFFFF
    validate.label_set(fence(a))
    registers = labels.union(labels.label_set({"other": "x"}), fence(a))
    assert labels.registers_match(pb.LabelSelector(include=fence(a)), registers)
    assert not labels.registers_match(pb.LabelSelector(include=fence(b)), registers)
    handed_off = labels.union(registers, fence(b))  # (a handoff replaces the author's value)
    assert labels.registers_match(pb.LabelSelector(include=fence(b)), handed_off)
    assert not labels.registers_match(pb.LabelSelector(include=fence(a)), handed_off)
