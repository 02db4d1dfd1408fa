"""The transaction loop of a consumer shard's primary (steps 1-4 of `consumer.shard`'s docstring):
messages read a chunk at a time ahead of the transaction consuming them, a transaction closed by
its durations or a stop, its store commit after every append it made, its ACKs written while the
next one consumes, and the Checkpoint it commits (`checkpoint_to_proto`, `checkpoint_from_proto`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import time
import types
from typing import TYPE_CHECKING, Any

from tidings.consumer.application import Application, Shard, TxnStats
from tidings.consumer.store import Store
from tidings.message import AckIntent, Checkpoint, Envelope, JournalCheckpoint, ProducerState, Publisher
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TidingsError

if TYPE_CHECKING:
    from tidings.client import AppendResult

__all__ = ["OutputFailedError", "Transactions", "called", "checkpoint_from_proto", "checkpoint_to_proto"]

log = logging.getLogger(__name__)


def checkpoint_to_proto(checkpoint: Checkpoint, intents: list[AckIntent]) -> pb.Checkpoint:
    """The Sequencer's checkpoint and the transaction's ACK intents, as the store commits them."""
    out = pb.Checkpoint()
    for journal, jc in checkpoint.journals.items():
        src = out.sources[journal]
        src.read_through = jc.read_through
        for hex_id, state in sorted(jc.producers.items()):
            src.producers.add(
                id=bytes.fromhex(hex_id),
                state=pb.Checkpoint.ProducerState(
                    last_ack=state.last_ack, begin=state.begin, newest=max(state.newest, 0)
                ),
            )
    for intent in intents:
        out.ack_intents[intent.journal] = intent.content
    return out


def checkpoint_from_proto(cp: pb.Checkpoint) -> tuple[Checkpoint, list[AckIntent]]:
    journals = {
        journal: JournalCheckpoint(
            src.read_through,
            {p.id.hex(): ProducerState(p.state.last_ack, p.state.begin, p.state.newest or -1) for p in src.producers},
        )
        for journal, src in cp.sources.items()
    }
    return Checkpoint(journals), [AckIntent(j, c) for j, c in sorted(cp.ack_intents.items())]


@dataclasses.dataclass(slots=True)
class _Read:
    """A chunk's committed messages and the reader's checkpoint right after them."""

    envelopes: list[Envelope]
    checkpoint: Checkpoint
    generation: int  # this chunk's number (the Sequencer's generation while it was sequenced)
    pending: int  # the newest generation with a source transaction awaiting its ACK (-1: none)


_COROUTINE = types.CoroutineType


READ_AHEAD = 8  # chunks read ahead of the transaction consuming them


# consume_message rarely waits (appends are queued), so a chunk of messages could hold the event loop
# for seconds: every YIELD_EVERY messages, if TURN seconds passed, the loop gets a turn.
YIELD_EVERY, TURN = 64, 0.02


class OutputFailedError(TidingsError):
    """An append of the shard's transaction to an output journal failed for good: the transaction
    does not commit (or, for its ACKs, its downstream messages are not acknowledged)."""

    def __init__(self, shard: str, journal: str, cause: BaseException) -> None:
        super().__init__(f"shard {shard!r}: writing to its output journal {journal!r} failed, so its transaction "
                         f"does not commit: {cause}")  # fmt: skip
        self.journal, self.cause = journal, cause


class Transactions:
    """One primary's transaction loop (steps 1-4 of the module docstring)."""

    def __init__(
        self, shard: Shard, app: Application, store: Store, publisher: Publisher, reader: Any, stop: asyncio.Event
    ):
        self.shard, self.app, self.store, self.publisher, self.reader, self.stop = (
            shard, app, store, publisher, reader, stop
        )  # fmt: skip
        spec = shard.spec
        self.min_dur, self.max_dur = spec.min_txn_duration_ms / 1000, spec.max_txn_duration_ms / 1000
        self.wait_for_ack = not spec.disable_wait_for_ack
        self.reads: asyncio.Queue[_Read | BaseException] = asyncio.Queue(READ_AHEAD)
        # A get from `reads`: never cancelled mid-transaction.
        self.upcoming: asyncio.Task[_Read | BaseException] | None = None
        self.acks: asyncio.Future[list[AppendResult]] | None = None  # the last transaction's ACK appends
        self.idle: Checkpoint | None = None  # progress read outside a transaction, reported after `acks`
        self.closed_at = -1  # generation of the last chunk the last transaction consumed (Gazette's ClearPending)

    async def run(self) -> None:
        """Transactions until `stop`: the open one closes at its next chunk and commits, nothing more is
        consumed (what was read ahead is not: the checkpoint says where the next primary starts), and
        its ACKs are written."""
        pump = asyncio.ensure_future(self._pump())
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            while not self.stop.is_set():
                read = self._ready()
                if read is None:
                    await asyncio.wait(self._waits(stopped), return_when=asyncio.FIRST_COMPLETED)
                    self._check_acks()
                    continue
                if not read.envelopes:  # nothing to consume: only the read-through offsets moved
                    self._progress(read.checkpoint)
                    continue
                await self._transaction(read, stopped)
            if self.acks is not None:  # a graceful stop: the last transaction's ACKs go out
                await asyncio.wait([self.acks])
                self._check_acks()
            if self.publisher.in_transaction:
                log.warning("shard %s: stops with messages published uncommitted after its last transaction (from "
                            "finished_txn?): no transaction commits them, so read-committed readers never see them",
                            self.shard.spec.id)  # fmt: skip
        finally:
            stopped.cancel()
            pump.cancel()
            if self.upcoming is not None:
                self.upcoming.cancel()
            await asyncio.wait([pump])

    def _check_acks(self) -> None:
        """Raise the last transaction's ACKs' failure, naming the output journal, if they failed."""
        if self.acks is None or not self.acks.done():
            return
        err = self.acks.exception()
        if err is not None:
            raise OutputFailedError(self.shard.spec.id, getattr(err, "journal", "") or "?", err) from err

    async def _pump(self) -> None:
        """Read chunks and snapshot the checkpoint after each (nothing else runs between the two)."""
        reader = self.reader
        seq = reader.sequencer
        try:
            async with contextlib.aclosing(reader.batches()) as batches:
                async for envelopes in batches:
                    read = _Read(envelopes, reader.checkpoint(), seq.generation, seq.pending_generation())
                    seq.generation += 1
                    await self.reads.put(read)
        except Exception as exc:  # the transaction loop raises it
            await self.reads.put(exc)

    def _ready(self) -> _Read | None:
        """The next read if one is here (raising the reader's failure), without waiting."""
        if self.upcoming is not None:
            if not self.upcoming.done():
                return None
            item, self.upcoming = self.upcoming.result(), None
        else:
            try:
                item = self.reads.get_nowait()
            except asyncio.QueueEmpty:
                return None
        if isinstance(item, BaseException):
            raise item
        return item

    def _waits(self, stopped: asyncio.Future[Any]) -> list[asyncio.Future[Any]]:
        """What a wait for the next chunk also wakes for: the stop, and the last transaction's ACKs
        (written: the transaction may close; failed: the shard fails, idle or not)."""
        self.upcoming = self.upcoming or asyncio.ensure_future(self.reads.get())
        waits: list[asyncio.Future[Any]] = [self.upcoming, stopped]
        if self.acks is not None and not self.acks.done():
            waits.append(self.acks)
        return waits

    def _progress(self, checkpoint: Checkpoint) -> None:
        if self.acks is None or self.acks.done():
            self.shard.advance(checkpoint)
        else:
            self.idle = checkpoint

    async def _transaction(self, read: _Read, stopped: asyncio.Future[Any]) -> None:
        shard, app, store, publisher = self.shard, self.app, self.store, self.publisher
        began = time.monotonic()
        if hasattr(store, "begin"):
            await store.begin()  # (its locks are waited for off the event loop)
        await called(app.begin_txn(shard, store))
        consumed = 0
        last: _Read | None = read
        turn = time.monotonic()
        consume = app.consume_message
        while last is not None:
            read = last
            for i, env in enumerate(read.envelopes):
                done = consume(shard, store, env, publisher)
                if done is not None and (type(done) is _COROUTINE or inspect.isawaitable(done)):
                    await done  # (an async hook's coroutine, or whatever awaitable a wrapper gave back)
                if not i % YIELD_EVERY and time.monotonic() - turn > TURN:
                    await asyncio.sleep(0)  # let the process's other work in (its etcd lease, other shards)
                    turn = time.monotonic()
            consumed += len(read.envelopes)
            last = await self._next_read(began, read, stopped)
        # `read` is the last chunk consumed: its checkpoint is where this transaction stands.
        self.closed_at = read.generation
        closed = time.monotonic()
        await called(app.finalize_txn(shard, store, publisher))
        intents = publisher.build_ack_intents()
        if self.acks is not None:
            await asyncio.wait([self.acks])  # (N's ACKs must be written before N+1's checkpoint replaces N's intents)
            self._check_acks()
        # The commit waits for every append queued so far, whichever API queued it (Gazette's
        # PendingExcept): nothing this transaction wrote can be overtaken by its checkpoint.
        appended = asyncio.ensure_future(self._appended(publisher.service.pending()))
        commit = asyncio.ensure_future(
            store.start_commit(shard.spec.id, checkpoint_to_proto(read.checkpoint, intents), [appended])
        )
        try:
            await called(app.finished_txn(shard, store, commit))
            await commit
        except BaseException:
            while not commit.done():  # never leave a commit running under the store's close
                commit.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([commit])
            raise
        finally:
            if not appended.done():
                appended.cancel()
            elif not appended.cancelled():
                appended.exception()  # (retrieved: the store raised it, or failed before waiting for it)
        committed = time.monotonic()
        self.acks = acks = await publisher.write_ack_intents(intents)
        stats = TxnStats(consumed, closed - began, committed - closed)
        acks.add_done_callback(functools.partial(self._acked, read.checkpoint, stats, committed))

    async def _appended(self, pending: dict[str, asyncio.Future[None]]) -> None:
        """Wait for the appends of `pending` (AppendService.pending), raising a failure naming its journal."""
        for journal, fut in pending.items():
            try:
                await fut
            except TidingsError as exc:
                raise OutputFailedError(self.shard.spec.id, journal, exc) from exc

    async def _next_read(self, began: float, last: _Read, stopped: asyncio.Future[Any]) -> _Read | None:
        """The next chunk for this transaction, or None to close it (step 2 of the module docstring)."""
        while True:
            elapsed = time.monotonic() - began
            if elapsed >= self.max_dur or self.stop.is_set():
                return None
            read = self._ready()
            if read is not None:
                return read
            acked = self.acks is None or self.acks.done()
            pending = self.wait_for_ack and last.pending > self.closed_at  # (begun or extended in this one)
            if elapsed >= self.min_dur and acked and not pending:
                await asyncio.sleep(0)  # (one more turn for a chunk already on its way)
                read = self._ready()
                return read
            until = self.min_dur if elapsed < self.min_dur else self.max_dur
            await asyncio.wait(self._waits(stopped), timeout=until - elapsed, return_when=asyncio.FIRST_COMPLETED)

    def _acked(
        self, checkpoint: Checkpoint, stats: TxnStats, committed: float, acks: asyncio.Future[list[AppendResult]]
    ) -> None:
        if acks.cancelled() or acks.exception() is not None:
            return  # (the next transaction's commit, or the stop, raises it)
        stats.acknowledging = time.monotonic() - committed
        self.shard.advance(checkpoint if self.idle is None else self.idle, stats)
        self.idle = None


async def called(result: Any) -> None:
    """An application hook's result, awaited if it is a coroutine (hooks may be plain functions)."""
    if inspect.isawaitable(result):
        await result
