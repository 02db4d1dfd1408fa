"""The WAL: transactions as messages of a tidings journal, the targets they go to, and the
transaction manager's client that appends them (logplayer-paper.txt, section 1: the WAL system).

A transaction is a list of mutations (key, JSON value, or delete), each keyed to a target by the
declared mapping (`Targets.target_of`: rendezvous hashing over the target ids of targets.yaml, so
adding a target moves only the keys it now scores highest for). `WalWriter.append` writes one
transaction as one committed message (OUTSIDE_TXN UUID) of the WAL journal (NDJSON), parts
grouped by target, and returns its *index*: the journal offset at which the message begins,
strictly increasing and assigned by the broker (section 2 requires exactly that of an index).

Producer duplicates, which the paper leaves out of scope, are closed here: a transaction carries
its UUID, and appending the same `WalEntry` again (a retry after a crash before the answer)
re-sends the same UUID, which the LogPlayer's read-committed reader (the Sequencer) drops. A
retry must come from the same producer with no newer transaction of it appended in between, or
be a transaction the reader already passed: either way the Sequencer sees a clock it has acked.

targets.yaml::

    targets:
      - id: shard-0
        endpoint: 127.0.0.1:7000
      - id: shard-1
        endpoint: 127.0.0.1:7001
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from tidings.client import AppendService, AsyncClient
from tidings.message.framing import Framing
from tidings.message.publisher import journal_framing, rendezvous_pick
from tidings.message.uuid import OUTSIDE_TXN, ProducerID, build_uuid, new_clock, new_producer_id, parse, uuid_to_str
from tidings.protocol import validate
from tidings.protocol.status import UsageError, ValidationError

__all__ = ["Target", "Targets", "WalEntry", "WalMutation", "WalWriter"]


class WalMutation(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Set `key` to the JSON `value`, or delete it. The value stays raw JSON from writer to target."""

    key: str
    value: msgspec.Raw = msgspec.Raw(b"null")
    delete: bool = False


