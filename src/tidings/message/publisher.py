"""Publisher: sequenced, optionally transactional publishing (gazette-exactly-once.txt, *Message UUIDs*).

A Publisher has one random ProducerID and a monotonic Clock. Every message it publishes gets a v1
UUID of (producer, clock tick, flags) before it is framed by its journal's ``content-type`` label
(``application/x-ndjson`` when a journal has none) and queued on an AppendService:

* `publish_committed` - flag OUTSIDE_TXN: each message commits itself; read-committed readers see
  it once, however often its append is retried.
* `publish_uncommitted` - flag CONTINUE_TXN: pending until an ACK_TXN of this producer with a
  larger clock is read in the same journal.
* `build_ack_intents` - one ACK_TXN message per journal written to since the last call (all with
  the same, newest clock). Writing them (`write_ack_intents`) commits the transaction; writing
  older intents again rolls back whatever the producer published after them. A consumer keeps
  its intents in its checkpoint and writes them only after the checkpoint commits.

An ACK must never commit before the messages it acknowledges: readers of its journal would deliver
the transaction while its messages in another journal could still fail, and it would not be
all-or-nothing. So `write_ack_intents` makes every ACK depend (AppendService dependencies, Gazette's
`StartAppend(req, deps)`) on each uncommitted publish of the transaction its intents were built
for, in every journal (and of earlier built transactions whose intents were never written, which an
ACK with a newer clock commits too): an ACK waits until they committed, and if one of them failed
it fails unwritten, so no journal gets an ACK for a transaction that is not whole. That failure
stops the ACK's journal in the AppendService (its later appends fail too), as a later ACK there
would otherwise commit the partial transaction's messages; a journal whose message append failed is
stopped the same way. A producer whose transaction failed starts again under a new ProducerID (a
new Publisher), as a recovering consumer shard does. Intents recovered from a checkpoint depend on
nothing: their messages committed before the checkpoint did.

A producer that restarts (a consumer shard recovering its checkpoint) writes the recovered intents
and then publishes under a **new** ProducerID, as Gazette does. With the old one, an abandoned
transaction's messages in a journal the recovered intents do not cover would still be pending,
and the next ACK there would commit them.

A **mapping** picks each message's journal: a journal name, or a function of the message. Built-in
mappings choose among the journals of a label selector (`JournalList`, kept current by a List
watch): `modulo_mapping` and `rendezvous_mapping` by a key of the message (rendezvous hashing
moves only 1/N of the keys when a journal is added), `random_mapping` at random.

ACK messages must decode as the journal's message type: a dict ACK is ``{"uuid": ...}``, a
protobuf ACK is an empty message, other types are built by their ``new_acknowledgement(journal)``
classmethod, or by calling the type with no arguments.
"""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from uuid import UUID

import msgspec
from google.protobuf.message import Message as _ProtoMessage

from tidings.client import AppendResult, AppendService, AsyncClient
from tidings.message.framing import (
    CONTENT_TYPE_LABEL,
    NDJSON,
    Framing,
    framing_for,
    set_uuid,
    uuid_setter,
    uuid_str_setter,
)
from tidings.message.uuid import (
    ACK_TXN,
    CONTINUE_TXN,
    OUTSIDE_TXN,
    Clock,
    ProducerID,
    build_uuid,
    new_clock,
    uuid_strs,
)
from tidings.message.uuid import new_producer_id as _new_producer_id
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import UsageError

__all__ = [
    "AckIntent",
    "JournalList",
    "Mapping",
    "Publisher",
    "modulo_mapping",
    "new_acknowledgement",
    "random_mapping",
    "rendezvous_mapping",
]

Mapping = Callable[[Any], str]
"""Picks the journal of a message."""

KeyFn = Callable[[Any], str | bytes]


class AckIntent(msgspec.Struct, frozen=True):
    """The framed ACK_TXN message to write to `journal` to commit a transaction (checkpoint-able)."""

    journal: str
    content: bytes


def content_type_of(spec: pb.JournalSpec) -> str:
    """A journal's media type, by its content-type label (parameters such as `; charset=utf-8` dropped,
    lowercased, as `framing_for` reads it), so comparing it with NDJSON means what its framing does."""
    for label in spec.labels.labels:
        if label.name == CONTENT_TYPE_LABEL:
            return label.value.split(";", 1)[0].strip().lower()
    return NDJSON


