"""KeySpace: a local mirror of an etcd prefix, loaded at a revision and kept current by a watch.

Gazette's KeySpace (gazette-transactional-appends.txt, *Components*): every broker mirrors the
keys of its cluster root, so that routing and allocation decisions are local reads, and any
party can compare the etcd revision its decision was made at with a peer's.

Guarantees
- ``kvs`` is sorted by key and holds exactly the decodable keys of etcd's state at
  ``revision``: every change at a revision <= ``revision`` is applied, none after it.
- Observers (``add_observer``) are called synchronously, on the event loop, after a whole watch
  batch (every event of one etcd response, possibly several revisions) has been applied *and*
  ``revision`` updated. They never see a half-applied batch, and no other task runs between the
  update and the observer calls. A progress notification (no events) also advances ``revision``
  and calls the observers.
- A key whose value ``decode`` rejects (ValueError, including ValidationError) is logged with
  the reason and left out of ``kvs``; it never stops the mirror. A later valid value brings it
  back.
- ``wait_for_revision(rev)`` returns once ``revision >= rev``. A revision learned from a peer may
  have been produced by writes outside this prefix, which no watch event will ever report; if
  the watch does not get there quickly, the KeySpace *proves* it is already current: a keys-only
  Range of the prefix returning the same key count and the same largest mod revision as the
  mirror means no change reached the prefix after the mirror's last event (any surviving write
  would raise the largest mod revision; any net deletion would lower the count), so the mirror
  equals etcd's state at that Range's revision and may claim it. (etcd 3.4's on-request progress
  notifications can overtake pending events, so they are not used for this.)
- The watch resumes from ``revision + 1`` after a transport failure (with backoff up to
  ``_BACKOFF_MAX``: an etcd that restarts on its data dir is picked up within about a second),
  and reloads the whole prefix if etcd compacted that revision away. Meanwhile the mirror stays
  readable at its last revision. An outage logs one warning when it starts and one line when the
  watch resumes.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidings.keyspace.etcd import KV, CompactedError, Etcd, WatchBatch
from tidings.protocol.status import TransportError

__all__ = ["KeySpace", "KeyValue"]

log = logging.getLogger(__name__)

Decoder = Callable[[str, bytes], Any]

_BACKOFF_MIN = 0.05
_BACKOFF_MAX = 1.0
_PROBE_DELAY_MIN = 0.02  # how long wait_for_revision lets the watch catch up before probing
_PROBE_DELAY_MAX = 1.0


@dataclass(frozen=True, slots=True)
class KeyValue:
    """A mirrored key: its raw value, the decoder's result, and etcd's revisions."""

    key: str
    raw: bytes
    decoded: Any
    create_revision: int
    mod_revision: int
    lease: int


def _prefix_end(prefix: str) -> str:
    """The smallest string greater than every string starting with ``prefix``."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class KeySpace:
    """A mirror of every key under ``{root}/``, decoded by ``decode(key, raw)``.

    Usage::

        ks = KeySpace("/tidings/cluster", decoder("/tidings/cluster"))
        await ks.start(etcd)          # load, then watch in a background task
        await ks.wait_for_revision(rev_from_a_peer)
        spec = ks.get("/tidings/cluster/items/a/b")
        await ks.aclose()
    """

    def __init__(self, root: str, decode: Decoder) -> None:
        self.root = root.rstrip("/")
        self.prefix = self.root + "/"
        self.revision = 0
        self.kvs: list[KeyValue] = []
        self._keys: list[str] = []  # parallel to kvs, for bisect
        self._invalid: dict[str, int] = {}  # undecodable key -> its mod revision (it exists in etcd)
        self._decode = decode
        self._observers: list[Callable[[], None]] = []
        self._changed = asyncio.Event()
        self._etcd: Etcd | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._probe_task: asyncio.Task[None] | None = None

    # --- reading ---

    def get(self, key: str) -> KeyValue | None:
        i = bisect.bisect_left(self._keys, key)
        if i < len(self._keys) and self._keys[i] == key:
            return self.kvs[i]
        return None

    def prefixed(self, prefix: str) -> list[KeyValue]:
        """Every mirrored key starting with ``prefix``, sorted by key."""
        if not prefix:
            return list(self.kvs)
        lo = bisect.bisect_left(self._keys, prefix)
        hi = bisect.bisect_left(self._keys, _prefix_end(prefix), lo)
        return self.kvs[lo:hi]

    def add_observer(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after each applied batch or load (see the module docstring for atomicity)."""
        self._observers.append(fn)

    # --- loading and watching ---

    async def load(self, etcd: Etcd) -> None:
        """Replace the mirror with the prefix as of one etcd revision."""
        kvs, revision = await etcd.get_prefix(self.prefix)
        self._etcd = etcd
        self.kvs, self._keys, self._invalid = [], [], {}
        for kv in kvs:
            decoded = self._decode_or_none(kv)
            if decoded is not _INVALID:
                self.kvs.append(self._key_value(kv, decoded))
                self._keys.append(kv.key)
        self.revision = max(self.revision, revision)
        self._notify()

    async def start(self, etcd: Etcd, *, load: bool = True) -> None:
        """Load, then keep the mirror current from ``revision + 1`` in task ``keyspace-watch:{root}``.

        ``load=False`` skips the load, continuing from an earlier ``load()``.
        """
        if self._watch_task is not None:
            raise RuntimeError(f"KeySpace {self.root!r} is already started")
        if load or self._etcd is None:
            await self.load(etcd)
        self._watch_task = asyncio.create_task(self._watch_loop(etcd), name=f"keyspace-watch:{self.root}")
        self._watch_task.add_done_callback(self._on_watch_done)

    async def aclose(self) -> None:
        """Stop watching; the mirror stays readable but no longer advances."""
        for task in (self._watch_task, self._probe_task):
            if task is not None and not task.done():
                task.cancel()
        tasks = [t for t in (self._watch_task, self._probe_task) if t is not None]
        if tasks:
            # wait() neither raises the tasks' outcomes (a dead watch was logged by its done
            # callback) nor swallows a cancellation of aclose() itself.
            await asyncio.wait(tasks)
        self._watch_task = self._probe_task = None
        self._changed.set()  # wake waiters so they re-check (they will time out or keep waiting)
        self._changed = asyncio.Event()

    def _on_watch_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("keyspace watch of %s died", self.root, exc_info=task.exception())

    async def _watch_loop(self, etcd: Etcd) -> None:
        backoff = _BACKOFF_MIN
        failing_since: float | None = None  # when the current run of failures began
        while True:
            try:
                async with etcd.watch(self.prefix, self.revision + 1) as watch:
                    async for batch in watch:
                        if failing_since is not None:
                            log.info(
                                "keyspace %s: watch resumed after %.1fs, at revision %d",
                                self.root,
                                time.monotonic() - failing_since,
                                batch.revision,
                            )
                            failing_since = None
                        self._apply(batch)
                        backoff = _BACKOFF_MIN
            except CompactedError as err:
                log.warning("keyspace %s: watch from %d compacted (%s); reloading", self.root, self.revision + 1, err)
                try:
                    await self.load(etcd)
                except TransportError as load_err:
                    log.warning("keyspace %s: reload failed, retrying in %.2fs: %s", self.root, backoff, load_err)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX)
            except TransportError as err:
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning(
                        "keyspace %s: watch failed (%s); resuming from revision %d once etcd answers",
                        self.root,
                        err,
                        self.revision + 1,
                    )
                else:
                    log.debug("keyspace %s: watch still failing, retrying in %.2fs: %s", self.root, backoff, err)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)

    def _apply(self, batch: WatchBatch) -> None:
        """Apply one watch batch, then advance ``revision`` and notify (no await: atomic)."""
        for ev in batch.events:
            kv = ev.kv
            if kv.mod_revision <= self.revision:
                continue  # already covered by a probe that proved the mirror current past it
            i = bisect.bisect_left(self._keys, kv.key)
            present = i < len(self._keys) and self._keys[i] == kv.key
            if ev.type == "delete":
                self._invalid.pop(kv.key, None)
                if present:
                    del self.kvs[i]
                    del self._keys[i]
                continue
            decoded = self._decode_or_none(kv)
            if decoded is _INVALID:
                if present:
                    del self.kvs[i]
                    del self._keys[i]
                continue
            self._invalid.pop(kv.key, None)
            item = self._key_value(kv, decoded)
            if present:
                self.kvs[i] = item
            else:
                self.kvs.insert(i, item)
                self._keys.insert(i, kv.key)
        if batch.revision > self.revision:
            self.revision = batch.revision
        self._notify()

    def _decode_or_none(self, kv: KV) -> Any:
        try:
            decoded = self._decode(kv.key, kv.value)
        except ValueError as err:
            log.warning("keyspace %s: skipping key %s: %s", self.root, kv.key, err)
            self._invalid[kv.key] = kv.mod_revision
            return _INVALID
        except Exception:
            log.exception("keyspace %s: decoder failed on key %s; skipping it", self.root, kv.key)
            self._invalid[kv.key] = kv.mod_revision
            return _INVALID
        return decoded

    @staticmethod
    def _key_value(kv: KV, decoded: Any) -> KeyValue:
        return KeyValue(kv.key, kv.value, decoded, kv.create_revision, kv.mod_revision, kv.lease)

    def _notify(self) -> None:
        for fn in list(self._observers):
            try:
                fn()
            except Exception:
                log.exception("keyspace %s: observer %r failed", self.root, fn)
        self._changed.set()
        self._changed = asyncio.Event()

    # --- waiting ---

    async def wait_for_revision(self, rev: int, timeout: float | None = None) -> None:
        """Return once ``revision >= rev``; TimeoutError after ``timeout`` seconds.

        Cancellation leaves the KeySpace unchanged.
        """
        async with asyncio.timeout(timeout):
            delay = _PROBE_DELAY_MIN
            while self.revision < rev:
                changed = self._changed
                try:
                    await asyncio.wait_for(changed.wait(), delay)
                except TimeoutError:
                    await self._probe()
                    delay = min(delay * 2, _PROBE_DELAY_MAX)

    async def wait_for_update(self, after_revision: int, timeout: float | None = None) -> None:
        """Return once ``revision > after_revision`` (the next change, or progress notification)."""
        async with asyncio.timeout(timeout):
            while self.revision <= after_revision:
                await self._changed.wait()

    async def _probe(self) -> None:
        """Prove the mirror current at etcd's present revision, if it is (see the module docstring)."""
        if self._etcd is None:
            return  # never loaded: nothing to prove
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.create_task(self._probe_once(self._etcd), name=f"keyspace-probe:{self.root}")
        await asyncio.shield(self._probe_task)

    async def _probe_once(self, etcd: Etcd) -> None:
        try:
            count, top, header_rev = await etcd.prefix_summary(self.prefix)
        except TransportError as err:
            log.debug("keyspace %s: probe failed: %s", self.root, err)
            return
        if header_rev <= self.revision:
            return
        local_count = len(self.kvs) + len(self._invalid)
        local_top = max(
            max((kv.mod_revision for kv in self.kvs), default=0),
            max(self._invalid.values(), default=0),
        )
        if count == local_count and top == local_top:
            self.revision = header_rev
            self._notify()


_INVALID: Any = object()