class WalEntry(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """One transaction as the WAL holds it: its mutations grouped by target id."""

    parts: dict[str, list[WalMutation]] = {}  # (none in a transactional producer's ACK message)
    uuid: str = ""
    committed_ns: int = 0  # when the transaction manager sent it (the paper's commit time)


class Target(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    endpoint: str


class _TargetsFile(msgspec.Struct, forbid_unknown_fields=True):
    targets: list[Target]


class Targets:
    """The declared targets (targets.yaml) and the key -> target mapping."""

    def __init__(self, targets: Iterable[Target]) -> None:
        self.targets = list(targets)
        if not self.targets:
            raise ValidationError("targets", "declare at least one target (id and endpoint)")
        self.by_id: dict[str, Target] = {}
        for i, t in enumerate(self.targets):
            validate.shard_id(t.id, f"targets[{i}].id")
            host, colon, port = t.endpoint.rpartition(":")
            if not colon or not host or not port.isdigit():
                raise ValidationError("", f"targets[{i}].endpoint {t.endpoint!r} is not HOST:PORT")
            if t.id in self.by_id:
                raise ValidationError("", f"targets[{i}].id {t.id!r} is declared twice")
            self.by_id[t.id] = t
        self.ids = [t.id for t in self.targets]
        self._cache: dict[str, int] = {}

    @classmethod
    def load(cls, path: str | Path) -> Targets:
        """Read targets.yaml (ValidationError naming the file and what is wrong)."""
        import yaml

        try:
            doc = yaml.safe_load(Path(path).read_text())
            return cls(msgspec.convert(doc, _TargetsFile).targets)
        except OSError as exc:
            raise UsageError(f"cannot read the targets file {path}: {exc.strerror}") from None
        except (yaml.YAMLError, msgspec.ValidationError, ValidationError) as exc:
            raise ValidationError("", f"{path}: {str(exc).splitlines()[0]}") from None

    def target_of(self, key: str) -> str:
        return rendezvous_pick(self.ids, zlib.crc32(key.encode()), self._cache)


class WalWriter:
    """Appends transactions to the WAL journal `wal`; see the module docstring.

    Usage::

        writer = WalWriter(client, "wal/orders", Targets.load("targets.yaml"))
        index = await writer.append([{"key": "k1", "value": {"n": 1}}, {"key": "k2", "delete": True}])
    """

    def __init__(
        self,
        client: AsyncClient,
        wal: str,
        targets: Targets,
        *,
        producer: ProducerID | None = None,
        service: AppendService | None = None,
    ) -> None:
        self.client = client
        self.wal = wal
        self.targets = targets
        self.producer = producer if producer is not None else new_producer_id()
        self.clock = new_clock()
        self.service = service if service is not None else AppendService(client)
        self._own_service = service is None
        self._framing: Framing | None = None
        self._order = asyncio.Lock()  # appends queue one at a time, each with a clock above the last
        self._queued = -1  # the newest clock of this producer queued
        self._unqueued: set[int] = set()  # clocks prepare() gave that no append queued yet

    def prepare(self, mutations: Iterable[WalMutation | Mapping[str, Any]], uuid: str = "") -> WalEntry:
        """A transaction of `mutations` (WalMutations or their dicts), parts grouped by target, with
        a new UUID (or `uuid`, the one an earlier attempt gave it). Keep it, or its UUID, to append
        it again after a failure whose outcome is unknown."""
        parts: dict[str, list[WalMutation]] = {}
        for i, m in enumerate(mutations):
            if not isinstance(m, WalMutation):
                m = _mutation(m, i)
            parts.setdefault(self.targets.target_of(m.key), []).append(m)
        if not parts:
            raise ValidationError("", "a transaction needs at least one mutation")
        if uuid:
            try:
                _, _, flags = parse(uuid)
            except ValueError as exc:
                raise ValidationError("", f"uuid {uuid!r}: {exc}: give the uuid an earlier attempt printed") from None
            if flags != OUTSIDE_TXN:
                raise ValidationError(
                    "", f"uuid {uuid!r} is not of a committed message: give the one an attempt printed"
                )
            return WalEntry(parts=parts, uuid=uuid)
        self.clock.update()
        clock = self.clock.tick()
        self._unqueued.add(clock)
        return WalEntry(parts=parts, uuid=uuid_to_str(build_uuid(self.producer, clock, OUTSIDE_TXN)))

    async def append(self, txn: WalEntry | Iterable[WalMutation | Mapping[str, Any]]) -> int:
        """Append a transaction (mutations, or a prepared `WalEntry`: appended again as it is after a
        failure); returns its index once the WAL committed it.

        The read-committed reader takes a clock at or below its producer's newest for a duplicate, so
        appends queue in clock order: mutations get their UUID once it is their turn, and a prepared
        entry appended after a newer one of this writer is refused (a retry of one already queued is
        not: that is what a retry is)."""
        entry = txn if isinstance(txn, WalEntry) else None
        if entry is not None and not entry.uuid:
            raise ValidationError("", "a WalEntry appended needs the uuid prepare() gave it")
        if entry is not None and not any(entry.parts.values()):
            raise ValidationError("", "a transaction needs at least one mutation")
        async with self._order:
            if self._framing is None:
                self._framing = await journal_framing(self.client, self.wal)
            if entry is None:
                entry = self.prepare(txn)  # type: ignore[arg-type]  # (entry is None: txn is no WalEntry)
            unknown = [t for t in entry.parts if t not in self.targets.by_id]
            if unknown:
                raise ValidationError("", f"the transaction names targets {unknown} that targets.yaml does not declare")
            producer, clock, _ = parse(entry.uuid)
            if producer == self.producer and clock in self._unqueued:
                if clock < self._queued:
                    raise UsageError(
                        "append a WalWriter's prepared transactions in the order prepare() made them: this one "
                        "would be taken for a duplicate of a newer one"
                    )
                self._unqueued.discard(clock)
                self._queued = clock
            if not entry.committed_ns:
                entry.committed_ns = time.time_ns()
            committed = await self.service.append(self.wal, self._framing.marshal(entry))
        return (await committed).begin

    async def aclose(self) -> None:
        if self._own_service:
            await self.service.aclose()


def _mutation(m: Mapping[str, Any], i: int) -> WalMutation:
    if not isinstance(m, Mapping):
        raise ValidationError(f"mutation {i}", "give {'key': str, 'value': JSON} or {'key': str, 'delete': true}")
    if ("value" in m) == bool(m.get("delete")):  # (neither would store null; both is ambiguous)
        raise ValidationError(
            f"mutation {i}",
            f"{'both' if 'value' in m else 'neither'} 'value' {'and' if 'value' in m else 'nor'} 'delete': true: "
            "give {'key': str, 'value': JSON} to set the key, or {'key': str, 'delete': true} to delete it",
        )
    try:
        return msgspec.convert({**m, "value": msgspec.Raw(msgspec.json.encode(m.get("value")))}, WalMutation)
    except (msgspec.ValidationError, TypeError) as exc:
        raise ValidationError(
            f"mutation {i}", f"{exc}: give {{'key': str, 'value': JSON}} or {{'key': str, 'delete': true}}"
        ) from None
