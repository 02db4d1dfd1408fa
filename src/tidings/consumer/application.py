"""Application and Shard: what a user's consumer implements, and what it sees of the shard it runs in
(Gazette's consumer/interfaces.go). They sit below the primary (`shard.serve_primary`) and its
transaction loop (`transaction`), which both drive an Application on a Shard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tidings.client import AsyncClient
from tidings.consumer.recoverylog.recorder import Recorder
from tidings.consumer.store import Store
from tidings.message import Checkpoint, Envelope, Garbage, Publisher
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import UsageError

__all__ = ["Application", "Shard", "TxnStats"]

log = logging.getLogger(__name__)


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
    # With a recovery log: what records the primary's store directory, and that directory (sqlite_store).
    recorder: Recorder | None = None
    recovery_dir: Path | None = None
    _moved: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def path(self, suffix: str = ".db") -> Path:
        """The shard's own file in `data_dir` (its id quoted: '/' and all make one file name), e.g. for
        a SQLiteStore: ``SQLiteStore(shard.path())``."""
        if self.spec.recovery_log_prefix:
            raise UsageError(
                f"shard {self.spec.id!r} has a recovery log: its files must be recorded, so another process can "
                "play them back; make its store with tidings.consumer.sqlite_store(shard, schema)"
            )
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


class Application:
    """A user's consumer (Gazette's Application): subclass it. `new_store` and `consume_message` are
    required; every other hook does nothing unless overridden:

    - `new_message(journal_spec) -> type | None`: what source messages decode into (None: the
      framing's default, dicts for JSON);
    - `begin_txn(shard, store)`: as a transaction begins;
    - `finalize_txn(shard, store, publisher)`: as it closes, before its commit (the last writes);
    - `finished_txn(shard, store, commit)`: as its commit starts (the future resolves once the
      store committed; what it publishes belongs to the next transaction);
    - `on_garbage(shard, journal, garbage)`: an undecodable range, called as the bytes are decoded
      (a plain function: raise to fail the shard); the default logs it and skips it.

    Hooks may be coroutines or plain functions (a SQLite application that only changes its store,
    say); publishing is async, so an application that publishes does it from async hooks.
    """

    def new_store(self, shard: Shard) -> Store:
        raise NotImplementedError(f"{type(self).__name__} must give its shards a store: define new_store")

    def consume_message(self, shard: Shard, store: Store, envelope: Envelope, publisher: Publisher) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must consume messages: define consume_message")

    def new_message(self, journal_spec: pb.JournalSpec) -> Any:
        return None

    def begin_txn(self, shard: Shard, store: Store) -> Any:
        return None

    def finalize_txn(self, shard: Shard, store: Store, publisher: Publisher) -> Any:
        return None

    def finished_txn(self, shard: Shard, store: Store, commit: asyncio.Future[None]) -> Any:
        return None

    def on_garbage(self, shard: Shard, journal: str, garbage: Garbage) -> None:
        log.warning("shard %s: skipped undecodable bytes of journal %s [%d, %d): %s", shard.spec.id, journal,
                    garbage.begin, garbage.end, garbage.error)  # fmt: skip


@dataclasses.dataclass(slots=True)
class TxnStats:
    """A finished transaction, for metrics (`Shard.on_transaction`): messages consumed and seconds
    spent in each phase."""

    messages: int
    consuming: float  # first message to close
    committing: float  # finalize_txn, the previous ACKs, the store commit
    acknowledging: float = 0.0  # writing the ACKs after the commit
