"""LinePublisher: lines of JSON objects become committed messages once each, in order, and whatever
stops it says exactly which lines were published (DESIGN.md invariant 7)."""

from __future__ import annotations

import pytest

from tidings.client import AppendService
from tidings.message import LinePublisher, Publisher, read_committed
from tidings.protocol.status import TidingsError

NDJSON_LABELS = {"content-type": "application/x-ndjson"}


def _lines(*lines: bytes):
    """`next_line` over `lines`, then None (their end)."""
    it = iter([*lines, None])

    async def next_line() -> bytes | None:
        return next(it)

    return next_line


async def _committed(c, journal: str) -> list[dict]:
    return [env.message async for env in read_committed(c, journal, block=False)]


async def test_lines_become_committed_messages_in_order_and_blank_lines_are_skipped(cluster) -> None:
    await cluster.create_journal("lines/ok", 1, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        lines = LinePublisher(Publisher(AppendService(c)), "lines/ok", max_batch=3)
        await lines.run(_lines(*(b'{"n": %d}\n' % i for i in range(7)), b"  \n", b'{"n": 7}'))
        got = await _committed(c, "lines/ok")
    assert [m["n"] for m in got] == list(range(8)), got
    assert (lines.sent, lines.through, lines.flight, lines.written) == (8, 9, 0, {"lines/ok"})
    assert lines.so_far() == "published 8 messages (stdin lines 1 to 9)"


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (b"not json\n", "stdin line 3 is not a JSON object"),
        (b'{"uuid": "x"}\n', 'stdin line 3 has its own "uuid" field'),
    ],
)
async def test_a_bad_line_stops_after_the_lines_before_it_are_published(cluster, bad: bytes, said: str) -> None:
    await cluster.create_journal("lines/bad", 1, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        lines = LinePublisher(Publisher(AppendService(c)), "lines/bad")
        with pytest.raises(TidingsError) as caught:
            await lines.run(_lines(b'{"n": 1}\n', b'{"n": 2}\n', bad, b'{"n": 4}\n'))
        got = await _committed(c, "lines/bad")
    assert str(caught.value).startswith(said), caught.value
    assert str(caught.value).endswith("the 2 messages before it were published, nothing after it"), caught.value
    assert [m["n"] for m in got] == [1, 2]


async def test_skipped_lines_are_reported_and_the_rest_published(cluster) -> None:
    await cluster.create_journal("lines/skip", 1, labels=NDJSON_LABELS)
    skipped: list[str] = []
    async with cluster.client(0) as c:
        lines = LinePublisher(
            Publisher(AppendService(c)), "lines/skip", key="k", skip_invalid=True, on_skipped=skipped.append
        )
        await lines.run(_lines(b'{"k": 1}\n', b'{"n": 2}\n', b"[]\n", b'{"k": 4}\n'))
        got = await _committed(c, "lines/skip")
    assert [m["k"] for m in got] == [1, 4]
    assert skipped == [
        "stdin line 2 has no 'k' field (--key) to pick its journal by",
        "stdin line 3 is not a JSON object (Expected `object`, got `array`)",
    ], skipped


async def test_a_failed_append_says_which_lines_were_published(cluster) -> None:
    """A batch to two journals, one of them gone: its lines are named as not published, the other's
    as published, and nothing after the batch is read."""
    await cluster.create_journal("lines/kept", 1, labels=NDJSON_LABELS)
    async with cluster.client(0) as c:
        mapping = lambda m: "lines/kept" if m["n"] % 2 else "lines/gone"  # noqa: E731
        lines = LinePublisher(Publisher(AppendService(c)), mapping, flush_interval=5.0)
        with pytest.raises(TidingsError) as caught:
            await lines.run(_lines(b'{"n": 1}\n', b'{"n": 2}\n', b'{"n": 3}\n'))
        got = await _committed(c, "lines/kept")
    said = str(caught.value)
    assert "published 2 messages (no stdin line, and 2 of stdin lines 1 to 3 (those for lines/kept))" in said, said
    assert said.endswith("not published: stdin lines 1 to 3 for lines/gone, and every line after 3"), said
    assert [m["n"] for m in got] == [1, 3]
    assert lines.written == {"lines/kept"} and lines.sent == 0
