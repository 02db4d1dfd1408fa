"""LogPlayer and targets as processes, killed (-9) at random points under load, stopped (SIGSTOP),
and doubled by mistake, still deliver every WAL entry to each target once, in order (DESIGN.md
invariant 9). Real etcd and brokers (in this process; the WAL journal
R=3), `tidings target serve` and `tidings logplayer run` children stopped by PID whatever happens,
and a transaction manager (WalWriter) that also re-appends some transactions as a retry would.
Each target's apply log must equal its entries of the WAL read committed: once each, in order.

The campaign's size: TIDINGS_LOGPLAYER_KILLS rounds (default 6 in `make test`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from pathlib import Path

import yaml

from tests.support.logplayer import Procs, applied_log, wait_delivered
from tests.support.waiting import wait_until
from tidings.client import AsyncClient
from tidings.cluster.etcd import free_port
from tidings.logplayer.player import last_acks
from tidings.logplayer.wal import Target, Targets, WalWriter
from tidings.protocol import protocol_pb2 as pb

KILLS = int(os.environ.get("TIDINGS_LOGPLAYER_KILLS", "6"))
WAL = "wal/kill"


class Load:
    """A transaction manager appending transactions of 3 mutations, re-appending one in 20 (a retry)."""

    def __init__(self, client: AsyncClient, targets: Targets, seed: int) -> None:
        self.writer = WalWriter(client, WAL, targets)
        self.rng = random.Random(seed)
        self.appended = 0
        self.retries = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            entry = self.writer.prepare(
                [{"key": f"k{self.rng.randrange(10_000)}", "value": {"n": self.appended}} for _ in range(3)]
            )
            await self.writer.append(entry)
            if self.rng.random() < 0.05:
                await self.writer.append(entry)  # (the same UUID again: applied once)
                self.retries += 1
            self.appended += 1

    async def more(self, n: int, timeout: float = 60.0) -> None:
        """Wait until `n` more transactions were appended."""
        goal = self.appended + n
        await wait_until(lambda: self.appended >= goal, timeout)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.writer.aclose()


def declare(tmp_path: Path, n: int) -> tuple[Targets, Path]:
    targets = Targets([Target(f"t{i:02d}", f"127.0.0.1:{free_port()}") for i in range(n)])
    path = tmp_path / "targets.yaml"
    path.write_text(yaml.safe_dump({"targets": [{"id": t.id, "endpoint": t.endpoint} for t in targets.targets]}))
    return targets, path


def player_args(cluster, targets_file: Path, state: Path) -> list[str]:
    return ["logplayer", "run", "--wal", WAL, "--targets", str(targets_file), "--broker", cluster.brokers[0].endpoint,
            "--state", str(state), "--ack-timeout", "2", "--progress", "0", "--dummy-every", "50",
            "--checkpoint-every", "20"]  # fmt: skip


class Run:
    """A test's targets (started as processes), its Procs, client and Load; all stopped at the end."""

    def __init__(self, cluster, tmp_path: Path, n: int, seed: int) -> None:
        self.cluster = cluster
        self.targets, self.targets_file = declare(tmp_path, n)
        self.procs = Procs(tmp_path)
        self.client = AsyncClient(cluster.brokers[0].endpoint)
        self.load = Load(self.client, self.targets, seed)

    def player_args(self, state: str) -> list[str]:
        return player_args(self.cluster, self.targets_file, self.procs.data_dir / state)


@contextlib.asynccontextmanager
async def running(cluster, tmp_path: Path, n: int, seed: int):
    await cluster.create_journal(WAL, replication=3)
    run = Run(cluster, tmp_path, n, seed)
    try:
        await asyncio.gather(*(run.procs.start_target(t.id, t.endpoint) for t in run.targets.targets))
        yield run
    finally:
        run.procs.stop_all()
        await run.load.stop()
        await run.client.aclose()


def check_applied(procs: Procs, expected: dict[str, list[int]]) -> None:
    for target, indices in expected.items():
        applied = applied_log(procs.data_dir / f"{target}.sqlite")
        assert applied == indices, f"target {target}: applied {len(applied)} entries, expected {len(indices)}"


async def test_targets_and_the_player_killed_at_random_points_apply_every_entry_once_in_order(
    cluster, tmp_path
) -> None:
    rng = random.Random(int(os.environ.get("TIDINGS_CAMPAIGN_SEED", "0")) or None)
    async with running(cluster, tmp_path, 20, rng.randrange(1 << 30)) as run:
        procs, load, targets = run.procs, run.load, run.targets
        await procs.start("player", run.player_args("player.state"))
        load.start()
        await load.more(30)
        for _ in range(KILLS):
            await load.more(rng.randrange(5, 60))
            if rng.random() < 0.35:
                await procs.signal("player")
                await load.more(rng.randrange(1, 30))
                await procs.start("player", run.player_args("player.state"))
            else:
                victims = rng.sample(targets.ids, rng.randrange(1, 4))
                for v in victims:
                    await procs.signal(v)
                await load.more(rng.randrange(1, 30))
                await asyncio.gather(*(procs.start_target(v, targets.by_id[v].endpoint) for v in victims))
        await load.stop()
        assert load.retries > 0 or KILLS < 3
        expected = await wait_delivered(run.client, WAL, targets, timeout=120)
        check_applied(procs, expected)
        assert sum(map(len, expected.values())) >= 3 * load.appended * 0.9  # (3 mutations, mostly on 3 targets)


async def test_a_stopped_target_delays_no_other_and_catches_up_after_sigcont(cluster, tmp_path) -> None:
    async with running(cluster, tmp_path, 4, 7) as run:
        procs, load, targets = run.procs, run.load, run.targets
        await procs.start("player", run.player_args("player.state"))
        load.start()
        await load.more(20)
        await procs.signal("t01", signal.SIGSTOP)
        await load.more(200)
        await load.stop()
        # The others apply everything while t01 stays stopped.
        others = Targets([t for t in targets.targets if t.id != "t01"])
        await wait_delivered(run.client, WAL, others, timeout=60)
        answers = await last_acks(targets, timeout=0.5)
        assert not isinstance(answers["t01"], pb.LastAckResponse)  # (still stopped: no answer)
        # The player gives the stopped target up (no acknowledgement within --ack-timeout)...
        gave_up = "no acknowledgement for 2s; reconnecting"
        await wait_until(lambda: gave_up in procs.log("player").read_text(), 30, interval=0.1)
        await procs.signal("t01", signal.SIGCONT)
        expected = await wait_delivered(run.client, WAL, targets, timeout=60)
        check_applied(procs, expected)
        assert "target t01: recovering entries" in procs.log("player").read_text()  # (...and recovers it)


async def test_a_second_player_fences_the_first_and_nothing_is_doubled(cluster, tmp_path) -> None:
    async with running(cluster, tmp_path, 3, 11) as run:
        procs, load = run.procs, run.load
        await procs.start("first", run.player_args("first.state"))
        load.start()
        await load.more(30)
        await procs.start("second", run.player_args("second.state"))
        await load.more(60)
        first = procs.procs["first"]
        assert await asyncio.wait_for(asyncio.to_thread(first.wait, 60), 70) == 1
        assert "TARGET_FENCED" in procs.log("first").read_text()
        await load.stop()
        expected = await wait_delivered(run.client, WAL, run.targets, timeout=60)
        check_applied(procs, expected)
