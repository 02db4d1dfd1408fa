"""Review 30: uuid_strs' cache of UUID tails must not change what producers it accepts."""

from __future__ import annotations

from tidings.message.uuid import build_uuid, uuid_strs


def test_uuid_strs_accepts_any_producer_build_uuid_accepts() -> None:
    producer = bytearray(b"\x01\x02\x03\x04\x05\x06")  # build_uuid takes it; the lru_cache key cannot be
    assert uuid_strs(producer, range(5, 7), 0) == [str(build_uuid(producer, c, 0)) for c in range(5, 7)]


def test_uuid_strs_is_keyed_by_producer_and_flags() -> None:
    a, b = b"\x01" * 6, b"\x03" * 6
    for producer in (a, b, a):
        for flags in (0, 1, 2, 0):
            want = [str(build_uuid(producer, c, flags)) for c in range(16, 40)]
            assert uuid_strs(producer, range(16, 40), flags) == want
