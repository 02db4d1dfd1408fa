"""Lines of JSON objects published as committed messages as they come (what `tidings publish` runs).

A batch is the lines that came within `flush_interval` of its first one (at most `max_batch`),
published as one append per journal the mapping picks (each all or nothing) and committed before
the next batch is read, so a line never waits longer than that. Every message gets its UUID from the
Publisher: a line with its own "uuid" field is refused. When something fails, the error says exactly
which lines' messages were published, which were not, and (interrupted while a batch was out) which
may have been; `so_far()` says the same at any moment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from tidings.message.publisher import Mapping, Publisher
from tidings.protocol.status import TidingsError

__all__ = ["LinePublisher", "line_span"]

MAX_BATCH = 1000  # lines in one batch at most


def line_span(first: int, last: int, source: str = "stdin") -> str:
    """'stdin line 3', 'stdin lines 1 to 5', or 'no stdin line' for an empty span."""
    if last < first:
        return f"no {source} line"
    return f"{source} line {first}" if first == last else f"{source} lines {first} to {last}"


def _messages(n: int) -> str:
    return f"{n} message{'' if n == 1 else 's'}"


class LinePublisher:
    """Publishes lines through `publisher` to the journal `mapping` names (or picks per message).

    `key`: a field every message must have (the mapping picks its journal by it); `skip_invalid`:
    report a bad line to `on_skipped` and go on, instead of stopping at it; `source` names where
    lines come from in what it says ("stdin line 3")."""

    def __init__(
        self,
        publisher: Publisher,
        mapping: Mapping | str,
        *,
        key: str = "",
        skip_invalid: bool = False,
        flush_interval: float = 0.05,
        on_skipped: Callable[[str], None] | None = None,
        source: str = "stdin",
        max_batch: int = MAX_BATCH,
    ) -> None:
        self.publisher, self.mapping, self.key, self.source = publisher, mapping, key, source
        self.skip_invalid, self.flush_interval, self.max_batch = skip_invalid, flush_interval, max_batch
        self.on_skipped = on_skipped or (lambda _said: None)
        self.sent = 0  # messages published
        self.through = 0  # the last line they reach
        self.flight = 0  # while a batch's appends are out: its last line (they may commit yet)
        self.written: set[str] = set()  # journals that got messages
        self._decode = msgspec.json.Decoder(dict).decode

    def so_far(self) -> str:
        """What is published, e.g. 'published 3 messages (stdin lines 1 to 4)'."""
        said = f"published {_messages(self.sent)} ({self._span(1, self.through)})"
        if self.flight:
            said += f"; {self._span(self.through + 1, self.flight)} were being published and may have been"
        return said

    async def run(self, next_line: Callable[[], Awaitable[bytes | None]]) -> None:
        """Publish every line `next_line()` gives until it gives None. A bad line (no JSON object, its
        own "uuid", no `key` field) stops it unless `skip_invalid`: a TidingsError naming the line,
        after the lines before it are published. A failed append: a TidingsError saying which
        lines' messages were published and which not."""
        lineno, more, bad = 0, True, ""
        while more and not bad:
            batch: list[dict[str, Any]] = []
            deadline: float | None = None
            while len(batch) < self.max_batch:
                timeout: float | None = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    line = await asyncio.wait_for(next_line(), timeout)
                except TimeoutError:
                    break
                if line is None:
                    more = False
                    break
                lineno += 1
                if not line.strip():
                    continue
                try:
                    batch.append(self._message(lineno, line))
                except ValueError as exc:
                    if not self.skip_invalid:
                        bad = str(exc)
                        break
                    self.on_skipped(str(exc))
                deadline = deadline or time.monotonic() + self.flush_interval
            if batch:  # (committed before the next batch is read: a line is never held longer)
                last = lineno - bool(bad)
                self.flight = last
                self.sent += await self._publish(batch, self.through + 1, last)
                self.through, self.flight = last, 0
        if bad:
            n = self.sent
            before = f"the {_messages(n)} before it were" if n != 1 else "the message before it was"
            raise TidingsError(f"{bad}; {before} published, nothing after it")

    def _message(self, lineno: int, line: bytes) -> dict[str, Any]:
        """A line's message, or ValueError saying what is wrong with it."""
        where = f"{self.source} line {lineno}"
        try:
            msg = self._decode(line)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{where} is not a JSON object ({exc})") from None
        if "uuid" in msg:
            raise ValueError(f'{where} has its own "uuid" field: the publisher sets it; rename the field')
        if self.key and self.key not in msg:
            raise ValueError(f"{where} has no {self.key!r} field (--key) to pick its journal by")
        return msg

    async def _publish(self, batch: list[dict[str, Any]], first: int, last: int) -> int:
        """Publish a batch, an append per journal (each all or nothing); on a failure, say exactly
        which journals' messages of lines `first`..`last` were published."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for msg in batch:
            name = self.mapping if isinstance(self.mapping, str) else self.mapping(msg)
            groups.setdefault(name, []).append(msg)
        pending: dict[str, Awaitable[object]] = {}
        failed: dict[str, BaseException] = {}
        for name, msgs in groups.items():
            try:  # (a journal refused at once, e.g. gone: the others' appends are out already)
                pending[name] = await self.publisher.publish_committed(name, *msgs)
            except TidingsError as refused:
                failed[name] = refused
        outcomes = await asyncio.gather(*pending.values(), return_exceptions=True)
        failed |= {n: o for n, o in zip(pending, outcomes, strict=True) if isinstance(o, BaseException)}
        ok = [n for n in groups if n not in failed]
        self.written.update(ok)
        if not failed:
            return len(batch)
        first_failure = next(iter(failed.values()))
        if not isinstance(first_failure, TidingsError):
            raise first_failure
        of_ok = sum(len(groups[n]) for n in ok)
        span = self._span(first, last)
        partly = f", and {of_ok} of {span} (those for {', '.join(ok)})" if ok else ""
        raise TidingsError(
            f"{first_failure}; published {_messages(self.sent + of_ok)} ({self._span(1, first - 1)}{partly}); "
            f"not published: {span} for {', '.join(failed)}, and every line after {last}"
        )

    def _span(self, first: int, last: int) -> str:
        return line_span(first, last, self.source)
