"""Persister: the broker's background loop that uploads completed spool fragments to their stores.

A replica `submit`s each fragment its spool completes; the persister compresses and uploads it
through `FragmentStore.persist` in a worker thread, then calls `on_persisted(fragment, path)` on
the event loop. A failed upload is never dropped: it is retried with capped exponential backoff
(logging a warning naming the fragment and the error) while other fragments keep moving, so a
store that is down does not hold up fragments bound elsewhere. A local file whose content does
not match its fragment is retried too (and warned about on every attempt): dropping it silently
would lose the only copy of that span outside the replicas. At shutdown the broker calls
`drain(timeout)` and then `aclose()`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from tidings.fragment import _metrics
from tidings.fragment.fragment import Fragment
from tidings.fragment.store import store_for
from tidings.protocol.status import UsageError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PersisterStatistics:
    """A snapshot: `queued` counts fragments not yet persisted (waiting, uploading or backing off)."""

    queued: int
    persisted: int
    failures: int


@dataclass(slots=True)
class _Job:
    fragment: Fragment
    local_path: str
    store_url: str
    attempts: int = 0


class Persister:
    """Uploads submitted fragments, retrying until each one is persisted.

    **Parameters:**
    - `on_persisted`: called on the event loop with the persisted fragment (backing_store set)
      and its local path, exactly once per submitted fragment; typically it lets the replica
      drop the spool file once the index sees the fragment in the store.
    - `concurrency`: uploads in flight at once (each in its own thread).
    - `initial_backoff`, `max_backoff`: seconds before the first retry of a failed upload,
      doubling per failure up to the cap.
    """

    def __init__(
        self,
        on_persisted: Callable[[Fragment, str], None],
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
        self._persist_tasks: list[asyncio.Task[None]] = []
        self._pending = 0
        self._persisted = 0
        self._failures = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    def submit(self, frag: Fragment, local_path: str, store_url: str) -> None:
        """Queue `frag` (content in `local_path`) for upload to `store_url`. Never blocks."""
        if self._closed:
            raise UsageError(f"Persister is closed; cannot persist {frag.content_path()}")
        self._pending += 1
        self._idle.clear()
        self._queue.put_nowait(_Job(frag, local_path, store_url))

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
            try:
                persisted = await asyncio.to_thread(store_for(job.store_url).persist, job.fragment, job.local_path)
            except Exception as err:  # retried: a failure must never drop a fragment
                self._failed(job, err)
                continue
            self._succeeded(job, persisted)

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

    def _succeeded(self, job: _Job, persisted: Fragment) -> None:
        self._persisted += 1
        _metrics.FRAGMENTS_PERSISTED.inc()
        _metrics.FRAGMENT_PERSISTED_BYTES.inc(persisted.content_length)
        log.debug("persisted fragment %s to %s", persisted.content_path(), job.store_url)
        try:
            self._on_persisted(persisted, job.local_path)
        except Exception:
            # The upload itself succeeded; retrying it would not help the callback.
            log.exception("on_persisted failed for fragment %s", persisted.content_path())
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted fragment is persisted; False if `timeout` passed first.

        Needs `start()`; cancelling it leaves the queue untouched.
        """
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def statistics(self) -> PersisterStatistics:
        return PersisterStatistics(queued=self._pending, persisted=self._persisted, failures=self._failures)

    async def aclose(self) -> None:
        """Stop the loops. Fragments still queued are not persisted (call drain() first).

        An upload already in its thread runs to completion but is not reported. Always closes.
        """
        self._closed = True
        for handle in self._retries:
            handle.cancel()
        self._retries.clear()
        tasks, self._persist_tasks = self._persist_tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
