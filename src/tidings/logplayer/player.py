"""LogPlayer: delivers each target its part of every WAL entry, in order, exactly once
(logplayer-paper.txt; the parts: `fetcher`, `dispatcher`, `target_queue`, `stream`).

Start (Algorithm 5, "upon LogPlayer restart"): the player asks every reachable target for its
last applied index and newest epoch (`GetLastAck`), and takes an epoch above all of them and no
older than the clock (milliseconds): a LogPlayer started later fences this one at every target it
reaches; a dead older one's epoch never blocks a newer one. Targets start suspended; each link
opens its stream and returns through `_on_open` (recovery stream or straight back to normal).
The main stream waits up to `start_wait` seconds for the targets to open first, so the targets up
at the start join it without a recovery stream.

Where the main stream starts: the paper starts at min(last_acks) + 1. Our reader also needs the
Sequencer's producer states to drop a transaction manager's duplicates, so the player keeps its
*state file* (`state_path`): the newest main-stream checkpoint covering no entry beyond any
target's last acknowledgement (a target not heard from this run counts at the start position).
A restart resumes from it, and the dispatcher skips what each target already applied. Without a
state file (a new machine), the main stream reads the WAL from its start: slower, still exact.

A target whose normal queue grows beyond `max_queue` entries (slow, not failed) is suspended and
recovered from the WAL later: a slow target never holds the others back, nor the player's memory.

Its client's authorizer (`AsyncClient(auth=)`) signs every call, the WAL reads and the targets'
Deliver (APPEND) and GetLastAck (READ) alike, over `target=<id>`: keys (`logplayer run --auth-keys`)
sign a token per call, a token (`--auth-token`) must allow LIST and READ on the WAL (its spec gives its framing) and
APPEND and READ on every target, so it has no selector.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import grpc
import msgspec
from prometheus_client import Counter, Gauge

from tidings.auth.authorizer import Authorizer, NoAuthorizer
from tidings.client import AsyncClient
from tidings.logplayer.dispatcher import NOTHING, Dispatcher
from tidings.logplayer.fetcher import Checkpoints, MainFetcher, recover
from tidings.logplayer.stream import CHANNEL_OPTIONS, TargetLink, data_endpoint
from tidings.logplayer.wal import Targets
from tidings.message.sequencer import Checkpoint
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.claims import Capability
from tidings.protocol.labels import name_selector
from tidings.protocol.status import UsageError
from tidings.tls import TLS, channel

__all__ = ["LogPlayer", "PlayerState", "last_acks"]

log = logging.getLogger(__name__)

CURRENT = Gauge("tidings_logplayer_current_index", "The last index the main stream dispatched", ["wal"])
LAST_ACK = Gauge("tidings_logplayer_last_ack", "A target's last acknowledged index", ["wal", "target"])
UP = Gauge("tidings_logplayer_target_up", "1 while the target's stream is open", ["wal", "target"])
RECOVERIES = Counter("tidings_logplayer_recoveries_total", "Recovery streams started", ["wal", "target"])


class PlayerState(msgspec.Struct):
    """The state file: where a restarted LogPlayer's main stream resumes."""

    wal: str
    position: int = NOTHING  # the last index the checkpoint covers
    checkpoint: Checkpoint | None = None

    @classmethod
    def from_file(cls, path: Path) -> PlayerState:
        return msgspec.json.decode(path.read_bytes(), type=cls)


def _load_state(path: Path, wal: str) -> PlayerState:
    try:
        state = PlayerState.from_file(path)
    except FileNotFoundError:
        return PlayerState(wal)
    except (OSError, msgspec.DecodeError) as exc:
        raise UsageError(f"cannot read the LogPlayer state file {path} ({exc}): move it away to start over") from None
    if state.wal != wal:
        raise UsageError(f"the state file {path} is of WAL {state.wal!r}, not {wal!r}: pass another --state")
    return state


