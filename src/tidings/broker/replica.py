"""Replica: one broker's share of one journal (its Spool, Pipeline, fragment index and daemons).

Ownership follows Gazette's one-slot channels: `spool_slot` and `pipeline_slot` are
``asyncio.Queue(maxsize=1)`` filled at construction (the pipeline slot with ``None``: none built
yet). ``await slot.get()`` acquires; ``slot.put_nowait(x)`` in a ``finally`` releases. Release is
synchronous so cancellation cannot interrupt it, and a double release raises ``QueueFull``.
A Replicate RPC (peer side) owns the spool for its stream's life; on the primary, the Pipeline
owns the spool and an AppendFSM owns the pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidings.fragment.fragment import Fragment
from tidings.fragment.index import FragmentIndex
from tidings.fragment.spool import Spool
from tidings.fragment.store import store_for
from tidings.protocol import protocol_pb2 as pb

if TYPE_CHECKING:
    from tidings.broker.pipeline import Pipeline
    from tidings.fragment.persister import Persister

log = logging.getLogger(__name__)

GAP_REFRESH = 0.25  # seconds between store listings while a gap is not yet covered


class Replica:
    """A local replica of `journal`: created when this broker is assigned it, closed when unassigned."""

    def __init__(self, journal: str, spec: pb.JournalSpec, data_dir: Path, persister: Persister) -> None:
        self.journal = journal
        self.spec = spec
        self.persister = persister
        self.index = FragmentIndex(journal)
        self.directory = data_dir / "spools" / journal.replace("/", "%2F")
        self.spool_slot: asyncio.Queue[Spool] = asyncio.Queue(maxsize=1)
        self.spool_slot.put_nowait(Spool(journal, self.directory, observer=self))
        self.pipeline_slot: asyncio.Queue[Pipeline | None] = asyncio.Queue(maxsize=1)
        self.pipeline_slot.put_nowait(None)
        self.closed = asyncio.Event()
        self.route_changed = asyncio.Event()  # set (and replaced) whenever the route or spec changes
        self._tasks: list[asyncio.Task[None]] = []
        self._refresh_lock = asyncio.Lock()

    # -- SpoolObserver ---------------------------------------------------------------------

    def spool_commit(self, fragment: Fragment, path: str) -> None:
        self.index.add_local(fragment, path)

    def spool_complete(self, fragment: Fragment, path: str) -> None:
        self.index.add_local(fragment, path)
        stores = list(self.spec.fragment.stores)
        if stores:
            self.persister.submit(fragment, path, stores[0])

    def spool_gap(self, begin: int, end: int) -> None:
        """Content of [begin, end) lives only on the replica that committed it (a primary died between its
        peers), which persists it as its spool rolls: list the stores often until the index covers it,
        rather than leaving readers waiting a whole refresh interval."""
        if not self.closed.is_set():
            self._spawn(self._refresh_until_covered(begin), f"gap:{self.journal}")

    async def _refresh_until_covered(self, offset: int) -> None:
        deadline = asyncio.get_running_loop().time() + max(self.spec.fragment.refresh_interval_ms / 1000, 1.0)
        while self.index.query(offset) is None and asyncio.get_running_loop().time() < deadline:
            try:
                await self.refresh_now()
            except Exception as exc:  # the periodic refresh goes on regardless
                log.debug("journal %s: listing stores for a gap: %s", self.journal, exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(GAP_REFRESH):
                    await self.closed.wait()
            if self.closed.is_set():
                return

    def fragment_persisted(self, fragment: Fragment, path: str) -> None:
        """The persister stored `fragment`: refresh the listing, which swaps the local entry for the
        remote one and deletes the local file only once a listing covers it."""
        if not self.closed.is_set():
            self._spawn(self.refresh_now(), f"refresh-now:{self.journal}")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run `coro` as one of the replica's tasks (cancelled by aclose)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    # -- lifecycle -------------------------------------------------------------------------

    def update(self, spec: pb.JournalSpec) -> None:
        """The spec or route changed: wake everything waiting on the old view."""
        self.spec = spec
        self.route_changed.set()
        self.route_changed = asyncio.Event()

    def start(self, pulse: Callable[[Replica], Awaitable[None]]) -> None:
        self._tasks.append(asyncio.create_task(self._refresh_loop(), name=f"refresh:{self.journal}"))
        self._tasks.append(asyncio.create_task(pulse(self), name=f"pulse:{self.journal}"))

    async def _refresh_loop(self) -> None:
        """List the fragment stores every refresh interval (the index's remote half)."""
        while True:
            try:
                await self.refresh_now()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a store outage must not kill the replica
                log.warning("journal %s: listing fragment stores failed: %s", self.journal, exc)
            interval = max(self.spec.fragment.refresh_interval_ms, 1000) / 1000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.closed.wait()
            if self.closed.is_set():
                return

    async def refresh_now(self) -> None:
        """List every store and replace the index's remote half (serialized: a stale listing must
        never be applied after a newer one)."""
        async with self._refresh_lock:
            found: list[Fragment] = []
            for url in self.spec.fragment.stores:
                found.extend(await asyncio.to_thread(store_for(url).list, self.journal))
            dropped = self.index.replace_remote(found)
            for _frag, local in dropped:
                if local:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(local)

    async def aclose(self) -> None:
        """Stop daemons, tear down the pipeline, complete the spool (its fragment is persisted)."""
        self.closed.set()
        self.route_changed.set()
        await cancel_and_wait(*self._tasks)
        pipeline = await self.pipeline_slot.get()
        if pipeline is not None:
            spool = await pipeline.close()
            self.spool_slot.put_nowait(spool)
        self.pipeline_slot.put_nowait(None)
        spool = await self.spool_slot.get()
        try:
            spool.close()
        finally:
            self.spool_slot.put_nowait(spool)


async def cancel_and_wait(*futures: asyncio.Future) -> None:
    """Cancel `futures` and wait until each has finished.

    Unlike `with suppress(CancelledError): await f`, a cancellation of the *caller* while it
    waits still propagates (a swallowed cancel leaves a task that never stops).
    """
    for f in futures:
        f.cancel()
    if futures:
        await asyncio.wait(futures)


async def acquire(slot: asyncio.Queue, *cancel_on: asyncio.Event) -> tuple[bool, Any]:
    """Take the token from `slot` -> (True, token), or (False, None) if one of `cancel_on` fires first.

    If the get finished concurrently with a cancellation we still own the token, so it is put
    back before returning None or re-raising (STYLE.md, "Ownership tokens").
    """
    if any(ev.is_set() for ev in cancel_on):
        return False, None
    if not slot.empty():  # fast path: uncontended, no tasks needed
        return True, slot.get_nowait()
    getter = asyncio.ensure_future(slot.get())
    waiters = [asyncio.ensure_future(ev.wait()) for ev in cancel_on]
    try:
        await asyncio.wait([getter, *waiters], return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            await cancel_and_wait(getter)
    except BaseException:
        getter.cancel()
        if getter.done() and not getter.cancelled():
            slot.put_nowait(getter.result())
        raise
    finally:
        for w in waiters:
            w.cancel()
    if getter.cancelled():
        return False, None
    token = getter.result()
    if any(ev.is_set() for ev in cancel_on):
        slot.put_nowait(token)
        return False, None
    return True, token
