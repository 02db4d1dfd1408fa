"""Message UUIDs: bit layout against Python's uuid module, monotonic clocks, flags, rejection of foreign UUIDs.

Invariant 7 (DESIGN.md) rests on these: a reader de-duplicates by (ProducerID, Clock), so both must round-trip
exactly and clocks must never repeat or go backwards.
"""

from __future__ import annotations

import threading
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tidings.message
from tidings.message import uuid as muuid
from tidings.message.uuid import (
    ACK_TXN,
    CONTINUE_TXN,
    OUTSIDE_TXN,
    Clock,
    Flags,
    build_uuid,
    clock_from_unix_ns,
    get_clock,
    get_flags,
    get_producer_id,
    new_clock,
    new_producer_id,
    parse,
    unix_ns_from_clock,
    uuid_from_str,
    uuid_strs,
    uuid_to_str,
)

producers = st.binary(min_size=6, max_size=6)
clocks = st.integers(min_value=0, max_value=(1 << 64) - 1)
flag_values = st.integers(min_value=0, max_value=0x3FF)


def test_flag_values_are_gazettes() -> None:
    assert (OUTSIDE_TXN, CONTINUE_TXN, ACK_TXN) == (0, 1, 2)
    assert Flags.ACK_TXN.name == "ACK_TXN"


@settings(max_examples=300)
@given(producer=producers, clock=clocks, flags=flag_values)
def test_bit_layout_matches_python_uuid_v1_fields(producer: bytes, clock: int, flags: int) -> None:
    """Python's uuid module reads our fields where RFC 4122 puts them: time, clock_seq (+flags), node."""
    u = build_uuid(producer, clock, flags)
    assert u.version == 1
    assert u.variant == uuid.RFC_4122
    assert u.node == int.from_bytes(producer, "big")
    assert u.time == clock >> 4
    assert u.clock_seq == ((clock & 0xF) << 10) | flags
    # Building through the stdlib's own constructor gives the same UUID.
    t = clock >> 4
    expect = uuid.UUID(
        fields=(
            t & 0xFFFFFFFF,
            (t >> 32) & 0xFFFF,
            ((t >> 48) & 0x0FFF) | 0x1000,
            0x80 | ((clock & 0xF) << 2) | (flags >> 8),
            flags & 0xFF,
            int.from_bytes(producer, "big"),
        )
    )
    assert u == expect
    assert uuid.UUID(str(u)) == u and uuid.UUID(bytes=u.bytes) == u
    assert u.bytes[10:] == producer


@settings(max_examples=300)
@given(producer=producers, clock=clocks, flags=flag_values)
def test_parse_round_trips_producer_clock_and_flags(producer: bytes, clock: int, flags: int) -> None:
    u = build_uuid(producer, clock, flags)
    assert parse(u) == (producer, clock, flags)
    assert parse(str(u)) == (producer, clock, flags)
    assert (get_producer_id(u), get_clock(u), get_flags(u)) == (producer, clock, flags)


def test_gazette_fixture_clock_time_and_flags() -> None:
    """Gazette's TestUUIDBuilding: 2019-09-01T02:23:41.981273734Z, two ticks, flags 0b1010101010."""
    producer = new_producer_id()
    clock = new_clock(1567304621 * 10**9 + 981273734)
    clock.tick()
    clock.tick()
    u = build_uuid(producer, clock.value, 682)
    assert parse(u) == (producer, clock.value, 682)
    # uuid.UUID.time is in 100 ns since 1582-10-15; two ticks only moved the sequence bits.
    assert u.time * 100 - muuid.G1582_NS100 * 100 == 1567304621 * 10**9 + 981273700
    assert get_clock(u) & 0xF == 2