async def journal_framing(client: AsyncClient, journal: str, spec: pb.JournalSpec | None = None) -> Framing:
    """The framing of `journal` by its content-type label, from `spec` or else from the cluster."""
    if spec is None:
        spec = await client.spec(journal)
    return framing_for(content_type_of(spec))


class JournalList:
    """The journals matching a label selector, in name order, kept current by a List watch.

    **Parameters:**
    * `client` - any AsyncClient of the cluster.
    * `selector` - a LabelSelector, or its text form ("app=shop,!tmp").
    """

    def __init__(self, client: AsyncClient, selector: pb.LabelSelector | str) -> None:
        self.client = client
        self.selector = labels.parse_selector(selector) if isinstance(selector, str) else selector
        self.names: list[str] = []
        self.specs: dict[str, pb.JournalSpec] = {}
        self._loaded = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> JournalList:
        """Load the list (returns once it is loaded) and keep it current in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._watch_loop(), name="journal-list")
        waiter = asyncio.ensure_future(self._loaded.wait())
        await asyncio.wait([waiter, self._task], return_when=asyncio.FIRST_COMPLETED)
        if not self._loaded.is_set():
            waiter.cancel()
            await self._task  # raises what stopped the watch
        return self

    async def _watch_loop(self) -> None:
        async for resp in self.client.watch(self.selector):
            self.specs = {j.spec.name: j.spec for j in resp.journals}
            self.names = sorted(self.specs)
            self._loaded.set()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])

    def _require(self) -> list[str]:
        if not self.names:
            raise UsageError(f"no journal matches the selector {labels.format_selector(self.selector)!r}")
        return self.names


def _key_bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


def modulo_mapping(journals: JournalList, key: KeyFn) -> Mapping:
    """The journal at index crc32(key) modulo the number of journals (in name order)."""

    def mapping(msg: Any) -> str:
        names = journals._require()
        return names[zlib.crc32(_key_bytes(key(msg))) % len(names)]

    return mapping


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit score."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def rendezvous_pick(names: Sequence[str], key_hash: int, cache: dict[str, int]) -> str:
    """The name with the highest score for a key's 32-bit hash (rendezvous hashing): adding or
    removing a name moves only the keys that score highest there. `cache` keeps the names' hashes."""
    k = key_hash * 0x9E3779B97F4A7C15
    best, best_score = names[0], -1
    for name in names:
        h = cache.get(name)
        if h is None:
            h = cache[name] = zlib.crc32(name.encode()) << 32 | zlib.crc32(name[::-1].encode())
        score = _mix((k ^ h) & 0xFFFFFFFFFFFFFFFF)
        if score > best_score:
            best, best_score = name, score
    return best


def rendezvous_mapping(journals: JournalList, key: KeyFn) -> Mapping:
    """The journal with the highest score for the key (`rendezvous_pick`)."""
    cache: dict[str, int] = {}

    def mapping(msg: Any) -> str:
        return rendezvous_pick(journals._require(), zlib.crc32(_key_bytes(key(msg))), cache)

    return mapping


def random_mapping(journals: JournalList) -> Mapping:
    """A journal of the list at random."""

    def mapping(msg: Any) -> str:
        return random.choice(journals._require())

    return mapping


def new_acknowledgement(message_type: type, journal: str) -> Any:
    """An (empty) ACK message of `message_type` for `journal`; the Publisher sets its UUID."""
    factory = getattr(message_type, "new_acknowledgement", None)
    if factory is not None:
        return factory(journal)
    if issubclass(message_type, dict):
        return {}
    if issubclass(message_type, _ProtoMessage):
        return message_type()
    try:
        return message_type()
    except TypeError as exc:
        raise UsageError(
            f"cannot build an ACK message of {message_type.__qualname__} ({exc}): give the type defaults for every "
            "field but uuid, or a classmethod new_acknowledgement(journal)"
        ) from exc


