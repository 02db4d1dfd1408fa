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
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from tidings.client import AppendService, AsyncClient
from tidings.consumer.application import Application, Shard
from tidings.consumer.transaction import Transactions, checkpoint_from_proto
from tidings.message import AckIntent, JournalCheckpoint, ProducerState, Publisher
from tidings.message.iterators import read_committed
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import JournalNotFoundError, UsageError

__all__ = ["serve_primary"]

log = logging.getLogger(__name__)


async def serve_primary(
    client: AsyncClient, spec: pb.ShardSpec, app: Application, stop: asyncio.Event, shard: Shard | None = None
) -> None:
    """Run the shard's transactions until `stop` is set (or a failure, raised: FenceError for a zombie).

    A graceful stop commits the open transaction and waits for its ACKs. `shard` (made here if
    None) is what the consumer process watches: `restored` is set once the store is restored and
    the recovered ACKs are written, `read_through` follows the transactions."""
    if not isinstance(app, Application):
        raise UsageError(f"{type(app).__name__} is no tidings.consumer.Application: subclass it")
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
        if inspect.iscoroutinefunction(app.on_garbage):
            raise UsageError(_ASYNC_ON_GARBAGE)
        reader = read_committed(
            client,
            names,
            checkpoint=restored,
            ring_size=spec.ring_buffer_size or 8192,
            message_type=await _message_type(client, app, names),
            on_garbage=functools.partial(_on_garbage, app.on_garbage, shard),
            empty_batches=True,
            reread_pending=False,  # (Gazette's: a transaction pending at the checkpoint is re-read at its ACK)
        )
        await Transactions(shard, app, store, publisher, reader, stop).run()
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


async def _message_type(client: AsyncClient, app: Application, journals: list[str]) -> Any:
    """What the sources' messages decode into: the application's `new_message(journal_spec)` (one type
    for all sources), else the framing's default (dicts for JSON)."""
    if getattr(app.new_message, "__func__", None) is Application.new_message:  # (the class's or the object's)
        return None  # (no List call for an application that does not choose)
    specs = [await client.spec(journal) for journal in journals]
    types = {app.new_message(spec) for spec in specs}
    if len(types) != 1:
        raise UsageError(f"new_message gives several message types for the sources {sorted(journals)}; give one")
    return types.pop()


FLUSH_TIMEOUT = 5.0  # seconds a stopped primary waits for appends still queued