def _save_state(path: Path, state: PlayerState) -> None:
    """Atomically: a crash leaves the old file or the new one."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # (two players given one file by mistake: no mix)
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(state))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def last_acks(
    targets: Targets, timeout: float = 2.0, tls: TLS | None = None, auth: Authorizer | None = None
) -> dict[str, pb.LastAckResponse | str]:
    """Every target's GetLastAck answer, or why there is none (for a start and `targets status`); with
    `auth`, each call carries a token for READ on its target (`target=<id>`)."""
    auth = auth if auth is not None else NoAuthorizer()

    async def ask(target_id: str, endpoint: str) -> pb.LastAckResponse | str:
        try:
            async with channel(endpoint, tls, CHANNEL_OPTIONS) as ch:
                stub = pb_grpc.TargetStub(ch)  # type: ignore[no-untyped-call]  # generated gRPC stub, untyped
                metadata = auth.metadata(Capability.READ, name_selector(target_id, "target"))
                req = pb.LastAckRequest(target=target_id)
                resp: pb.LastAckResponse = await stub.GetLastAck(req, timeout=timeout, metadata=metadata)
                return resp
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"

    answers = await asyncio.gather(*(ask(t.id, t.endpoint) for t in targets.targets))
    return dict(zip(targets.ids, answers, strict=True))


class LogPlayer:
    """Delivers the WAL journal `wal` to `targets`; see the module docstring. `run()` until cancelled."""

    def __init__(
        self,
        client: AsyncClient,
        wal: str,
        targets: Targets,
        *,
        state_path: str | Path | None = None,
        name: str = "",
        max_batch: int = 256,
        max_queue: int = 100_000,
        dummy_every: int = 1000,
        checkpoint_every: int = 1000,
        ack_timeout: float = 5.0,
        start_wait: float = 5.0,
    ) -> None:
        self.client = client
        self.wal = wal
        self.targets = targets
        self.state_path = Path(state_path) if state_path else None
        self.name = name or f"logplayer-{os.getpid()}"
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.dummy_every = dummy_every
        self.checkpoint_every = checkpoint_every
        self.ack_timeout = ack_timeout
        self.start_wait = start_wait
        self.epoch = 0
        self.dispatcher = Dispatcher(targets.ids, self._wake, dummy_every=dummy_every, suspended=True)
        self.links: dict[str, TargetLink] = {}
        self.fetcher: MainFetcher | None = None
        self.checkpoints = Checkpoints()
        self.start_position = NOTHING  # the last index the state file's checkpoint covers
        self.start_end = 0  # where the checkpoint's reader stood: the entry at start_position ends at or before it
        self.heard: set[str] = set()  # targets that opened a stream this run
        self.ready = asyncio.Event()  # the main stream started
        self._recoveries: dict[str, asyncio.Task[Any]] = {}
        self._saved_position = NOTHING

    async def run(self) -> None:
        await self.client.write_head(self.wal)  # (a WAL that does not exist: said before any target is fenced)
        state = PlayerState(self.wal)
        if self.state_path is not None:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            state = await asyncio.to_thread(_load_state, self.state_path, self.wal)
        if state.checkpoint is None or self.wal not in state.checkpoint.journals:  # (a foreign file: start over)
            state = PlayerState(self.wal)
        else:
            self.start_end = state.checkpoint.journals[self.wal].read_through
        self.start_position = self._saved_position = state.position
        self.checkpoints = Checkpoints(state.position, state.checkpoint)
        answers = await last_acks(self.targets, tls=self.client.tls, auth=self.client.auth)
        epochs = [a.epoch for a in answers.values() if isinstance(a, pb.LastAckResponse)]
        self.epoch = min(max([*epochs, time.time_ns() // 1_000_000 - 1]) + 1, 2**63 - 1)
        nonce = random.getrandbits(63)
        log.info("LogPlayer %s: WAL %s, %d targets, epoch %d, resuming after index %d", self.name, self.wal,
                 len(self.targets.ids), self.epoch, state.position)  # fmt: skip
        for t in self.targets.targets:
            answer = answers[t.id]
            opening = pb.DeliverRequest(
                open=pb.DeliverRequest.Open(target=t.id, player=self.name, epoch=self.epoch, nonce=nonce, wal=self.wal)
            )
            self.links[t.id] = TargetLink(
                t,
                self.dispatcher,
                self._on_open,
                opening,
                max_batch=self.max_batch,
                ack_timeout=self.ack_timeout,
                tls=self.client.tls,  # (one TLS per process: the brokers' and the targets' alike)
                auth=self.client.auth,  # (and one authorizer: its keys, or its token)
                transport=self.client.transport,  # (and one transport)
                data_endpoint=data_endpoint(t.endpoint, answer) if isinstance(answer, pb.LastAckResponse) else "",
            )
        tasks = [asyncio.create_task(link.run(), name=f"link:{tid}") for tid, link in self.links.items()]
        try:
            opened = [asyncio.ensure_future(link.opened.wait()) for link in self.links.values()]
            await asyncio.wait(opened, timeout=self.start_wait)
            for f in opened:
                f.cancel()
            self.fetcher = MainFetcher(
                self.client, self.wal, self.dispatcher, self.checkpoints, checkpoint_every=self.checkpoint_every
            )
            tasks.append(asyncio.create_task(self.fetcher.run(), name="main-fetcher"))
            tasks.append(asyncio.create_task(self._keep_state(), name="state"))
            self.ready.set()
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            raise AssertionError("a LogPlayer task ended")  # (they run for ever)
        finally:
            for task in [*tasks, *self._recoveries.values()]:
                task.cancel()
            await asyncio.gather(*tasks, *self._recoveries.values(), return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._save()

    def _wake(self, target: str) -> None:
        link = self.links[target]
        queue = link.queue
        if len(queue.normal) > self.max_queue:
            log.warning("target %s: %d entries wait; suspending it to recover it from the WAL later", target,
                        len(queue.normal))  # fmt: skip
            link.fail_soon("too far behind")
            return
        link.wake.set()

    def _on_open(self, link: TargetLink, last_applied: int) -> None:
        """A target (re)opened its stream at `last_applied` (Algorithm 5, "upon target restart"). It
        missed what the main stream dispatched after that, and, if the main stream has not passed
        the start position yet, what lies before it (a target whose file went back in time)."""
        d, target = self.dispatcher, link.id
        self.heard.add(target)
        old = self._recoveries.pop(target, None)
        if old is not None:
            old.cancel()
        d.acknowledged(target, last_applied)
        term = d.queues[target].begin_recovery()
        if d.current_index > self.start_position:
            assert self.fetcher is not None
            until, end = d.current_index, self.fetcher.current_end
        else:
            until, end = self.start_position, self.start_end
        UP.labels(self.wal, target).set(1)
        if last_applied >= until:
            d.queues[target].nothing_missed()
            link.wake.set()
            return
        RECOVERIES.labels(self.wal, target).inc()
        task = self._recoveries[target] = asyncio.create_task(
            recover(self.client, self.wal, d, self.checkpoints, target, term, last_applied, (until, end), link.room),
            name=f"recover:{target}:{term}",
        )
        task.add_done_callback(lambda t: self._recovered(link, t))

    def _recovered(self, link: TargetLink, task: asyncio.Task[bool]) -> None:
        if self._recoveries.get(link.id) is not task or (not task.cancelled() and task.exception() is None):
            return  # (replaced by a newer return's, or done)
        why = "was cancelled" if task.cancelled() else f"failed: {task.exception()}"
        log.error("target %s: its recovery stream %s", link.id, why)
        link.fail_soon(f"its recovery stream {why}")  # (a new connection recovers anew)

    def floor(self) -> int:
        """The lowest last acknowledgement, counting targets not heard from this run at the start."""
        acks = self.dispatcher.last_acks
        return min((acks[t] if t in self.heard else self.start_position) for t in self.targets.ids)

    async def _keep_state(self) -> None:
        while True:
            await asyncio.sleep(1.0)  # (periodic: the state file and the metrics)
            CURRENT.labels(self.wal).set(self.dispatcher.current_index)
            for t, link in self.links.items():
                LAST_ACK.labels(self.wal, t).set(self.dispatcher.last_acks[t])
                UP.labels(self.wal, t).set(int(link.up))
            await self._save()

    async def _save(self) -> None:
        position, checkpoint = self.checkpoints.prune(self.floor())
        if self.state_path is None or position == self._saved_position or checkpoint is None:
            return
        await asyncio.to_thread(_save_state, self.state_path, PlayerState(self.wal, position, checkpoint))
        self._saved_position = position

    def status(self) -> dict[str, Any]:
        """What the terminal shows: the current index and each target's state, last ack and lag (bytes)."""
        d = self.dispatcher
        return {
            "current_index": d.current_index,
            "targets": {
                t: {
                    "up": link.up,
                    "state": d.queues[t].state.value,
                    "last_ack": d.last_acks[t],
                    "lag": max(d.current_index - d.last_acks[t], 0),
                    "error": "" if link.up else link.last_error,
                }
                for t, link in self.links.items()
            },
        }