class Publisher:
    """Publishes messages with sequencing UUIDs through an AppendService; see the module docstring.

    **Parameters:**
    * `service` - the AppendService appends are queued on (its client also looks up journals).
    * `producer` - this publisher's ProducerID (random by default; never reuse one across restarts).
    * `clock` - the producer's Clock (started at the current time by default).
    * `journals` - a JournalList whose specs give the journals' content types (looked up otherwise).

    Usage::

        pub = Publisher(AppendService(client))
        await (await pub.publish_committed("shop/orders", {"id": 1}, {"id": 2}))
    """

    def __init__(
        self,
        service: AppendService,
        *,
        producer: ProducerID | None = None,
        clock: Clock | None = None,
        journals: JournalList | None = None,
    ) -> None:
        self.service = service
        self.producer = producer if producer is not None else _new_producer_id()
        self.clock = clock if clock is not None else new_clock()
        self.journals = journals
        self._framings: dict[str, Framing] = {}
        self._txn: dict[str, type] = {}  # journals written in the open transaction -> their message type
        self._txn_appends: list[asyncio.Future[AppendResult]] = []  # appends of the open transaction
        self._acked_appends: list[asyncio.Future[AppendResult]] = []  # appends the built intents acknowledge
        self._acks_written = True  # the last built intents went through write_ack_intents
        self._unacked: set[str] = set()  # journals of built intents not yet queued by write_ack_intents
        self._prune_at = PRUNE_AT  # _txn_appends' length that makes _publish forget committed ones

    @staticmethod
    def new_producer_id() -> ProducerID:
        return _new_producer_id()

    async def publish_committed(self, mapping: Mapping | str, *messages: Any) -> asyncio.Future[list[AppendResult]]:
        """Publish `messages` (OUTSIDE_TXN); returns a future of their appends' spans, one per journal."""
        return await self._publish(mapping, messages, OUTSIDE_TXN)

    async def publish_uncommitted(self, mapping: Mapping | str, *messages: Any) -> asyncio.Future[list[AppendResult]]:
        """Publish `messages` as part of the open transaction (CONTINUE_TXN); see `build_ack_intents`."""
        return await self._publish(mapping, messages, CONTINUE_TXN)

    def build_ack_intents(self) -> list[AckIntent]:
        """The ACK_TXN messages that commit the open transaction, one per journal it wrote; closes it."""
        # The intents acknowledge every pending message of this producer (their clock is the newest).
        # An earlier transaction whose intents were written is covered by those ACKs, which precede
        # ours in each journal; one whose intents were not written must commit before ours do.
        earlier = [] if self._acks_written else [f for f in self._acked_appends if not _committed(f)]
        self._acked_appends, self._txn_appends, self._acks_written = earlier + self._txn_appends, [], False
        self._prune_at = PRUNE_AT
        self._unacked = set(self._txn)
        if not self._txn:
            return []
        self.clock.update()
        u = build_uuid(self.producer, self.clock.tick(), ACK_TXN)
        intents = []
        for journal, message_type in self._txn.items():
            ack = new_acknowledgement(message_type, journal)
            set_uuid(ack, u)
            intents.append(AckIntent(journal, self._framings[journal].marshal(ack)))
        self._txn.clear()
        return intents

    async def write_ack_intents(self, intents: Iterable[AckIntent]) -> asyncio.Future[list[AppendResult]]:
        """Queue ACK intents (new, or recovered from a checkpoint); returns a future of their spans.

        Each ACK is held until every uncommitted publish of the transaction the last
        `build_ack_intents` closed has committed, in every journal, and fails unwritten
        (`DependencyFailedError`) if one of them failed. An ACK settles everything this producer has
        pending in its journal: what was published uncommitted there after the intent was built is
        rolled back by it (re-writing an earlier transaction's intents abandons the open one there)."""
        deps = self._acked_appends = [f for f in self._acked_appends if not _committed(f)]
        self._acks_written = True
        self._unacked = set()
        futures = []
        for intent in intents:
            futures.append(await self.service.append(intent.journal, intent.content, dependencies=deps))
            # (an older ACK settles what this producer has pending there: it rolls back what came after it)
            self._txn.pop(intent.journal, None)
        return _all(futures)

    @property
    def in_transaction(self) -> bool:
        """Messages were published uncommitted since the last `build_ack_intents`."""
        return bool(self._txn)

    def _check_order(self, journal: str, flags: int) -> None:
        """Refuse what read-committed readers would lose: a committed message of this producer in a
        journal holding its pending (uncommitted) ones rolls them back; and any message in a journal
        whose ACK is built but not yet queued lands before it, so the ACK rolls it back (uncommitted)
        or, later in the journal than the message, goes back in the producer's clock (committed)."""
        if journal in self._unacked:
            raise UsageError(
                f"journal {journal!r}: the ACK of this producer's last transaction there is built but not written "
                "yet, and a message published now would land before it and be lost (publishing from a consumer's "
                "finished_txn?): publish from consume_message, begin_txn or finalize_txn"
            )
        if flags == OUTSIDE_TXN and journal in self._txn:
            raise UsageError(
                f"journal {journal!r}: this producer has uncommitted messages there in its open transaction, which "
                "a committed message would roll back: publish it uncommitted too (it commits with the transaction)"
            )

    async def framing(self, journal: str) -> Framing:
        """The framing of `journal`, by its content-type label (cached)."""
        framing = self._framings.get(journal)
        if framing is not None:
            return framing
        spec = self.journals.specs.get(journal) if self.journals is not None else None
        framing = self._framings[journal] = await journal_framing(self.service.client, journal, spec)
        return framing

    async def _publish(
        self, mapping: Mapping | str, messages: tuple[Any, ...], flags: int
    ) -> asyncio.Future[list[AppendResult]]:
        if not messages:
            return _all([])
        groups: dict[str, list[Any]] = {}
        if isinstance(mapping, str):
            groups[mapping] = list(messages)
        else:
            for msg in messages:
                groups.setdefault(mapping(msg), []).append(msg)
        self.clock.update()
        producer = self.producer
        clocks = self.clock.reserve(len(messages))
        at = 0
        futures = []
        for journal in groups:
            self._check_order(journal, flags)
        for journal, msgs in groups.items():
            framing = await self.framing(journal)
            mine, at = clocks[at : at + len(msgs)], at + len(msgs)
            kind = type(msgs[0])
            set_str = uuid_str_setter(kind)
            if set_str is not None and all(type(m) is kind for m in msgs):  # the batch path: strings at once
                for msg, u in zip(msgs, uuid_strs(producer, mine, flags), strict=True):
                    set_str(msg, u)
            else:
                last_type: type | None = None
                setter: Callable[[Any, UUID], None] = set_uuid
                for msg, clock in zip(msgs, mine, strict=True):  # (the setter is looked up once per type)
                    if type(msg) is not last_type:
                        last_type = type(msg)
                        setter = uuid_setter(last_type)
                    setter(msg, build_uuid(producer, clock, flags))
            fut = await self.service.append(journal, framing.encode_batch(msgs))
            futures.append(fut)
            if flags == CONTINUE_TXN:
                self._txn[journal] = type(msgs[-1])
                self._txn_appends.append(fut)
        if len(self._txn_appends) > self._prune_at:  # a long transaction: forget appends that committed
            self._txn_appends = [f for f in self._txn_appends if not _committed(f)]
            # (amortised: the next pass once the list doubled, not at each publish while appends are in flight)
            self._prune_at = max(PRUNE_AT, 2 * len(self._txn_appends))
        return _all(futures)