def test_clock_ordering_matches_uuid_ordering_per_producer() -> None:
    """Clocks of one producer order the same way as their timestamps then sequence bits."""
    producer = new_producer_id()
    clock = new_clock(1_700_000_000 * 10**9)
    minted = [clock.tick() for _ in range(40)]  # crosses several 16-tick timestamp boundaries
    parsed = [parse(build_uuid(producer, c, CONTINUE_TXN))[1] for c in minted]
    assert parsed == minted == sorted(set(minted))
    assert [(u.time, u.clock_seq >> 10) for u in (build_uuid(producer, c, 0) for c in minted)] == sorted(
        (c >> 4, c & 0xF) for c in minted
    )


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(uuid.UUID(int=0), id="nil"),
        pytest.param(uuid.uuid4(), id="version-4"),
        pytest.param(uuid.uuid3(uuid.NAMESPACE_DNS, "tidings"), id="version-3"),
        pytest.param(uuid.UUID(int=build_uuid(b"\x01" * 6, 99, 0).int & ~(0xC000 << 48)), id="ncs-variant"),
        pytest.param(
            uuid.UUID(int=(build_uuid(b"\x01" * 6, 99, 0).int & ~(0xC000 << 48)) | (0xC000 << 48)),
            id="microsoft-variant",
        ),
    ],
)
def test_parse_rejects_uuids_that_are_not_v1_rfc4122(bad: uuid.UUID) -> None:
    with pytest.raises(ValueError, match="not a message UUID: need version 1"):
        parse(bad)


def test_python_uuid1_parses_as_a_message_uuid() -> None:
    """A stdlib v1 UUID is well-formed for us: its clock_seq bits become sequence + flags."""
    u = uuid.uuid1()
    producer, clock, flags = parse(u)
    assert clock >> 4 == u.time and flags == u.clock_seq & 0x3FF and producer == u.node.to_bytes(6, "big")


@pytest.mark.parametrize(
    ("producer", "clock", "flags", "match"),
    [
        pytest.param(b"\x01" * 6, 1, 0x400, "10 bits", id="flags-11-bits"),
        pytest.param(b"\x01" * 6, 1, -1, "10 bits", id="flags-negative"),
        pytest.param(b"\x01" * 6, 1 << 64, 0, "64-bit", id="clock-65-bits"),
        pytest.param(b"\x01" * 6, -1, 0, "64-bit", id="clock-negative"),
        pytest.param(b"\x01" * 5, 1, 0, "6 bytes", id="producer-short"),
        pytest.param(b"\x01" * 7, 1, 0, "6 bytes", id="producer-long"),
    ],
)
def test_build_uuid_rejects_out_of_range_fields(producer: bytes, clock: int, flags: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_uuid(producer, clock, flags)


def test_new_producer_ids_are_random_six_bytes_with_the_multicast_bit() -> None:
    ids = {new_producer_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(p) == 6 and p[0] & 0x01 for p in ids)


def test_clock_ticks_are_strictly_monotonic_and_start_at_gazettes_values() -> None:
    clock = Clock()
    assert [clock.tick(), clock.tick()] == [1, 2]
    assert list(clock.reserve(3)) == [3, 4, 5]
    assert clock.value == 5
    assert list(clock.reserve(0)) == []


def test_clock_update_never_moves_backwards_and_resets_sequence_bits() -> None:
    """Gazette's TestUUIDClock, with this package's one-per-tick sequence bits."""
    clock = new_clock(12 * 10**9 + 300)
    assert clock.value == new_clock(12 * 10**9 + 399).value  # precision is 100 ns
    assert clock.value == clock_from_unix_ns(12 * 10**9 + 300)
    assert unix_ns_from_clock(clock.value) == 12 * 10**9 + 300
    assert new_clock(12 * 10**9 + 299).value < clock.value < new_clock(12 * 10**9 + 400).value

    before = clock.value
    clock.update(11 * 10**9)  # wall time stepped back: ignored
    assert clock.value == before
    for _ in range(20):  # ticking faster than 16 per 100 ns runs ahead of wall time...
        clock.tick()
    ahead = clock.value
    clock.update(12 * 10**9 + 300)  # ...and a wall time behind it is ignored, too
    assert clock.value == ahead
    clock.update(12 * 10**9 + 5000)  # a later wall time resets the sequence bits
    assert clock.value == new_clock(12 * 10**9 + 5000).value and clock.value & 0xF == 0
    assert clock.tick() == clock.value == new_clock(12 * 10**9 + 5000).value + 1


def test_clock_now_is_current_wall_time() -> None:
    import time

    before = time.time_ns()
    clock = new_clock()
    after = time.time_ns()
    assert before - 100 <= unix_ns_from_clock(clock.value) <= after


def test_clock_ticks_are_unique_across_threads() -> None:
    clock = new_clock()
    seen: list[list[int]] = []

    def mint() -> None:
        mine = [clock.tick() for _ in range(5000)]
        mine.extend(clock.reserve(100))
        seen.append(mine)

    threads = [threading.Thread(target=mint) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [c for mine in seen for c in mine]
    assert len(set(flat)) == len(flat) == 4 * 5100
    assert all(mine == sorted(mine) for mine in seen)


def test_clock_rejects_values_outside_64_bits() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        Clock(1 << 64)


@pytest.mark.parametrize("module", [tidings.message, muuid], ids=lambda m: m.__name__)
def test_exported_members_are_sorted_and_exist(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]
    assert names == sorted(names)
    assert all(hasattr(module, n) for n in names)


def test_package_exports_every_public_name_of_its_modules() -> None:
    from tidings.message import framing, iterators, lines, publisher, sequencer

    modules = (muuid, framing, sequencer, publisher, iterators, lines)
    assert set(tidings.message.__all__) == set().union(*(m.__all__ for m in modules))


@given(st.integers(0, (1 << 128) - 1))
def test_fast_uuid_string_forms_match_the_standard_library(n: int) -> None:
    u = uuid.UUID(int=n)
    assert uuid_to_str(u) == str(u)
    for form in (str(u), str(u).upper(), u.hex, "{" + str(u) + "}", "urn:uuid:" + str(u)):
        parsed = uuid_from_str(form)
        assert parsed == u and parsed.int == n and isinstance(parsed, uuid.UUID)


@pytest.mark.parametrize("bad", ["", "not-a-uuid", "zz345678-1234-1234-1234-123456789012", "1234"])
def test_fast_uuid_parse_rejects_what_the_standard_library_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        uuid_from_str(bad)


@given(
    producer=st.binary(min_size=6, max_size=6),
    first=st.integers(min_value=0, max_value=(1 << 64) - 40),
    count=st.integers(min_value=0, max_value=40),
    flags=st.integers(min_value=0, max_value=0x3FF),
)
def test_the_batch_strings_are_the_uuids_strings(producer: bytes, first: int, count: int, flags: int) -> None:
    clocks = range(first, first + count)
    assert muuid.uuid_strs(producer, clocks, flags) == [str(muuid.build_uuid(producer, c, flags)) for c in clocks]


def test_the_batch_strings_refuse_what_build_uuid_refuses() -> None:
    for producer, clocks, flags in [
        (b"12345", range(1, 3), 0),
        (b"123456", range(1, 3), 0x400),
        (b"123456", range((1 << 64) - 1, (1 << 64) + 1), 0),
    ]:
        with pytest.raises(ValueError):
            muuid.uuid_strs(producer, clocks, flags)


def test_uuid_strs_accepts_any_producer_build_uuid_accepts() -> None:
    """uuid_strs' cache of UUID tails does not change what producers it accepts."""
    producer = bytearray(b"\x01\x02\x03\x04\x05\x06")  # build_uuid takes it; the lru_cache key cannot be
    assert uuid_strs(producer, range(5, 7), 0) == [str(build_uuid(producer, c, 0)) for c in range(5, 7)]


def test_uuid_strs_is_keyed_by_producer_and_flags() -> None:
    """uuid_strs' cache of UUID tails never answers one producer's or flags' strings for another's."""
    a, b = b"\x01" * 6, b"\x03" * 6
    for producer in (a, b, a):
        for flags in (0, 1, 2, 0):
            want = [str(build_uuid(producer, c, flags)) for c in range(16, 40)]
            assert uuid_strs(producer, range(16, 40), flags) == want
