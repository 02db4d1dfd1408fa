"""Message iterators: read-uncommitted and read-committed messages of one or more journals.

`read_uncommitted` decodes journal content with each journal's framing (its ``content-type``
label; ``application/x-ndjson`` when it has none) into `Envelope`s: every message as written,
duplicates and pending or rolled-back transactions included (Gazette's ReadUncommittedIter).
`read_committed` passes them through a `Sequencer` and yields each committed message exactly
once, in journal order per producer, never a rolled-back one (DESIGN.md invariant 7; Gazette's
ReadCommittedIter). Its `checkpoint()` may be taken between two messages; a reader built with
that checkpoint resumes without loss or duplicates.

Both iterate asynchronously with an `AsyncClient` (``async for``) and synchronously with a
`Client` (``for``). Several journals are read concurrently, each in order. Bytes that decode to
no message (a bad JSON line, an invalid ``uuid`` value, a broken frame) are reported with their
journal and offsets (counted in `garbage`; passed to `on_garbage`, or logged without one) and skipped. A
blocking iterator tails its journals forever; a non-blocking one ends at their write heads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator
from contextlib import aclosing
from itertools import repeat
from typing import Any
from uuid import UUID

import msgspec

from tidings.client import AsyncClient, Client
from tidings.message.framing import Columns, Garbage, columns_of, get_uuid, uuid_getter
from tidings.message.publisher import journal_framing
from tidings.message.sequencer import DEFAULT_PRODUCER_HORIZON, DEFAULT_RING_SIZE, Checkpoint, Envelope, Sequencer
from tidings.protocol.status import UsageError

__all__ = ["ReadCommitted", "ReadUncommitted", "read_committed", "read_uncommitted"]

log = logging.getLogger(__name__)

GarbageHandler = Callable[[str, Garbage], Any]


class ReadUncommitted:
    """Envelopes of every message of `journals`, as written; see the module docstring.

    **Parameters:**
    * `client` - an AsyncClient (``async for``) or a Client (``for``).
    * `journals` - a journal name or several.
    * `offsets` - where to start per journal (0 for those not named).
    * `message_type` - what messages decode into (dicts for JSON, payload bytes for protobuf by default).
    * `block` - tail the journals (True) or stop at their write heads (False).
    * `on_garbage` - called with (journal, Garbage) for every undecodable range (instead of a warning in the log).
    * `end_offsets` - stop reading a journal named here at this offset (a fixed range, as a Spark
      partition reads: the same messages however far the journal has grown meanwhile). With `block`
      the read waits for every byte below it (a hole a replica may still fill, as Gazette's readers
      wait); without, it stops early at the first byte no broker serves yet.
    * `uuids_of` - the UUIDs of a list of decoded messages (raising ValueError for an invalid one),
      for message types that do not carry theirs as a field: e.g. `msgspec.Raw` lines, whose bodies
      are decoded later, only for the messages delivered.
    * `direct` - read persisted fragments straight from their store (fsspec), not through a broker
      (as a Spark task does, so the executors rather than the brokers move the bytes).
    * `on_jump` - called with (journal, from, to) when a journal has no bytes [from, to) to read
      (removed by retention, say) and the read goes on at `to`; it may raise to stop the read.
    """

    def __init__(
        self,
        client: AsyncClient | Client,
        journals: str | Iterable[str],
        *,
        offsets: dict[str, int] | None = None,
        message_type: Any = None,
        block: bool = True,
        on_garbage: GarbageHandler | None = None,
        end_offsets: dict[str, int] | None = None,
        uuids_of: Callable[[list[Any]], list[UUID | None]] | None = None,
        direct: bool = False,
        on_jump: Callable[[str, int, int], Any] | None = None,
    ) -> None:
        self.client = client
        self.direct = direct
        self.on_jump = on_jump
        self.journals = [journals] if isinstance(journals, str) else list(journals)
        if not self.journals:
            raise UsageError("read at least one journal")
        self.offsets = {j: (offsets or {}).get(j, 0) for j in self.journals}
        self.end_offsets = {j: e for j, e in (end_offsets or {}).items() if e}
        self.uuids_of = uuids_of
        self.message_type = message_type
        self.block = block
        self.on_garbage = on_garbage
        self.garbage = 0

    @property
    def _aio(self) -> AsyncClient:
        return self.client.aio if isinstance(self.client, Client) else self.client

    def __aiter__(self) -> AsyncIterator[Envelope]:
        if isinstance(self.client, Client):
            raise UsageError("iterate with `for` when reading through a sync Client")
        return self._envelopes()

    def __iter__(self) -> Iterator[Envelope]:
        if not isinstance(self.client, Client):
            raise UsageError("iterate with `async for` when reading through an AsyncClient")
        return self.client.iterate(self._envelopes)

    def batches(self) -> Any:
        """The same envelopes, a list at a time (one per content chunk read): less work per message.
        A ReadCommitted counts a whole list as delivered once it is yielded, so take checkpoints
        between lists. An async iterator with an AsyncClient, an iterator with a Client.
        """
        if isinstance(self.client, Client):
            return self.client.iterate(self._envelope_batches)
        return self._envelope_batches()

    async def _envelopes(self) -> AsyncGenerator[Envelope, None]:
        async with aclosing(self._envelope_batches()) as batches:  # (closing us closes the journals' readers)
            async for batch in batches:
                for env in batch:
                    yield env

    def _envelope_batches(self) -> AsyncGenerator[list[Envelope], None]:
        return self._batches()

    async def _batches(self) -> AsyncGenerator[list[Envelope], None]:
        """Batches of envelopes (one per content chunk), from all journals, each journal in order."""
        if len(self.journals) == 1:
            journal = self.journals[0]
            async for batch in self._journal_batches(journal, self.offsets[journal], self.end_offsets.get(journal, 0)):
                yield batch
            return
        queue: asyncio.Queue[list[Envelope] | Exception | None] = asyncio.Queue(maxsize=64)

        async def pump(journal: str) -> None:
            try:
                async for batch in self._journal_batches(
                    journal, self.offsets[journal], self.end_offsets.get(journal, 0)
                ):
                    await queue.put(batch)
                await queue.put(None)
            except asyncio.CancelledError:  # the reader stopped: nobody takes from the queue any more
                raise
            except Exception as exc:
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(j), name=f"read:{j}") for j in self.journals]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _journal_batches(
        self, journal: str, offset: int, end_offset: int = 0, *, replay: bool = False
    ) -> AsyncGenerator[list[Envelope], None]:
        async with aclosing(self._journal_columns(journal, offset, end_offset)) as chunks:
            async for columns in chunks:
                batch = self._envelopes_of(journal, columns, replay)
                if batch:
                    if not replay:  # (a replay re-reads an earlier range: it does not move the reader)
                        self.offsets[journal] = batch[-1].end
                    yield batch

    async def _journal_columns(self, journal: str, offset: int, end_offset: int = 0) -> AsyncGenerator[Columns, None]:
        """Each chunk read, decoded: its messages' offsets and values, and its garbage."""
        decoder = (await journal_framing(self._aio, journal)).decoder(self.message_type, offset)
        on_jump = None if self.on_jump is None else functools.partial(self.on_jump, journal)
        reader = self._aio.reader(
            journal, offset, block=self.block, end_offset=end_offset, direct=self.direct, on_jump=on_jump
        )
        async with aclosing(reader):
            async for chunk in reader:
                yield decoder.feed_columns(chunk.content, chunk.offset)
        yield columns_of(decoder.finish())

    async def columns(self, journal: str) -> AsyncGenerator[Columns, None]:
        """`journal`'s messages as decoded Columns, a chunk at a time (garbage reported): for a caller
        that needs no envelopes, such as a planner that only sums up UUIDs (`Sequencer.advance`)."""
        async with aclosing(
            self._journal_columns(journal, self.offsets[journal], self.end_offsets.get(journal, 0))
        ) as chunks:
            async for columns in chunks:
                for garbage in columns.garbage:
                    self._report(journal, garbage)
                if columns.ends:
                    self.offsets[journal] = columns.ends[-1]
                yield columns

    def _envelopes_of(self, journal: str, columns: Columns, replay: bool = False) -> list[Envelope]:
        """Envelopes of decoded messages, built by C-level maps (per-message work is what limits a reader).
        Garbage is reported once: not again when a replay re-reads it."""
        if not replay:
            for garbage in columns.garbage:
                self._report(journal, garbage)
        values = columns.values
        if not values:
            return []
        if self.message_type is msgspec.Raw:  # views into the chunk: one kept in a Sequencer's ring would pin it
            values = columns.values = list(map(msgspec.Raw.copy, values))
        try:
            uuids = (
                self.uuids_of(values) if self.uuids_of is not None else list(map(uuid_getter(type(values[0])), values))
            )
        except (ValueError, TypeError):  # an invalid uuid somewhere: sort the good from the bad one by one
            return self._envelopes_one_by_one(journal, columns, replay)
        return list(map(Envelope, repeat(journal), columns.begins, columns.ends, uuids, values))

    def _envelopes_one_by_one(self, journal: str, columns: Columns, replay: bool) -> list[Envelope]:
        out = []
        for begin, end, value in zip(columns.begins, columns.ends, columns.values, strict=True):
            try:
                u = self.uuids_of([value])[0] if self.uuids_of is not None else get_uuid(value)
            except (ValueError, TypeError) as exc:
                if not replay:
                    self._report(journal, Garbage(begin, end, f"invalid uuid: {exc}"))
                continue
            out.append(Envelope(journal, begin, end, u, value))
        return out

    def _report(self, journal: str, garbage: Garbage) -> None:
        self.garbage += 1
        if self.on_garbage is not None:
            self.on_garbage(journal, garbage)
        else:
            log.warning("journal %s: skipped undecodable bytes [%d, %d): %s", journal, garbage.begin, garbage.end,
                        garbage.error)  # fmt: skip

    async def read_range(self, journal: str, begin: int, end: int) -> list[Envelope]:
        """Every envelope of `journal` in [begin, end), read again (for a Sequencer replay)."""
        out: list[Envelope] = []
        async for batch in self._journal_batches(journal, begin, end, replay=True):
            out.extend(batch)
        return out


class ReadCommitted(ReadUncommitted):
    """Committed messages of `journals`, each exactly once; see the module docstring.

    **Parameters** (beyond ReadUncommitted's; a checkpoint replaces `offsets`; without one, a read
    starting inside a transaction delivers, at its ACK, only the transaction's messages from there on):
    * `checkpoint` - resume from a `checkpoint()` of an earlier reader.
    * `ring_size` - the Sequencer's ring of pending messages (longer transactions are re-read).
    * `producer_horizon` - how long a quiet producer stays in `checkpoint()`s (see the Sequencer); None: always.
    * `reread_pending` - resume a checkpoint at its producers' first pending offsets (True), or at
      its read-through offsets, re-reading a pending transaction only when its ACK comes (False:
      a transaction that never commits then costs nothing, as in Gazette).
    * `empty_batches` - `batches()` also yields an empty list after a chunk that delivered nothing (a
      rolled-back or duplicate ACK, pending messages), so a caller following `checkpoint()` sees it move.
    """

    def __init__(
        self,
        client: AsyncClient | Client,
        journals: str | Iterable[str],
        *,
        checkpoint: Checkpoint | None = None,
        ring_size: int = DEFAULT_RING_SIZE,
        producer_horizon: float | None = DEFAULT_PRODUCER_HORIZON,
        message_type: Any = None,
        block: bool = True,
        on_garbage: GarbageHandler | None = None,
        offsets: dict[str, int] | None = None,
        end_offsets: dict[str, int] | None = None,
        reread_pending: bool = True,
        uuids_of: Callable[[list[Any]], list[UUID | None]] | None = None,
        direct: bool = False,
        on_jump: Callable[[str, int, int], Any] | None = None,
        empty_batches: bool = False,
    ) -> None:
        names = [journals] if isinstance(journals, str) else list(journals)
        self.empty_batches = empty_batches
        if checkpoint is not None and reread_pending:
            offsets = {j: checkpoint.resume_offset(j) for j in names}
        elif checkpoint is not None:
            offsets = {j: jc.read_through for j, jc in checkpoint.journals.items() if j in names}
        super().__init__(
            client,
            names,
            offsets=offsets,
            message_type=message_type,
            block=block,
            on_garbage=on_garbage,
            end_offsets=end_offsets,
            uuids_of=uuids_of,
            direct=direct,
            on_jump=on_jump,
        )
        self.sequencer = Sequencer(ring_size, producer_horizon=producer_horizon, checkpoint=checkpoint)

    def checkpoint(self) -> Checkpoint:
        """Where this reader stands: a reader built with it yields exactly the messages not yet yielded."""
        return self.sequencer.checkpoint()

    async def _envelopes(self) -> AsyncGenerator[Envelope, None]:
        """One message at a time: each counts as delivered (for `checkpoint()`) once it is yielded."""
        seq = self.sequencer
        async with aclosing(self._batches()) as batches:
            async for batch in batches:
                for env in batch:
                    replay = seq.queue(env)
                    if replay is not None:
                        seq.replay(await self.read_range(replay.journal, replay.begin, replay.end))
                    while (committed := seq.step()) is not None:
                        yield committed

    async def _envelope_batches(self) -> AsyncGenerator[list[Envelope], None]:
        """A list at a time: a whole batch counts as delivered once it is yielded (checkpoint between batches)."""
        seq = self.sequencer
        async with aclosing(self._batches()) as batches:
            async for batch in batches:
                out: list[Envelope] = []
                at = 0
                while at < len(batch):
                    at = seq.sequence(batch, at, out)
                    replay = seq.pending_replay
                    if replay is not None:
                        seq.replay(await self.read_range(replay.journal, replay.begin, replay.end))
                        out.extend(seq.dequeue())
                if out or self.empty_batches:
                    yield out


def read_uncommitted(client: AsyncClient | Client, journals: str | Iterable[str], **options: Any) -> ReadUncommitted:
    """Every message of `journals` as written (see ReadUncommitted for the options)."""
    return ReadUncommitted(client, journals, **options)


def read_committed(client: AsyncClient | Client, journals: str | Iterable[str], **options: Any) -> ReadCommitted:
    """Committed messages of `journals`, each exactly once (see ReadCommitted for the options)."""
    return ReadCommitted(client, journals, **options)