PRUNE_AT = 256


def _committed(fut: asyncio.Future[AppendResult]) -> bool:
    """The append committed (a cancelled future's outcome is the AppendService's to tell: keep it)."""
    return fut.done() and not fut.cancelled() and fut.exception() is None


def _all(futures: list[asyncio.Future[AppendResult]]) -> asyncio.Future[list[AppendResult]]:
    if len(futures) == 1:  # (the usual case, per message for a consumer: a gather costs twice as much)
        return _listed(futures[0])
    if not futures:
        return _done([])
    out = asyncio.gather(*futures)
    out.add_done_callback(_retrieved)
    return out


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark a failure as seen: the AppendService logged it, and a caller need not await what it publishes."""
    if not fut.cancelled():
        fut.exception()


def _listed(fut: asyncio.Future[AppendResult]) -> asyncio.Future[list[AppendResult]]:
    """A future of ``[fut's result]``, as ``gather(fut)`` gives, failed or cancelled with it. Cancelling
    it only stops the caller's wait: the append is queued and goes on (nothing can take it back; the
    AppendService still tells its outcome to what depends on it)."""
    out = fut.get_loop().create_future()

    def settle(f: asyncio.Future[AppendResult]) -> None:
        if out.done():
            return
        if f.cancelled():
            out.cancel()
        elif (exc := f.exception()) is not None:
            out.set_exception(exc)
            out.exception()  # (seen: the AppendService logged it; a caller need not await what it publishes)
        else:
            out.set_result([f.result()])

    fut.add_done_callback(settle)
    return out


def _done(value: list[AppendResult]) -> asyncio.Future[list[AppendResult]]:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut
