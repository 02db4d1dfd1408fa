"""Shard: a consumer shard's primary, running transactions as the seed's "Consumer Shard Transaction
Lifecycle" (gazette-exactly-once.txt): every input message's effects on the store and on
downstream journals commit exactly once, whatever crashes.

On becoming primary (`serve_primary`): restore the Checkpoint from the store (which fences off a
previous primary, see `store`), re-write the ACK intents it holds (the previous primary may have
died between committing the checkpoint and writing its ACKs), then read the sources committed
(`read_committed`, resuming the Sequencer from the checkpoint) and run transactions:

1. begin with the first message read (`begin_txn`), consume messages (`consume_message`, which
   changes the store in its open transaction and publishes downstream messages uncommitted);
2. close once `max_txn_duration` passed, or once `min_txn_duration` passed and no message is
   ready (input stalled), then `finalize_txn`;
3. build the ACK intents that commit this transaction's downstream messages, and commit the
   store's transaction with the Checkpoint (read-through offsets, producer states, those ACK
   intents), after every downstream append of the transaction has committed;
4. only then write the ACK intents (`finished_txn` hears how it went).

A crash before 3 leaves nothing (the store rolls back; the downstream messages were never
acknowledged, so read-committed readers never see them; the next primary reads the same inputs
again). A crash between 3 and 4 is mended by the next primary's step 0. A zombie's step 3 fails
on the fence and it stops.

Choices where the issue's later steps will refine: transactions are not yet pipelined (N+1 starts
once N's ACKs are written); a transaction does not wait for an ACK it expects; the store is the
application's (`Application.new_store`), the SQL ones in `store`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from tidings.client import AppendService, AsyncClient
from tidings.consumer.store import Store
from tidings.message import AckIntent, Checkpoint, Envelope, JournalCheckpoint, ProducerState, Publisher
from tidings.message.iterators import read_committed
from tidings.protocol import protocol_pb2 as pb

__all__ = ["Application", "Shard", "checkpoint_from_proto", "checkpoint_to_proto", "serve_primary"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Shard:
    """What an application sees of the shard it runs in."""

    spec: pb.ShardSpec
    client: AsyncClient
    publisher: Publisher | None = None  # a new ProducerID each time the shard becomes primary
    read_through: dict[str, int] = dataclasses.field(default_factory=dict)  # per source, after each commit


class Application(Protocol):
    """A user's consumer (Gazette's Application); `begin_txn` and `finished_txn` are optional."""

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


async def serve_primary(client: AsyncClient, spec: pb.ShardSpec, app: Application, stop: asyncio.Event) -> None:
    """Run the shard's transactions until `stop` is set (or a failure, raised: FenceError for a zombie)."""
    shard = Shard(spec, client)
    store = app.new_store(shard)
    service = AppendService(client)
    try:
        restored, intents = checkpoint_from_proto(await store.restore_checkpoint(spec.id))
        publisher = shard.publisher = Publisher(service)
        if intents:  # the last primary may have died before writing them: they commit its last transaction
            await (await publisher.write_ack_intents(intents))
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
        shard.read_through = {j: jc.read_through for j, jc in restored.journals.items()}
        reader = read_committed(client, names, checkpoint=restored, ring_size=spec.ring_buffer_size or 8192)
        await _transactions(shard, app, store, publisher, reader, stop)
    finally:
        store.destroy()
        with contextlib.suppress(Exception):
            await service.aclose()


async def _transactions(
    shard: Shard, app: Any, store: Store, publisher: Publisher, reader: Any, stop: asyncio.Event
) -> None:
    spec = shard.spec
    messages = reader.__aiter__()
    upcoming: asyncio.Task[Envelope] | None = None  # never cancelled mid-read: it carries over transactions
    stopped = asyncio.ensure_future(stop.wait())
    try:
        while not stop.is_set():
            upcoming = upcoming or asyncio.ensure_future(messages.__anext__())
            await asyncio.wait([upcoming, stopped], return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                return
            began = time.monotonic()
            if hasattr(store, "begin"):
                await store.begin()  # (its locks are waited for off the event loop)
            if hasattr(app, "begin_txn"):
                await app.begin_txn(shard, store)
            appends: list[Awaitable[Any]] = []
            publish = _Tracking(publisher, appends)
            while True:
                env, upcoming = upcoming.result(), None
                await app.consume_message(shard, store, env, publish)
                elapsed = time.monotonic() - began
                if elapsed >= spec.max_txn_duration_ms / 1000:
                    break
                upcoming = asyncio.ensure_future(messages.__anext__())
                wait = spec.max_txn_duration_ms / 1000 - elapsed
                if elapsed >= spec.min_txn_duration_ms / 1000:
                    wait = 0.0  # input stalls: close now
                done, _ = await asyncio.wait([upcoming], timeout=wait)
                if not done:
                    await asyncio.sleep(0)  # (one more turn for a message already on its way)
                    if not upcoming.done():
                        break
            # Now, with no await since the last consumed message: a read still under way may yield its
            # next message at any await below, and that one belongs to the next transaction.
            checkpoint = reader.checkpoint()
            await app.finalize_txn(shard, store, publish)
            intents = publisher.build_ack_intents()
            outcome: BaseException | None = None
            try:
                await store.start_commit(spec.id, checkpoint_to_proto(checkpoint, intents), appends)
                await (await publisher.write_ack_intents(intents))
                shard.read_through = {j: jc.read_through for j, jc in checkpoint.journals.items()}
            except BaseException as exc:
                outcome = exc
                raise
            finally:
                if hasattr(app, "finished_txn"):
                    with contextlib.suppress(Exception):
                        await app.finished_txn(shard, store, outcome)
    finally:
        stopped.cancel()
        if upcoming is not None:
            upcoming.cancel()
        with contextlib.suppress(BaseException):
            await messages.aclose()


class _Tracking:
    """The shard's Publisher, remembering the futures of this transaction's uncommitted appends: the
    store commits only once they have."""

    def __init__(self, publisher: Publisher, appends: list[Awaitable[Any]]) -> None:
        self._publisher, self._appends = publisher, appends

    async def publish_uncommitted(self, mapping: Any, *messages: Any) -> asyncio.Future:
        fut = await self._publisher.publish_uncommitted(mapping, *messages)
        self._appends.append(fut)
        return fut

    def __getattr__(self, name: str) -> Any:
        return getattr(self._publisher, name)
