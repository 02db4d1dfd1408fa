"""Replica: one broker's share of one journal (its Spool, Pipeline, fragment index and daemons).

Ownership follows Gazette's one-slot channels: `spool_slot` and `pipeline_slot` are `Slot`s
filled at construction (the pipeline slot with ``None``: none built yet). ``await slot.get()``
acquires; ``slot.put_nowait(x)`` in a ``finally`` releases. Release is synchronous so cancellation
cannot interrupt it, and a double release raises ``QueueFull``. As a Go channel, a release hands the
token to the longest waiter: appends to a journal take its pipeline in the order they asked for it.
A Replicate RPC (peer side) owns the spool for its stream's life; on the primary, the Pipeline
owns the spool and an AppendFSM owns the pipeline's send side. A pipeline's shutdown returns
the spool synchronously, so no exception or cancellation can leak either token
(`tokens_idle()` lets tests check).

The replica's tasks (store refreshes, the pulse, pipeline teardowns, roll-backs of abandoned
appends) are its own: `aclose()` cancels and awaits them, as Gazette's replica context.

Starting, a replica first recovers what a previous process of this broker left on disk for the
journal (`fragment.spool.recover`): the spool resumes at the committed end and registers it had,
so a broker restarted on its data dir hands no offset out twice, and the committed fragments it
found wait in `unverified` until `broker.recovery` checked them against the journal's other
replicas and stores; then they join the index (and are persisted) or are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from tidings.broker import _metrics as metrics
from tidings.broker.flow import AppendFlow
from tidings.fragment import retention
from tidings.fragment.fragment import Fragment
from tidings.fragment.index import FragmentIndex
from tidings.fragment.spool import Recovered, Spool, SpoolFile, recover
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb

if TYPE_CHECKING:
    from tidings.broker.pipeline import Pipeline
    from tidings.fragment.persister import Persister

log = logging.getLogger(__name__)

GAP_REFRESH = 0.25  # seconds between store listings while a gap is not yet covered
FAILED_REFRESH_BACKOFF = (0.25, 5.0)  # first and largest pause after a failed listing


def stores_of(spec: pb.JournalSpec, default_store: str) -> list[str]:
    """A journal's fragment stores: its spec's, else the broker's default store ("" keeps it local)."""
    if spec.fragment.stores:
        return list(spec.fragment.stores)
    return [default_store] if default_store else []


def spool_directory(data_dir: Path, journal: str) -> Path:
    return data_dir / "spools" / journal.replace("/", "%2F")


class Verifier(Protocol):
    """Checks the fragments a replica recovered before they are served or persisted (the broker's:
    `broker.recovery.RecoveryChecks`, which asks the journal's other members, so it sits above this
    module and is handed in)."""

    async def before_sync(self, replica: Replica) -> int | None:
        """Before the spool resumes: drop what the journal contradicts -> where to resume instead
        (None: at the recovered end)."""
        ...

    async def after_sync(self, replica: Replica) -> None:
        """Once a pipeline synchronized the spool: adopt or drop each fragment still unverified."""
        ...


class Replica:
    """A local replica of `journal`: created when this broker is assigned it, closed when unassigned.

    **Parameters:**
    * `default_store` - the store of a journal whose spec names none ("" keeps it local).
    * `persist_delay` - seconds a replica waits before persisting a fragment the primary did not
      (Gazette's replica persister queues).
    * `recovered` - what this broker's previous process left for the journal, if already read.
    * `journal_revision` - the create revision of the journal's spec (a journal deleted and
      created again does not inherit the old one's spool).
    * `recovery` - checks the recovered fragments (a `Verifier`); without it they are adopted as found.
    """

    def __init__(
        self,
        journal: str,
        spec: pb.JournalSpec,
        data_dir: Path,
        persister: Persister,
        *,
        default_store: str = "",
        persist_delay: float = 60.0,
        recovered: Recovered | None = None,
        journal_revision: int = 0,
        recovery: Verifier | None = None,
    ) -> None:
        self.journal = journal
        self.spec = spec
        self.flow = AppendFlow()  # (its appends' rate, while primary: kept across Append RPCs)
        self.persister = persister
        self.default_store = default_store
        self.persist_delay = persist_delay
        self.index = FragmentIndex(journal)
        self.directory = spool_directory(data_dir, journal)
        self.journal_revision = journal_revision  # the spec's create revision: which journal of this name
        self._spool = Spool(journal, self.directory, observer=self)
        self._spool.journal_revision = journal_revision
        # The spool enters its slot only once recovered (`_recover`): nobody may take it before.
        self.spool_slot: Slot[Spool] = Slot()
        self._spool_released = False
        self.pipeline_slot: Slot[Pipeline | None] = Slot()
        self.pipeline_slot.put_nowait(None)
        self.closed = asyncio.Event()
        self.route_changed = asyncio.Event()  # set (and replaced) whenever the route or spec changes
        self.store_error: str | None = None  # why the latest store listing failed, if it did
        self.failed_store: str | None = None  # the store whose listing failed then (with `store_error`)
        self._refreshed = asyncio.Event()  # set after every listing attempt, successful or not
        self._recovered = recovered
        self._recovery = recovery
        self.unverified: list[tuple[Fragment, SpoolFile]] = []  # recovered, not yet checked (never served)
        # Set once a pipeline of this replica's route synchronized the spool (every member is then at or
        # past the end it recovered): from then on, what members hold below it is final.
        self.synchronized = asyncio.Event()
        self.end_at_close: int | None = None  # the spool's committed end when the replica closed
        self._deleted = False  # the journal is gone: nothing of it is persisted any more
        self._tasks: set[asyncio.Task[None]] = set()
        self._refresh_lock = asyncio.Lock()
        self._refreshed_at = 0.0  # monotonic time the last successful listing began

    def __repr__(self) -> str:
        return f"Replica({self.journal!r})"

    @property
    def write_head(self) -> int:
        """Where the next append lands, as far as this replica knows: its index's end, or its
        spool's when retention removed every fragment of an idle journal (the index is then empty,
        but appends go on from the spool's end: a head that went back to 0 reads as a reset)."""
        return max(self.index.end_offset, self._spool.end)

    @property
    def synchronized_spool_end(self) -> int | None:
        """The spool's end once a pipeline synchronized it (where an append without an explicit offset
        lands), else None: a replica recovering or just joined does not know it yet."""
        return self._spool.end if self.synchronized.is_set() else None

    @property
    def stores(self) -> list[str]:
        return stores_of(self.spec, self.default_store)

    # -- SpoolObserver ---------------------------------------------------------------------

    def spool_commit(self, fragment: Fragment, file: SpoolFile) -> None:
        self.index.add_local(fragment, file)

    def spool_complete(self, fragment: Fragment, file: SpoolFile, primary: bool) -> None:
        self.index.add_local(fragment, file)
        stores = self.stores
        if stores and not self._deleted:
            self.persister.submit(fragment, file, stores[0], delay=0.0 if primary else self.persist_delay)

    def spool_gap(self, begin: int, end: int) -> None:
        """Content of [begin, end) lives only on the replica that committed it (a primary died between its
        peers), which persists it as its spool rolls: list the stores often until the index covers it,
        rather than leaving readers waiting a whole refresh interval."""
        if not self.closed.is_set():
            self.spawn(self._refresh_until_covered(begin), f"gap:{self.journal}")

    async def _refresh_until_covered(self, offset: int) -> None:
        deadline = asyncio.get_running_loop().time() + max(self.spec.fragment.refresh_interval_ms / 1000, 1.0)
        while self.index.query(offset) is None and asyncio.get_running_loop().time() < deadline:
            with contextlib.suppress(Exception):  # the periodic refresh reports failures
                await self.refresh_now()
            if await self._closed_within(GAP_REFRESH):
                return

    def fragment_persisted(self, fragment: Fragment, file: Any) -> None:
        """The persister stored `fragment`: its file may go once the spool is done with it, and a
        listing now swaps the local index entry for the remote one."""
        if isinstance(file, SpoolFile):
            file.mark_persisted(fragment.end)
        if not self.closed.is_set():
            self.spawn(self.refresh_now(), f"refresh-now:{self.journal}")

    def roll_back_abandoned(self, pipeline: Pipeline) -> None:
        """An append was cancelled after streaming content: roll it back on every replica from a task of
        ours, then hand the pipeline on (its acknowledgements are read by the pipeline, in order). The
        token goes back on every path, even if that task is cancelled before it starts."""
        returned = False

        def give_back(token: Pipeline | None) -> None:
            nonlocal returned
            if not returned:
                returned = True
                if token is None:
                    pipeline.shutdown()
                self.pipeline_slot.put_nowait(token)

        async def roll_back() -> None:
            try:
                spool = pipeline.spool
                req = pb.ReplicateRequest(
                    proposal=spool.fragment.to_proto(), registers=spool.registers, acknowledge=True
                )
                await pipeline.scatter(req, require_ok=True)
            except BaseException:
                give_back(None)
                raise
            give_back(pipeline)
            metrics.ROLLBACKS.inc()

        task = self.spawn(roll_back(), f"rollback:{pipeline.spool.journal}")
        task.add_done_callback(lambda _: give_back(None))

    async def tear_down_pipeline(self) -> None:
        """Shut the pipeline down (once no append holds it), leaving the slot empty."""
        pipeline = await self.pipeline_slot.get()
        try:
            if pipeline is not None:
                pipeline.shutdown()
        finally:
            self.pipeline_slot.put_nowait(None)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run `coro` as one of the replica's tasks (cancelled and awaited by aclose). A task may be
        cancelled before its first step: what it must release goes in a done-callback."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("journal %s: task %s failed", self.journal, task.get_name(), exc_info=task.exception())

    def return_spool(self, spool: Spool) -> None:
        self.spool_slot.put_nowait(spool)

    def tokens_idle(self) -> bool:
        """Nothing owns the pipeline, and the spool is in its slot or held by the idle pipeline."""
        if not self.pipeline_slot.full():
            return False
        pipeline = self.pipeline_slot.get_nowait()
        self.pipeline_slot.put_nowait(pipeline)
        return self.spool_slot.full() if pipeline is None else not self.spool_slot.full()

    # -- lifecycle -------------------------------------------------------------------------

    def update(self, spec: pb.JournalSpec) -> None:
        """The spec or route changed: wake everything waiting on the old view."""
        self.spec = spec
        self.route_changed.set()
        self.route_changed = asyncio.Event()

    def start(
        self, pulse: Callable[[Replica], Coroutine[Any, Any, None]], after: asyncio.Future[None] | None = None
    ) -> None:
        """Recover, then run the daemons; first wait for `after` (the close of this journal's previous
        replica on this broker, which uses the same spool directory)."""
        self.spawn(self._start(pulse, after), f"start:{self.journal}")

    async def _start(
        self, pulse: Callable[[Replica], Coroutine[Any, Any, None]], after: asyncio.Future[None] | None
    ) -> None:
        if after is not None:
            await asyncio.wait([after])
        # Listing first: members checking their own recovered fragments against ours wait for it.
        self.spawn(self._refresh_loop(), f"refresh:{self.journal}")
        await self._recover()
        self.spawn(pulse(self), f"pulse:{self.journal}")
        if self.unverified:
            if self._recovery is None:
                for frag, file in list(self.unverified):
                    self.adopt(frag, file)
            else:
                self.spawn(self._recovery.after_sync(self), f"verify:{self.journal}")

    def _release_spool(self) -> None:
        """Put the spool in its slot for the first time (once recovered, or when closing before that)."""
        if not self._spool_released:
            self._spool_released = True
            self.spool_slot.put_nowait(self._spool)

    async def _recover(self) -> None:
        """Take up what this broker's previous process left for the journal (see the module docstring).
        The spool is in nobody's hands meanwhile: it enters its slot only afterwards."""
        spool = self._spool
        try:
            rec = self._recovered
            self._recovered = None
            if rec is None:
                rec = await asyncio.to_thread(recover, self.journal, self.directory, self.journal_revision)
            self.unverified = [(frag, file) for frag, file in rec.fragments if not file.unlinked]
            end = rec.end
            if self.unverified and self._recovery is not None:
                try:
                    dropped_at = await self._recovery.before_sync(self)
                except Exception:  # never resume below what we may have committed for a failed check
                    log.exception("journal %s: checking recovered fragments before resuming failed", self.journal)
                    dropped_at = None
                end = end if dropped_at is None else min(end, dropped_at)
            if rec.end and spool.end == 0 and spool.delta == 0:
                spool.resume(end, rec.registers, rec.codec)  # HEAD too: never past what was dropped
                log.info(
                    "journal %s: recovered the spool at offset %d (%d local fragments to check)",
                    self.journal,
                    end,
                    len(self.unverified),
                )
        finally:
            self._release_spool()

    def adopt(self, frag: Fragment, file: SpoolFile) -> None:
        """A recovered fragment held up: serve it and persist it."""
        with contextlib.suppress(ValueError):
            self.unverified.remove((frag, file))
        if file.unlinked:
            return  # persisted meanwhile
        self.index.add_local(frag, file)
        stores = self.stores
        if stores and not self._deleted:
            self.persister.submit(frag, file, stores[0], delay=0.01)

    async def _refresh_loop(self) -> None:
        """List the fragment stores every refresh interval (the index's remote half); after a failed
        listing, retry sooner with backoff."""
        backoff = FAILED_REFRESH_BACKOFF[0]
        while True:
            interval = max(self.spec.fragment.refresh_interval_ms, 1000) / 1000
            try:
                await self.refresh_now()
                backoff = FAILED_REFRESH_BACKOFF[0]
            except Exception as exc:  # a store outage must not kill the replica
                log.warning("journal %s: listing fragment stores failed: %s", self.journal, exc)
                interval, backoff = backoff, min(backoff * 2, FAILED_REFRESH_BACKOFF[1])
            if await self._closed_within(interval):
                return

    async def _closed_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.closed.wait()
        return self.closed.is_set()

    async def refresh_soon(self) -> None:
        """`refresh_now()`, unless a listing finished within the last second, or one that started after
        we asked finished while we waited for the lock (many readers arriving together at a hole)."""
        asked = time.monotonic()
        if asked - self._refreshed_at < 1.0:
            return
        async with self._refresh_lock:
            if self._refreshed_at < asked:
                await self._refresh_locked()

    async def refresh_now(self) -> None:
        """List every store and replace the index's remote half (serialized: a stale listing must
        never be applied after a newer one). Local entries the listing covers leave the index, and
        their files are known persisted."""
        async with self._refresh_lock:
            await self._refresh_locked()

    async def _refresh_locked(self) -> None:
        started = time.monotonic()
        found: list[Fragment] = []
        url = ""
        try:
            for url in self.stores:  # in order: the primary store (where fragments persist) first
                found.extend(await asyncio.to_thread(_list, url, self.journal))
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self.store_error, self.failed_store = f"{type(exc).__name__}: {exc}", url
                self._wake_refresh_waiters()
            raise
        self.store_error = self.failed_store = None
        self._refreshed_at = started  # a listing begun then sees everything persisted before
        for frag, file in self.index.replace_remote(found):
            if isinstance(file, SpoolFile):
                file.mark_persisted(frag.end)
        self._wake_refresh_waiters()

    async def prune(self, now: float | None = None) -> retention.Plan | None:
        """Remove the persisted fragments the spec's retention lets go (`fragment.retention`), then list
        the stores again so the index forgets them at once. None when retention is off or there are
        no stores. Called on the journal's primary only (one broker removes, readers see it first)."""
        retention_s = self.spec.fragment.retention_ms / 1000
        if retention_s <= 0 or not self.stores or self.closed.is_set():
            return None
        await self.refresh_now()
        held = [frag for frag, _file in self.index.fragments()]
        plan = retention.plan(self.journal, held, retention_s, time.time() if now is None else now)
        if plan.aged:
            await asyncio.to_thread(retention.remove, plan.aged)
            log.info("journal %s: retention removed %d fragments [%d, %d) (%d bytes); it now starts at %d",
                     self.journal, len(plan.aged), min(f.begin for f in plan.aged), max(f.end for f in plan.aged),
                     plan.aged_bytes, plan.begin)  # fmt: skip
            await self.refresh_now()
        return plan

    def _wake_refresh_waiters(self) -> None:
        refreshed, self._refreshed = self._refreshed, asyncio.Event()
        refreshed.set()

    def primary_store_error(self) -> str | None:
        """Why the latest listing of the journal's primary store failed, or None while it is healthy
        (or the journal has no store). The primary store is the spec's first, where fragments persist;
        a listing stops at the first store that fails, so a failure of a further one means the primary
        store listed well. An error recorded for a store the spec no longer names first is not its."""
        stores = self.stores
        if self.store_error is not None and stores and self.failed_store == stores[0]:
            return self.store_error
        return None

    async def wait_ready(self) -> str | None:
        """Wait for the first store listing; None once it is applied, or the store's error while
        listing fails (the caller answers FRAGMENT_STORE_UNHEALTHY)."""
        while not self.index.first_refresh:
            if self.store_error is not None:
                return self.store_error
            await self._refreshed.wait()
        return None

    async def aclose(self, deleted: bool = False) -> None:
        """Stop daemons, shut the pipeline down, complete the spool (its fragment is persisted).

        `deleted`: the journal is gone, and so go its spool files.
        """
        self._deleted = deleted
        self.closed.set()
        self.route_changed.set()
        await cancel_and_wait(*self._tasks)
        self._release_spool()  # closed before it was recovered
        await self.tear_down_pipeline()
        spool = await self.spool_slot.get()
        try:
            # Persisted at once, not after the replicas' delay: the journal's other replicas may be leaving
            # too, and a broker restarted meanwhile checks what it recovered only against the route's
            # members and the store (broker/recovery.py): bytes only here, waiting, are in neither.
            spool.close(primary=True)
            self.end_at_close = spool.end
        finally:
            self.spool_slot.put_nowait(spool)
        tasks = list(self._tasks)  # the pipeline's teardown
        if tasks:
            await asyncio.wait(tasks, timeout=15)
            await cancel_and_wait(*self._tasks)
        if deleted:
            await asyncio.to_thread(shutil.rmtree, self.directory, True)


def _list(url: str, journal: str) -> list[Fragment]:
    return store_for(url).list(journal)


async def cancel_and_wait(*futures: asyncio.Future[Any]) -> None:
    """Cancel `futures` and wait until each has finished.

    Unlike `with suppress(CancelledError): await f`, a cancellation of the *caller* while it
    waits still propagates (a swallowed cancel leaves a task that never stops).
    """
    for f in futures:
        f.cancel()
    if futures:
        await asyncio.wait(futures)


T = TypeVar("T")


class Slot(Generic[T]):
    """An ownership token's one-slot channel. A release hands the token straight to the longest waiter,
    as a Go channel's send does, so nobody barges: asyncio.Queue keeps a released item until its woken
    getter runs, and a `get_nowait` in between takes it and sends that getter to the back of the line
    (appends to a busy journal waited for its pipeline behind any number of newer ones). A waiter joins
    the line synchronously (`wait_turn`), and a second release before the first one's receiver took the
    token raises QueueFull, as a full slot's does."""

    def __init__(self) -> None:
        self._held = False
        self._token: T | None = None
        self._getters: collections.deque[asyncio.Future[T]] = collections.deque()
        self._handed: asyncio.Future[T] | None = None  # given the token, its waiter not resumed yet

    def empty(self) -> bool:
        return not self._held

    def full(self) -> bool:
        return self._held

    def put_nowait(self, token: T) -> None:
        """Release: to the longest waiter, else into the slot (QueueFull if it holds a token already)."""
        if self._held or self._handed is not None:
            raise asyncio.QueueFull
        while self._getters:
            getter = self._getters.popleft()
            if not getter.done():
                getter.set_result(token)
                self._handed = getter
                return
        self._held, self._token = True, token

    def peek(self) -> T:
        """The token in the slot, left there (for tests and probes; QueueEmpty if it is held)."""
        if not self._held:
            raise asyncio.QueueEmpty
        return self._token  # type: ignore[return-value]  # (held: set by put_nowait)

    def get_nowait(self) -> T:
        if not self._held:
            raise asyncio.QueueEmpty
        token, self._held, self._token = self._token, False, None
        return token  # type: ignore[return-value]  # (held: set by put_nowait)

    def wait_turn(self) -> asyncio.Future[T]:
        """Join the line (now, not at a task's first step): the future gets the token in turn; then
        `took(it)`, or `give_up(it)` to leave the line (passing on a token it was handed meanwhile)."""
        getter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._getters.append(getter)
        return getter

    def took(self, getter: asyncio.Future[T]) -> T:
        """The token `getter` was handed: its waiter holds it now."""
        if self._handed is getter:
            self._handed = None
        return getter.result()

    def give_up(self, getter: asyncio.Future[T]) -> None:
        if getter.done() and not getter.cancelled():
            self.put_nowait(self.took(getter))
            return
        getter.cancel()
        with contextlib.suppress(ValueError):
            self._getters.remove(getter)

    async def get(self) -> T:
        """Acquire, after those already waiting. A getter cancelled once handed the token passes it on."""
        if self._held:
            return self.get_nowait()
        getter = self.wait_turn()
        try:
            await getter
        except BaseException:
            self.give_up(getter)
            raise
        return self.took(getter)


async def acquire(slot: Slot[Any], *cancel_on: asyncio.Event) -> tuple[bool, Any]:
    """Take the token from `slot` -> (True, token), or (False, None) if one of `cancel_on` fires first.

    If the token came concurrently with a cancellation we still own it, so it is passed on before
    returning None or re-raising (STYLE.md, "Ownership tokens").
    """
    if any(ev.is_set() for ev in cancel_on):
        return False, None
    if not slot.empty():  # fast path: uncontended (a token in the slot means nobody waits for it)
        return True, slot.get_nowait()
    getter = slot.wait_turn()
    waiters = [asyncio.ensure_future(ev.wait()) for ev in cancel_on]
    try:
        await asyncio.wait([getter, *waiters], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        slot.give_up(getter)
        raise
    finally:
        for w in waiters:
            w.cancel()
    if not getter.done() or any(ev.is_set() for ev in cancel_on):
        slot.give_up(getter)
        return False, None
    return True, slot.took(getter)
