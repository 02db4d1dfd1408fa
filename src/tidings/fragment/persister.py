"""Persister: the broker's background loop that uploads completed spool fragments to their stores.

A replica `submit`s each fragment its spool completes; the persister compresses and uploads it
through `FragmentStore.persist` in a worker thread, then calls `on_persisted(fragment, local)` on
the event loop. `local` is a path or a spool file (anything with `reader()` and
`persisted_through(end)`: one already covered by a store is skipped).

As in Gazette, only a journal's primary persists a fragment at once; a replica submits with a
`delay`, and after it looks for the fragment in the store before uploading, so R replicas do
not write every fragment R times. `drain()` (a broker stopping) releases delayed fragments at once.

A failed upload is never dropped: it is retried with capped exponential backoff (logging a
warning naming the fragment and the error) while other fragments keep moving, so a store that is
down does not hold up fragments bound elsewhere. A local file whose content does not match its
fragment is retried too (and warned about on every attempt): dropping it silently would lose the
only copy of that span outside the replicas. At shutdown the broker calls `drain(timeout)` and
then `aclose()`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidings.fragment import _metrics
from tidings.fragment.fragment import Fragment
from tidings.fragment.store import store_for
from tidings.protocol.status import UsageError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PersisterStatistics:
    """A snapshot: `queued` counts fragments not yet persisted (delayed, waiting, uploading or backing off);
    `uploaded` those this persister wrote, `persisted` all it completed (uploaded or found in the store)."""

    queued: int
    persisted: int
    failures: int
    uploaded: int = 0


@dataclass(slots=True)
class _Job:
    fragment: Fragment
    local: Any  # a path, or a spool file
    store_url: str
    attempts: int = 0
    check_first: bool = False  # a delayed (replica) job: the primary has probably persisted it


def _upload(job: _Job) -> tuple[Fragment, bool]:
    """Persist the job's fragment (blocking); (persisted fragment, whether this call uploaded it)."""
    store = store_for(job.store_url)
    frag = job.fragment
    if job.check_first and store.exists(frag):
        return frag.with_store(store.store_url), False
    if isinstance(job.local, str):
        return store.persist(frag, job.local), True
    with job.local.reader() as raw:
        return store.persist(frag, raw), True


class Persister:
    """Uploads submitted fragments, retrying until each one is persisted.

    **Parameters:**
    - `on_persisted`: called on the event loop with the persisted fragment (backing_store set)
      and its local path or file, exactly once per submitted fragment; typically it lets the
      replica drop the spool file once the index sees the fragment in the store.
    - `concurrency`: uploads in flight at once (each in its own thread).
    - `initial_backoff`, `max_backoff`: seconds before the first retry of a failed upload,
      doubling per failure up to the cap.
    """

    def __init__(
        self,
        on_persisted: Callable[[Fragment, Any], None],
        *,
        concurrency: int = 2,
        initial_backoff: float = 0.5,
        max_backoff: float = 60.0,
    ) -> None:
        if concurrency < 1:
            raise UsageError(f"Persister concurrency must be at least 1, not {concurrency}")
        self._on_persisted = on_persisted
        self._concurrency = concurrency
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._retries: set[asyncio.TimerHandle] = set()
        self._delayed: dict[asyncio.TimerHandle, _Job] = {}
        self._persist_tasks: list[asyncio.Task[None]] = []
        self._pending = 0
        self._persisted = 0
        self._uploaded = 0
        self._failures = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    def submit(self, frag: Fragment, local: Any, store_url: str, delay: float = 0.0) -> None:
        """Queue `frag` (content in `local`, a path or spool file) for upload to `store_url`. Never blocks.

        With `delay` (a replica's fragment) the job waits that long, then uploads only if the
        store does not hold the fragment yet.
        """
        if self._closed:
            raise UsageError(f"Persister is closed; cannot persist {frag.content_path()}")
        self._pending += 1
        self._idle.clear()
        job = _Job(frag, local, store_url, check_first=delay > 0)
        if delay <= 0:
            self._queue.put_nowait(job)
            return
        handle: asyncio.TimerHandle

        def release() -> None:
            self._delayed.pop(handle, None)
            self._queue.put_nowait(job)

        handle = asyncio.get_running_loop().call_later(delay, release)
        self._delayed[handle] = job

    async def start(self) -> None:
        """Start the upload loops; returns once they are running."""
        if self._closed:
            raise UsageError("Persister is closed; build a new one")
        if self._persist_tasks:
            return
        self._persist_tasks = [
            asyncio.create_task(self._persist_loop(), name=f"fragment-persister:{i}") for i in range(self._concurrency)
        ]
        await asyncio.sleep(0)

    async def _persist_loop(self) -> None:
        while True:
            job = await self._queue.get()
            if not isinstance(job.local, str) and job.local.persisted_through(job.fragment.end):
                self._succeeded(job, job.fragment.with_store(job.store_url), uploaded=False)  # a listing covered it
                continue
            try:
                persisted, uploaded = await asyncio.to_thread(_upload, job)
            except Exception as err:  # retried: a failure must never drop a fragment
                self._failed(job, err)
                continue
            self._succeeded(job, persisted, uploaded)

    def _failed(self, job: _Job, err: Exception) -> None:
        job.attempts += 1
        self._failures += 1
        _metrics.FRAGMENT_PERSIST_FAILURES.inc()
        delay = min(self._max_backoff, self._initial_backoff * 2 ** (job.attempts - 1))
        log.warning(
            "persisting fragment %s to %s failed (attempt %d), retrying in %.2fs: %s",
            job.fragment.content_path(),
            job.store_url,
            job.attempts,
            delay,
            err,
        )
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle

        def requeue() -> None:
            self._retries.discard(handle)
            self._queue.put_nowait(job)

        handle = loop.call_later(delay, requeue)
        self._retries.add(handle)

    def _succeeded(self, job: _Job, persisted: Fragment, uploaded: bool) -> None:
        self._persisted += 1
        if uploaded:
            self._uploaded += 1
            _metrics.FRAGMENTS_PERSISTED.inc()
            _metrics.FRAGMENT_PERSISTED_BYTES.inc(persisted.content_length)
        log.debug("persisted fragment %s to %s (uploaded: %s)", persisted.content_path(), job.store_url, uploaded)
        try:
            self._on_persisted(persisted, job.local)
        except Exception:
            # The upload itself succeeded; retrying it would not help the callback.
            log.exception("on_persisted failed for fragment %s", persisted.content_path())
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted fragment is persisted; False if `timeout` passed first.

        Delayed (replica) fragments are released at once. Needs `start()`; cancelling it leaves
        the queue untouched.
        """
        for handle, job in list(self._delayed.items()):
            handle.cancel()
            self._queue.put_nowait(job)
        self._delayed.clear()
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def statistics(self) -> PersisterStatistics:
        return PersisterStatistics(
            queued=self._pending, persisted=self._persisted, failures=self._failures, uploaded=self._uploaded
        )

    async def aclose(self) -> None:
        """Stop the loops. Fragments still queued are not persisted (call drain() first).

        An upload already in its thread runs to completion but is not reported. Always closes.
        """
        self._closed = True
        for handle in [*self._retries, *self._delayed]:
            handle.cancel()
        self._retries.clear()
        self._delayed.clear()
        tasks, self._persist_tasks = self._persist_tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
