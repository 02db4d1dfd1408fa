"""Recorded operations on the wire, and the author fence.

Each operation is a protobuf RecordedOp in Gazette's fixed framing (the magic word, a little-endian
u32 length, the message); a Write's `length` raw bytes follow its frame, so file content is never
re-encoded. The log is not a message journal (content follows frames), so it has its own reader:
`OpReader` is fed the log's chunks as they are read and gives back whole operations with their
exact offsets; bytes that are not a frame (a torn write, another format) are reported as garbage
and skipped to the next magic word, as Gazette's player resynchronises.

The checksum chain covers each operation's message and its write data (Gazette's covers the
message only): after an operation whose data was corrupted, the next one no longer matches the
chain, so playback stops following that history (the corrupt op itself was already played: a
per-op checksum of the data alone would refuse it first).
"""

from __future__ import annotations

import dataclasses
import secrets
import struct
import zlib
from collections.abc import Generator

from google.protobuf.message import DecodeError

from tidings.message.framing import FIXED_FRAME_HEADER_LENGTH, FIXED_FRAME_WORD
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb

__all__ = [
    "AUTHOR_REGISTER",
    "MAX_OP_SIZE",
    "MAX_WRITE_OP",
    "Decoded",
    "Garbage",
    "OpReader",
    "checksum",
    "encode",
    "fence",
    "frame",
    "new_author",
]

MAX_WRITE_OP = 1 << 20  # bytes of file data one Write op carries at most (larger writes are split)
MAX_OP_SIZE = 1 << 16  # bytes of an op's message at most (paths are short): a larger length is garbage
AUTHOR_REGISTER = "author"

_LENGTH = struct.Struct("<I")


def new_author() -> int:
    """A recorder's random, non-zero author id."""
    return secrets.randbelow(0xFFFFFFFF) + 1


def fence(author: int) -> pb.LabelSet:
    """The log's register that `author` holds while it records (set by its handoff, checked by every append)."""
    return labels.label_set({AUTHOR_REGISTER: f"{author:08x}"})


def encode(op: pb.RecordedOp, data: bytes | memoryview = b"") -> bytes:
    """The op's frame, followed by a Write's data (its `length` bytes)."""
    if op.HasField("write") and op.write.length != len(data):
        raise ValueError(f"write of {op.write.length} bytes given {len(data)} bytes of data")
    return frame(op.SerializeToString(), data)


def frame(payload: bytes, data: bytes | memoryview = b"") -> bytes:
    """An op's frame from its serialized message (`payload`), followed by a Write's data."""
    return b"".join((FIXED_FRAME_WORD, _LENGTH.pack(len(payload)), payload, data))


def checksum(previous: int, payload: bytes | memoryview, data: bytes | memoryview = b"") -> int:
    """The checksum after an op: crc32 chained over its message bytes and its write data."""
    return zlib.crc32(data, zlib.crc32(payload, previous))


@dataclasses.dataclass(slots=True)
class Decoded:
    """An operation read from the log at [first_offset, last_offset), with its message bytes and data."""

    op: pb.RecordedOp
    payload: bytes
    data: bytes
    first_offset: int
    last_offset: int


@dataclasses.dataclass(slots=True)
class Garbage:
    """Log bytes at [first_offset, last_offset) that are no operation."""

    first_offset: int
    last_offset: int
    reason: str


class OpReader:
    """Whole operations out of log chunks fed in order (`feed`), with their offsets. A partial
    operation at the end of the chunks fed so far is kept until the rest comes (`pending` bytes)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset  # the log offset of self._buf[0]: the end of the last whole op given back
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, chunk: bytes | memoryview) -> Generator[Decoded | Garbage, None, None]:
        self._buf += chunk
        buf = self._buf
        pos = 0
        try:
            while True:
                found = self._next(buf, pos)
                if found is None:
                    return
                item, pos = found
                yield item
        finally:
            del buf[:pos]
            self.offset += pos

    def _next(self, buf: bytearray, pos: int) -> tuple[Decoded | Garbage, int] | None:
        """The next op or garbage run at `pos`, and where it ends; None if more bytes are needed."""
        head = FIXED_FRAME_HEADER_LENGTH
        if len(buf) - pos < head:
            return None
        if buf[pos : pos + 4] != FIXED_FRAME_WORD:
            return self._garbage(buf, pos, "no frame's magic word")
        (size,) = _LENGTH.unpack_from(buf, pos + 4)
        if size > MAX_OP_SIZE:
            return self._garbage(buf, pos, f"a frame of {size} bytes (at most {MAX_OP_SIZE})")
        if len(buf) - pos < head + size:
            return None
        with memoryview(buf) as view:  # (one copy out of the buffer, not a slice and then a copy)
            payload = bytes(view[pos + head : pos + head + size])
        op = pb.RecordedOp()
        try:
            op.ParseFromString(payload)
        except DecodeError as exc:
            return self._garbage(buf, pos, f"undecodable operation ({exc})")
        end = pos + head + size
        length = op.write.length if op.HasField("write") else 0
        if not 0 <= length <= MAX_WRITE_OP:
            return self._garbage(buf, pos, f"a write of {length} bytes (at most {MAX_WRITE_OP})")
        if len(buf) - end < length:
            return None
        with memoryview(buf) as view:
            data = bytes(view[end : end + length])
        base = self.offset
        return Decoded(op, payload, data, base + pos, base + end + length), end + length

    def _garbage(self, buf: bytearray, pos: int, reason: str) -> tuple[Garbage, int] | None:
        """Garbage from `pos` to the next magic word (None while none may follow yet within the buffer)."""
        nxt = buf.find(FIXED_FRAME_WORD, pos + 1)
        if nxt < 0:
            keep = len(FIXED_FRAME_WORD) - 1  # (the word may start in the last bytes: wait for more)
            nxt = max(pos + 1, len(buf) - keep)
        base = self.offset
        return Garbage(base + pos, base + nxt, reason), nxt
