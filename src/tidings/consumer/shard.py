"""Shard: a consumer shard's primary, running transactions as the seed's "Consumer Shard Transaction
Lifecycle" (gazette-exactly-once.txt): every input message's effects on the store and on
downstream journals commit exactly once, whatever crashes.

On becoming primary (`serve_primary`): restore the Checkpoint from the store (which fences off a
previous primary, see `store`), re-write the ACK intents it holds (the previous primary may have
died between committing the checkpoint and writing its ACKs; an intent naming a journal deleted
since is discarded with a warning, as in Gazette), then read the sources committed from the
checkpoint's read-through offsets (`read_committed`; a source transaction pending there is re-read
when its ACK comes, so a producer that never acknowledges pins nothing) and run transactions:

1. begin with the first message read (`begin_txn`), consume messages (`consume_message`, which
   changes the store in its open transaction and publishes downstream messages uncommitted);
2. close once `max_txn_duration` passed, or once `min_txn_duration` passed and no message is
   ready (input stalls), unless a source transaction begun in this one awaits its ACK (then wait
   for it, up to `max_txn_duration`; `disable_wait_for_ack` turns that off) or the previous
   transaction's ACKs are still being written (keep consuming meanwhile); then `finalize_txn`;
3. build the ACK intents that commit this transaction's downstream messages, and commit the
   store's transaction with the Checkpoint (read-through offsets, producer states, those ACK
   intents), after every append queued on the shard's AppendService has committed (Gazette's
   `PendingExcept`): whatever made it (the hook's `publisher` or `shard.publisher`, committed or
   uncommitted, from any hook), and the previous transaction's ACKs. A definite failure of one of
   them (a deleted journal, say) fails the transaction instead (`OutputFailedError`, naming the
   journal). `finished_txn` gets the commit's future as it starts; what it appends belongs to the
   next transaction;
4. only then write the ACK intents, and go on at 1 while they are written (pipelining: the next
   transaction consumes while this one's ACKs are in flight). Its read-through offsets count as
   the shard's progress (`Shard.read_through`, what Stat waits on) once its ACKs are written.

A crash before 3 leaves nothing (the store rolls back; the downstream messages were never
acknowledged, so read-committed readers never see them; the next primary reads the same inputs
again). A crash between 3 and 4 is mended by the next primary's step 0. A zombie's step 3 fails
on the fence and it stops.

A stop (the spec changed, the shard moved, the process stops) closes the open transaction at its
next chunk; it commits, its ACKs are written, and nothing more is consumed, whatever the backlog.

Messages are read a chunk at a time (`ReadCommitted.batches`) by a task that snapshots the
Sequencer's checkpoint after each chunk, so a transaction closes between chunks and its
checkpoint is exactly what it consumed. The reader runs ahead by up to READ_AHEAD chunks; chunks
are numbered (the Sequencer's `generation`) so a transaction waits only for source transactions
begun or extended in chunks after the last one it closed at (Gazette clears HasPending there). A
store's transaction is one at a time (a SQL connection's): transaction N+1 begins once N's store
commit is done; the ACK writes overlap. Choices where Gazette differs: an undecodable message is
skipped with a warning naming its journal and offsets, or the application's `on_garbage(shard,
journal, garbage)` (a plain function) decides (raising fails the shard).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from tidings.client import AppendService, AsyncClient
from tidings.consumer.store import Store
from tidings.message import AckIntent, Checkpoint, Envelope, JournalCheckpoint, ProducerState, Publisher
from tidings.message.iterators import read_committed
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import JournalNotFoundError, TidingsError, UsageError

__all__ = ["Application", "Shard", "TxnStats", "checkpoint_from_proto", "checkpoint_to_proto", "serve_primary"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class TxnStats:
    """A finished transaction, for metrics: messages consumed and seconds spent in each phase."""

    messages: int
    consuming: float  # first message to close
    committing: float  # finalize_txn, the previous ACKs, the store commit
    acknowledging: float = 0.0  # writing the ACKs after the commit


@dataclasses.dataclass
class Shard:
    """What an application sees of the shard it runs in, and what its consumer process watches."""

    spec: pb.ShardSpec
    client: AsyncClient
    publisher: Publisher | None = None  # a new ProducerID each time the shard becomes primary
    read_through: dict[str, int] = dataclasses.field(default_factory=dict)  # per source, once its ACKs are written
    restored: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # the store restored: serving
    on_transaction: Callable[[TxnStats], None] | None = None  # called as each transaction's ACKs are written
    data_dir: Path | None = None  # where the shard's local files go (the consumer's --data-dir)
    _moved: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def path(self, suffix: str = ".db") -> Path:
        """The shard's own file in `data_dir` (its id quoted: '/' and all make one file name), e.g. for
        a SQLiteStore: ``SQLiteStore(shard.path())``."""
        if self.data_dir is None:
            raise UsageError(f"shard {self.spec.id!r} has no data_dir: run it in a consumer (--data-dir)")
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        return Path(self.data_dir) / (quote(self.spec.id, safe="") + suffix)

    def advance(self, checkpoint: Checkpoint, stats: TxnStats | None = None) -> None:
        """Progress: the read-through offsets of a committed (and acknowledged) transaction."""
        for journal, jc in checkpoint.journals.items():
            if jc.read_through > self.read_through.get(journal, -1):
                self.read_through[journal] = jc.read_through
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()
        if stats is not None and self.on_transaction is not None:
            self.on_transaction(stats)

    async def wait_read_through(self, offsets: dict[str, int], timeout: float | None = None) -> dict[str, int]:
        """Wait until the shard has read through `offsets` (journal -> offset), at most `timeout` seconds
        (TimeoutError); returns the read-through offsets (Gazette's Stat: a client reads its own writes)."""
        async with asyncio.timeout(timeout):
            while any(self.read_through.get(j, 0) < o for j, o in offsets.items()):
                await self._moved.wait()
        return dict(self.read_through)


class Application(Protocol):
    """A user's consumer (Gazette's Application). Optional methods, looked up by name:
    `new_message(journal_spec) -> type` (what source messages decode into; default dicts for JSON),
    `begin_txn(shard, store)` (awaited as a transaction begins), `finished_txn(shard, store, future)`
    (awaited as its commit starts; the future resolves once the store committed), and
    `on_garbage(shard, journal, garbage)` (an undecodable range: raise to fail the shard).

    The sync variant: `consume_message`, `finalize_txn`, `begin_txn` and `finished_txn` may be plain
    functions (a SQLite application that only changes its store, say); publishing is async, so an
    application that publishes does it from async hooks.
    """

    def new_store(self, shard: Shard) -> Store: ...
    async def consume_message(self, shard: Shard, store: Store, envelope: Envelope, publisher: Publisher) -> None: ...
    async def finalize_txn(self, shard: Shard, store: Store, publisher: Publisher) -> None: ...


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


async def serve_primary(
    client: AsyncClient, spec: pb.ShardSpec, app: Application, stop: asyncio.Event, shard: Shard | None = None
) -> None:
    """Run the shard's transactions until `stop` is set (or a failure, raised: FenceError for a zombie).

    A graceful stop commits the open transaction and waits for its ACKs. `shard` (made here if
    None) is what the consumer process watches: `restored` is set once the store is restored and
    the recovered ACKs are written, `read_through` follows the transactions."""
    shard = shard if shard is not None else Shard(spec, client)
    store = app.new_store(shard)
    service = AppendService(client)
    stopped = False
    try:
        restored, intents = checkpoint_from_proto(await store.restore_checkpoint(spec.id))
        publisher = shard.publisher = Publisher(service)
        if intents:  # the last primary may have died before writing them: they commit its last transaction
            await _write_recovered(spec.id, service, publisher, intents)
        names = [s.journal for s in spec.sources]
        for s in spec.sources:  # reading starts at max(checkpoint, min_offset), as in Gazette
            jc = restored.journals.get(s.journal)
            if jc is None and s.min_offset:
                restored.journals[s.journal] = JournalCheckpoint(s.min_offset, {})
            elif jc is not None and jc.read_through < s.min_offset:  # (an operator skipping a bad range)
                jc.read_through = s.min_offset
                jc.producers = {
                    pid: ProducerState(st.last_ack, -1 if st.begin < s.min_offset else st.begin, st.newest)
                    for pid, st in jc.producers.items()
                }
        shard.advance(restored)
        shard.restored.set()
        on_garbage = getattr(app, "on_garbage", None)
        if on_garbage is not None and inspect.iscoroutinefunction(on_garbage):
            raise UsageError(_ASYNC_ON_GARBAGE)
        reader = read_committed(
            client,
            names,
            checkpoint=restored,
            ring_size=spec.ring_buffer_size or 8192,
            message_type=await _message_type(client, app, names),
            on_garbage=None if on_garbage is None else functools.partial(_on_garbage, on_garbage, shard),
            empty_batches=True,
            reread_pending=False,  # (Gazette's: a transaction pending at the checkpoint is re-read at its ACK)
        )
        await _Transactions(shard, app, store, publisher, reader, stop).run()
        stopped = True
    finally:
        store.destroy()
        await _close_appends(spec.id, service, flush=stopped)


_ASYNC_ON_GARBAGE = (
    "on_garbage must be a plain function (def, not async def): it is called as the bytes are decoded; "
    "raise there to fail the shard"
)


def _on_garbage(hook: Callable[..., Any], shard: Shard, journal: str, garbage: Any) -> None:
    """The application's on_garbage, which must decide at once (it cannot be awaited mid-decode)."""
    result = hook(shard, journal, garbage)
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise UsageError(_ASYNC_ON_GARBAGE)


async def _close_appends(shard_id: str, service: AppendService, flush: bool) -> None:
    """After a graceful stop, wait (at most FLUSH_TIMEOUT) for appends still queued (say, from
    `finished_txn`); after a failure or a cancellation, or past that wait, abandon them: a primary
    going away never hangs on a journal that refuses its appends (they retry for as long as it lives)."""
    try:
        if flush:
            async with asyncio.timeout(FLUSH_TIMEOUT):
                await service.aclose()
    except TimeoutError:
        log.warning("shard %s: appends still queued after %.0fs at its stop are abandoned", shard_id, FLUSH_TIMEOUT)
    except Exception as exc:  # (they failed: the transaction that needed them did not commit)
        log.info("shard %s: appends still queued at its stop failed: %s", shard_id, exc)
    finally:
        await service.abort()


async def _write_recovered(
    shard_id: str, service: AppendService, publisher: Publisher, intents: list[AckIntent]
) -> None:
    """Write a restored checkpoint's ACK intents, each journal's on its own: one naming a journal that
    no longer exists (deleted since that transaction committed) is discarded with a warning, as
    Gazette does, and the others are written; any other failure fails the shard."""
    written = [await publisher.write_ack_intents([intent]) for intent in intents]
    for intent, outcome in zip(intents, await asyncio.gather(*written, return_exceptions=True), strict=True):
        if isinstance(outcome, JournalNotFoundError):
            log.warning("shard %s: discarding the recovered ACK intent of output journal %s: the journal does not "
                        "exist (deleted since the last primary committed)", shard_id, intent.journal)  # fmt: skip
            service.resume(intent.journal)
        elif isinstance(outcome, BaseException):
            raise outcome


async def _message_type(client: AsyncClient, app: Any, journals: list[str]) -> Any:
    """What the sources' messages decode into: the application's `new_message(journal_spec)` (one type
    for all sources), else the framing's default (dicts for JSON)."""
    new_message = getattr(app, "new_message", None)
    if new_message is None:
        return None
    specs = [await client.spec(journal) for journal in journals]
    types = {new_message(spec) for spec in specs}
    if len(types) != 1:
        raise UsageError(f"new_message gives several message types for the sources {sorted(journals)}; give one")
    return types.pop()


@dataclasses.dataclass(slots=True)
class _Read:
    """A chunk's committed messages and the reader's checkpoint right after them."""

    envelopes: list[Envelope]
    checkpoint: Checkpoint
    generation: int  # this chunk's number (the Sequencer's generation while it was sequenced)
    pending: int  # the newest generation with a source transaction awaiting its ACK (-1: none)


_COROUTINE = types.CoroutineType
READ_AHEAD = 8  # chunks read ahead of the transaction consuming them
FLUSH_TIMEOUT = 5.0  # seconds a stopped primary waits for appends still queued
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


class _Transactions:
    """One primary's transaction loop (steps 1-4 of the module docstring)."""

    def __init__(self, shard: Shard, app: Any, store: Store, publisher: Publisher, reader: Any, stop: asyncio.Event):
        self.shard, self.app, self.store, self.publisher, self.reader, self.stop = (
            shard, app, store, publisher, reader, stop
        )  # fmt: skip
        spec = shard.spec
        self.min_dur, self.max_dur = spec.min_txn_duration_ms / 1000, spec.max_txn_duration_ms / 1000
        self.wait_for_ack = not spec.disable_wait_for_ack
        self.reads: asyncio.Queue[_Read | BaseException] = asyncio.Queue(READ_AHEAD)
        self.upcoming: asyncio.Task | None = None  # a get from `reads`: never cancelled mid-transaction
        self.acks: asyncio.Future | None = None  # the last transaction's ACK appends
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

    def _waits(self, stopped: asyncio.Future) -> list[asyncio.Future]:
        """What a wait for the next chunk also wakes for: the stop, and the last transaction's ACKs
        (written: the transaction may close; failed: the shard fails, idle or not)."""
        self.upcoming = self.upcoming or asyncio.ensure_future(self.reads.get())
        waits = [self.upcoming, stopped]
        if self.acks is not None and not self.acks.done():
            waits.append(self.acks)
        return waits

    def _progress(self, checkpoint: Checkpoint) -> None:
        if self.acks is None or self.acks.done():
            self.shard.advance(checkpoint)
        else:
            self.idle = checkpoint

    async def _transaction(self, read: _Read, stopped: asyncio.Future) -> None:
        shard, app, store, publisher = self.shard, self.app, self.store, self.publisher
        began = time.monotonic()
        if hasattr(store, "begin"):
            await store.begin()  # (its locks are waited for off the event loop)
        if hasattr(app, "begin_txn"):
            await _called(app.begin_txn(shard, store))
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
        await _called(app.finalize_txn(shard, store, publisher))
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
            if hasattr(app, "finished_txn"):
                await _called(app.finished_txn(shard, store, commit))
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

    async def _next_read(self, began: float, last: _Read, stopped: asyncio.Future) -> _Read | None:
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

    def _acked(self, checkpoint: Checkpoint, stats: TxnStats, committed: float, acks: asyncio.Future) -> None:
        if acks.cancelled() or acks.exception() is not None:
            return  # (the next transaction's commit, or the stop, raises it)
        stats.acknowledging = time.monotonic() - committed
        self.shard.advance(checkpoint if self.idle is None else self.idle, stats)
        self.idle = None


async def _called(result: Any) -> None:
    """An application hook's result, awaited if it is a coroutine (hooks may be plain functions)."""
    if inspect.isawaitable(result):
        await result
