"""A shard's recovery log on this process (Gazette's recovery.go): its hints fetched from etcd, the log
played into a fresh local directory and tailed (a hot standby: `tailing` once caught up), and, when
this replica becomes primary, the log handed off to a new recorder there (`complete`).

The recovery log is the journal `{recovery_log_prefix}/{shard id}`; it must exist, labelled
`content-type: application/x-recoverylog` (a journal of messages would be garbage to a player, and a
recorder's operations garbage to a message reader). Hints live under the spec's `hint_prefix`, or,
when it is empty, under `{the consumer's --root}.hints` (outside the consumer's KeySpace, which
watches `--root/`); `hint_backups` older sets are kept. After the new primary restored its store,
`store_recovered` rotates the hints it played to into the backups (Gazette's order: only hints a
store was restored from are kept).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from tidings.client import AppendService, AsyncClient
from tidings.consumer.recoverylog import _metrics as metrics
from tidings.consumer.recoverylog.hints import HintKeys, fetch, pick_first, store_recovered
from tidings.consumer.recoverylog.ops import new_author
from tidings.consumer.recoverylog.player import Played, Player
from tidings.consumer.recoverylog.recorder import Recorder
from tidings.keyspace.etcd import Compare, Etcd
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import JournalNotFoundError, TidingsError, TransportError

__all__ = ["CONTENT_TYPE", "Recovery", "RecoveryError", "check_log", "recovery_log"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "application/x-recoverylog"


class RecoveryError(TidingsError):
    """The shard's recovery log cannot be played (missing, or not a recovery log)."""


def recovery_log(spec: pb.ShardSpec) -> str:
    return f"{spec.recovery_log_prefix}/{spec.id}"


async def check_log(client: AsyncClient, shard: str, log: str) -> None:
    """RecoveryError unless `log` exists and is labelled a recovery log (a journal of messages would be
    garbage to a player)."""
    try:
        spec = await client.spec(log)
    except JournalNotFoundError:
        raise RecoveryError(
            f"shard {shard!r}: its recovery log {log!r} does not exist; create it (labels "
            f"content-type: {CONTENT_TYPE}) or clear the shard's recovery_log_prefix"
        ) from None
    kind = next((lb.value for lb in spec.labels.labels if lb.name == "content-type"), "")
    if kind != CONTENT_TYPE:
        raise RecoveryError(
            f"shard {shard!r}: journal {log!r} is labelled content-type {kind or '(none)'!r}, not "
            f"{CONTENT_TYPE!r}: is it really this shard's recovery log?"
        )


class Recovery:
    """Plays `spec`'s recovery log into `dir` from the moment `start()` is called (see the module docstring)."""

    def __init__(
        self,
        client: AsyncClient,
        etcd: Etcd,
        spec: pb.ShardSpec,
        dir: Path,
        default_hint_prefix: str,
        on_tailing: Callable[[], object] | None = None,
    ) -> None:
        if not spec.recovery_log_prefix:
            raise ValueError(f"shard {spec.id!r} has no recovery log")
        self.client, self.etcd, self.spec, self.dir = client, etcd, spec, Path(dir)
        self.log = recovery_log(spec)
        self.keys = HintKeys(spec.hint_prefix or default_hint_prefix, spec.id, spec.hint_backups)
        self.tailing = asyncio.Event()  # set once playback caught up with the log (`on_tailing` called then)
        self._on_tailing = on_tailing
        self.player: Player | None = None
        self.recovered: pb.FSMHints | None = None  # the hints playback completed with
        self._author = 0  # the handoff asked for (before the player exists, too)
        self._asked = asyncio.Event()
        self._task: asyncio.Task[Played] | None = None
        self._started = 0.0

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"shard {self.spec.id!r}: its recovery was already started")
        self._started = time.monotonic()
        self._task = asyncio.create_task(self._play(), name=f"recovery:{self.spec.id}")

    @property
    def failed(self) -> BaseException | None:
        t = self._task
        return t.exception() if t is not None and t.done() and not t.cancelled() else None

    async def _play(self) -> Played:
        await self._check_log()
        for attempt in itertools.count():
            try:
                hints = pick_first(await fetch(self.etcd, self.keys, self.log), self.log)
                break
            except TransportError as exc:  # (etcd briefly unreachable: a standby waits, it does not fail)
                log.warning("shard %s: reading its recovery hints failed (%s); retrying", self.spec.id, exc)
                await asyncio.sleep(min(5.0, 0.1 * 2**attempt))
        player = self.player = Player(self.client, hints, self.dir)
        tailing = asyncio.ensure_future(player.tailing.wait())
        tailing.add_done_callback(lambda f: None if f.cancelled() else self._caught_up())
        asked = asyncio.ensure_future(self._asked.wait())
        asked.add_done_callback(lambda f: None if f.cancelled() else player.inject_handoff(self._author))
        try:
            return await player.play()
        finally:
            tailing.cancel()
            asked.cancel()

    def _caught_up(self) -> None:
        metrics.PLAYBACK_SECONDS.observe(time.monotonic() - self._started)
        self.tailing.set()
        if self._on_tailing is not None:
            self._on_tailing()

    @property
    def offset(self) -> int:
        """The log offset played through so far (0 before playback began)."""
        return self.player.offset if self.player is not None else 0

    @property
    def task(self) -> asyncio.Task[Played] | None:
        """The playback (once started): done when it completed, failed or was cancelled."""
        return self._task

    async def _check_log(self) -> None:
        await check_log(self.client, self.spec.id, self.log)

    async def complete(self) -> Recorder:
        """Finish playback by handing the log off to a new author, and return the Recorder that records
        on as it (through its own AppendService) in `dir`."""
        if self._task is None:
            self.start()
        assert self._task is not None
        if self._asked.is_set():
            raise RuntimeError(f"shard {self.spec.id!r}: its recovery was already completed")
        self._author = new_author()
        self._asked.set()
        played = await asyncio.shield(self._task)  # (a cancelled caller leaves playback to aclose())
        self.recovered = played.fsm.build_hints(self.log)
        return Recorder(AppendService(self.client), self.log, played.fsm, self._author, played.write_head)

    async def store_recovered(self, guard: Compare) -> None:
        """Rotate the hints playback completed with into etcd's backups (after the store restored)."""
        assert self.recovered is not None
        try:
            if not await store_recovered(self.etcd, self.keys, self.recovered, guard):
                log.info("shard %s: its recovered hints were not stored: its assignment changed", self.spec.id)
        except TidingsError as exc:  # (etcd unreachable: hints are an optimisation; the next write catches up)
            log.warning("shard %s: storing its recovered hints failed: %s", self.spec.id, exc)

    async def aclose(self, remove: bool = True) -> None:
        """Stop playing (a cancelled playback removes its directory); `remove` the directory anyway."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # (its own outcome is not ours: a cancellation of us still raises)
        if task is not None and task.done() and not task.cancelled():
            task.exception()  # (retrieved: a failure was reported through `failed` or complete())
        if remove:
            await asyncio.to_thread(shutil.rmtree, self.dir, True)
