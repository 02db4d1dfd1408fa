"""LogPlayer end to end in one process: real etcd and brokers (the WAL journal, R=3), real Target
gRPC servers with SQLite files, the LogPlayer, and a WalWriter. Each test checks every target's
apply log against the WAL read committed: each of its entries exactly once, in order (DESIGN.md
invariant 9). (Process kills and SIGSTOP: tests/logplayer/test_kill.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import apsw
import grpc
import msgspec
import pytest

from tests.support.logplayer import applied_log, expected_parts, wait_delivered
from tests.support.waiting import wait_until
from tidings.client import AppendService, AsyncClient
from tidings.cluster.etcd import free_port
from tidings.logplayer.fetcher import UnknownTargetError
from tidings.logplayer.player import LogPlayer, PlayerState, last_acks
from tidings.logplayer.target import TargetServer, apply_key_values
from tidings.logplayer.wal import Target, Targets, WalEntry, WalMutation, WalWriter
from tidings.message import Publisher
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.status import TargetFencedError, UsageError, ValidationError

WAL = "wal/test"


class Rig:
    """Targets (servers on free ports), a WAL journal, writers and players, all stopped at the end."""

    def __init__(self, cluster, tmp_path: Path, n_targets: int) -> None:
        self.cluster = cluster
        self.tmp = tmp_path
        self.targets = Targets([Target(f"t{i}", f"127.0.0.1:{free_port()}") for i in range(n_targets)])
        self.servers: dict[str, TargetServer] = {}
        self.players: list[tuple[LogPlayer, asyncio.Task]] = []
        self.fakes: list[grpc.aio.Server] = []
        self.client = AsyncClient(cluster.brokers[0].endpoint)
        self.writer = WalWriter(self.client, WAL, self.targets)

    def db(self, target: str) -> Path:
        return self.tmp / "targets" / f"{target}.sqlite"

    async def start_target(self, target: str, apply=None) -> TargetServer:
        t = self.targets.by_id[target]
        server = TargetServer(target, self.db(target), t.endpoint, apply=apply, log_applied=True)
        self.servers[target] = await server.start()
        return server

    async def start_targets(self, *targets: str) -> None:
        """Start `targets` (all when none named)."""
        for t in targets or self.targets.ids:
            await self.start_target(t)

    async def append(self, numbers: range) -> list[int]:
        """Append the transactions `txn(i)` one after another; their indices."""
        return [await self.writer.append(txn(i)) for i in numbers]

    async def fake_target(self, target: str, servicer: pb_grpc.TargetServicer) -> None:
        """Serve `target`'s endpoint with a servicer of the test's (a target that misbehaves)."""
        server = grpc.aio.server()
        pb_grpc.add_TargetServicer_to_server(servicer, server)
        server.add_insecure_port(self.targets.by_id[target].endpoint)
        await server.start()
        self.fakes.append(server)

    async def stop_fakes(self) -> None:
        for server in self.fakes:
            await server.stop(0)
        self.fakes.clear()

    async def stop_target(self, target: str) -> None:
        await self.servers.pop(target).stop(graceful=False)

    def start_player(self, **options) -> LogPlayer:
        options.setdefault("state_path", self.tmp / "player.state")
        options.setdefault("start_wait", 3.0)
        options.setdefault("ack_timeout", 2.0)
        player = LogPlayer(self.client, WAL, self.targets, **options)
        self.players.append((player, asyncio.create_task(player.run())))
        return player

    async def stop_player(self, player: LogPlayer) -> None:
        for p, task in self.players:
            if p is player:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.players = [(p, t) for p, t in self.players if p is not player]

    async def stop(self) -> None:
        for p, _ in list(self.players):
            await self.stop_player(p)
        for target in list(self.servers):
            await self.stop_target(target)
        await self.stop_fakes()
        await self.writer.aclose()
        await self.client.aclose()

    async def expected(self) -> dict[str, list[int]]:
        return await expected_parts(self.client, WAL, self.targets)

    def applied(self, target: str) -> list[int]:
        return applied_log(self.db(target))

    async def wait_delivered(self, timeout: float = 30.0) -> dict[str, list[int]]:
        expected = await wait_delivered(self.client, WAL, self.targets, timeout)
        for t in self.targets.ids:
            assert self.applied(t) == expected[t], f"target {t}"
        return expected


@pytest.fixture
async def rig(cluster, tmp_path):
    await cluster.create_journal(WAL, replication=3)
    r = Rig(cluster, tmp_path, 3)
    try:
        yield r
    finally:
        await r.stop()


def txn(i: int, n: int = 4) -> list[dict]:
    return [{"key": f"k{i}-{j}", "value": {"i": i, "j": j}} for j in range(n)]


async def test_every_target_applies_its_entries_once_in_order(rig: Rig) -> None:
    from prometheus_client import REGISTRY

    def sends() -> float:  # (batches written, by tidings_logplayer_send_delay_seconds: the LogPlayer's own delay)
        return REGISTRY.get_sample_value("tidings_logplayer_send_delay_seconds_count", {"wal": WAL}) or 0.0

    await rig.start_targets()
    before = sends()
    rig.start_player()
    indices = await rig.append(range(50))
    assert indices == sorted(indices) and len(set(indices)) == 50
    expected = await rig.wait_delivered()
    assert sum(map(len, expected.values())) >= 50
    assert 0 < sends() - before <= sum(map(len, expected.values()))  # (a batch may carry several entries)
    # The key-value default applied the values.
    db = apsw.Connection(str(rig.db(rig.targets.target_of("k3-1"))))
    assert msgspec.json.decode(db.execute("SELECT value FROM kv WHERE key = 'k3-1'").fetchone()[0]) == {"i": 3, "j": 1}
    db.close()


async def test_a_retried_transaction_is_applied_once(rig: Rig) -> None:
    await rig.start_targets()
    rig.start_player()
    writer = rig.writer
    entry = writer.prepare(txn(0))
    first = await writer.append(entry)
    again = await writer.append(entry)  # (a retry after an unknown outcome: the same UUID)
    assert again > first
    await writer.append(txn(1))
    expected = await rig.wait_delivered()
    assert all(again not in indices for indices in expected.values())


async def test_a_target_down_catches_up_through_a_recovery_stream(rig: Rig) -> None:
    await rig.start_targets()
    player = rig.start_player()
    await rig.append(range(20))
    await rig.wait_delivered()
    await rig.stop_target("t1")
    await wait_until(lambda: not player.links["t1"].up)
    await rig.append(range(20, 60))
    # The others go on without t1.
    others = Targets([rig.targets.by_id["t0"], rig.targets.by_id["t2"]])
    expected = await rig.expected()

    async def others_done() -> bool:
        answers = await last_acks(others)
        return all(a.last_applied >= expected[t][-1] for t, a in answers.items())

    await wait_until(others_done, 30, interval=0.05)
    await rig.start_target("t1")
    await rig.wait_delivered()
    # (the recovery stream ends once its reader reached the range's end, which may follow the last ack)
    await wait_until(lambda: player.links["t1"].up and player.dispatcher.queues["t1"].state.value == "N")


async def test_a_restarted_player_resumes_without_loss_or_duplicates(rig: Rig) -> None:
    await rig.start_targets()
    player = rig.start_player(checkpoint_every=5)
    await rig.append(range(30))
    await rig.wait_delivered()
    await rig.stop_player(player)
    await rig.append(range(30, 60))
    rig.start_player(checkpoint_every=5)
    await rig.wait_delivered()


async def test_a_second_player_fences_the_first(rig: Rig) -> None:
    await rig.start_targets()
    first = rig.start_player(state_path=rig.tmp / "a.state")
    await rig.append(range(10))
    await rig.wait_delivered()
    rig.start_player(state_path=rig.tmp / "b.state")
    first_task = rig.players[0][1]
    await rig.append(range(10, 40))
    with pytest.raises(TargetFencedError):
        await asyncio.wait_for(first_task, 30)
    rig.players = rig.players[1:]
    await rig.wait_delivered()
    assert first.epoch < rig.players[0][0].epoch


async def test_undecodable_wal_entries_are_reported_and_skipped(rig: Rig, caplog) -> None:
    await rig.start_targets()
    rig.start_player()
    writer = rig.writer
    await writer.append(txn(0))
    bad = await (await writer.service.append(WAL, b'{"parts": 42}\nnot json\n{"parts": {"t0": []}}\n'))
    await writer.append(txn(1))
    await rig.wait_delivered()
    assert f"[{bad.begin}, " in caplog.text and "undecodable" in caplog.text
    assert "has no mutations: skipped" in caplog.text
    with pytest.raises(ValidationError, match="at least one mutation"):
        await writer.append(WalEntry(parts={"t0": []}, uuid=writer.prepare(txn(2)).uuid))


class FakeTarget(pb_grpc.TargetServicer):
    """A target that misbehaves as `answer` says; it counts the streams opened to it."""

    def __init__(self) -> None:
        self.opens = 0

    def answer(self, req: pb.DeliverRequest) -> pb.DeliverResponse:
        raise NotImplementedError

    async def Deliver(self, requests, context):
        async for req in requests:
            self.opens += req.HasField("open")
            yield self.answer(req)

    async def GetLastAck(self, request, context):
        return pb.LastAckResponse(last_applied=-1)


class WrongAcks(FakeTarget):
    """Answers Open, then acknowledges an index it was never sent."""

    def answer(self, req: pb.DeliverRequest) -> pb.DeliverResponse:
        if req.HasField("open"):
            return pb.DeliverResponse(last_applied=-1)
        return pb.DeliverResponse(last_applied=req.entries[-1].index + 1)


async def test_a_target_answering_a_wrong_index_is_disconnected_not_trusted(rig: Rig) -> None:
    await rig.start_targets("t0", "t2")
    liar = WrongAcks()
    await rig.fake_target("t1", liar)
    player = rig.start_player()
    await rig.append(range(10))
    await wait_until(lambda: liar.opens >= 3, 30)  # disconnected, reconnected, again
    assert "ends no batch sent" in player.links["t1"].last_error
    assert player.dispatcher.last_acks["t1"] == -1  # never took the liar's word
    await rig.stop_fakes()
    await rig.start_target("t1")
    await rig.wait_delivered()


def wipe(rig: Rig, target: str) -> None:
    for f in rig.db(target).parent.glob(f"{target}.sqlite*"):
        f.unlink()


async def test_a_target_wiped_while_the_player_was_down_gets_everything(rig: Rig) -> None:
    """A target whose file went back in time, opening before the restarted main stream dispatched
    anything, is not taken for up to date: it gets the entries before the state position too."""
    await rig.start_targets()
    player = rig.start_player(checkpoint_every=5)
    writer = rig.writer
    await rig.append(range(30))
    await rig.wait_delivered()
    state = rig.tmp / "player.state"
    await wait_until(lambda: state.exists() and PlayerState.from_file(state).position > 0, 30)  # (saved each second)
    await rig.stop_player(player)
    await rig.stop_target("t1")
    wipe(rig, "t1")
    await rig.start_target("t1")
    player = rig.start_player(checkpoint_every=5)
    await player.ready.wait()
    assert player.start_position > 0
    await writer.append(txn(99))
    await rig.wait_delivered()


class OddStatus(FakeTarget):
    """A target of another version answering a status this LogPlayer does not know."""

    def answer(self, req: pb.DeliverRequest) -> pb.DeliverResponse:
        return pb.DeliverResponse(status=99, last_applied=-1)


async def test_an_unknown_status_fails_the_connection_not_the_player(rig: Rig) -> None:
    await rig.start_targets("t0", "t2")
    odd = OddStatus()
    await rig.fake_target("t1", odd)
    player = rig.start_player()
    await wait_until(lambda: odd.opens >= 3, 30)
    assert not rig.players[0][1].done()
    assert "status 99" in player.links["t1"].last_error


async def test_an_entry_naming_an_undeclared_target_stops_the_player_before_queueing_it(rig: Rig) -> None:
    await rig.start_targets()
    rig.start_player()
    writer = rig.writer
    await writer.append(txn(0))
    expected = await rig.wait_delivered()
    stray = WalEntry(parts={"t0": [WalMutation("a")], "t9": [WalMutation("b")]}, uuid=writer.prepare(txn(1)).uuid)
    at = (await (await writer.service.append(WAL, msgspec.json.encode(stray) + b"\n"))).begin
    with pytest.raises(UnknownTargetError, match=f"entry {at} names unknown target 't9'.*add it"):
        await asyncio.wait_for(rig.players[0][1], 30)
    rig.players.clear()
    assert rig.applied("t0") == expected["t0"]  # (nothing of the entry reached t0 either)


async def test_concurrent_appends_of_one_writer_are_all_applied(rig: Rig) -> None:
    """A fresh writer's concurrent appends queue in clock order, each taking its clock once it is its turn
    (after the WAL's framing is known): none lands after a newer one to be read as its duplicate and lost."""
    await rig.start_targets()
    rig.start_player()
    writer = rig.writer
    indices = await asyncio.gather(*(writer.append(txn(i)) for i in range(20)))
    expected = await rig.wait_delivered()
    assert sorted({i for indices_ in expected.values() for i in indices_}) == sorted(indices)


async def test_prepared_transactions_are_appended_in_their_order_and_retried_freely(rig: Rig) -> None:
    writer = rig.writer
    first, second = writer.prepare(txn(1)), writer.prepare(txn(2))
    await writer.append(second)
    with pytest.raises(UsageError, match="in the order prepare"):
        await writer.append(first)  # (it would be read as a duplicate of `second`)
    await writer.append(second)  # a retry of one appended: allowed (and read once)
    await rig.start_targets()
    rig.start_player()
    expected = await rig.wait_delivered()
    assert len({i for indices in expected.values() for i in indices}) == 1


async def test_a_transaction_committed_late_is_skipped_by_the_main_and_the_recovery_streams(rig: Rig, caplog) -> None:
    """A transactional producer's entry committed (ACK) after newer entries reads with an index below
    the current one: not a WalWriter's way, so both streams report and skip it by the same rule, and
    delivery goes on (were the recovery stream to send it, the target would refuse it for ever)."""
    await rig.start_targets()
    rig.start_player(checkpoint_every=2)
    writer = rig.writer
    await writer.append(txn(0))
    await rig.wait_delivered()
    await rig.stop_target("t1")  # (its recovery will read the late entry above its last ack)
    publisher = Publisher(AppendService(rig.client))
    late = WalEntry(parts=writer.prepare(txn(100, n=12)).parts)
    assert set(late.parts) == set(rig.targets.ids)  # (a part for every target, t1's included)
    [span] = await (await publisher.publish_uncommitted(WAL, late))
    await rig.append(range(1, 6))
    await (await publisher.write_ack_intents(publisher.build_ack_intents()))
    await rig.append(range(6, 12))
    await rig.start_target("t1")
    expected = await rig.expected()
    assert all(span.begin in expected[t] for t in rig.targets.ids)  # (read committed, the entry is there)
    want = {t: [i for i in expected[t] if i != span.begin] for t in rig.targets.ids}

    async def delivered() -> bool:
        answers = await last_acks(rig.targets)
        return all(isinstance(a, pb.LastAckResponse) and a.last_applied >= want[t][-1] for t, a in answers.items())

    await wait_until(delivered, 30, interval=0.05)
    for t in rig.targets.ids:
        assert rig.applied(t) == want[t], f"target {t}"
    assert f"the entry at offset {span.begin} comes after entry" in caplog.text
    await publisher.service.aclose()


async def test_a_target_failing_its_apply_is_retried_and_holds_no_other_back(rig: Rig) -> None:
    """A target ending the stream (a failing apply) while the writer has batches in flight fails that
    target's connection only (grpc raises InvalidStateError in the write): the LogPlayer retries it and
    delivers to the others."""
    failures = 0

    def poisoned(db, entry) -> None:
        nonlocal failures
        if entry.index == poison:
            failures += 1
            raise RuntimeError("cannot apply this entry")
        apply_key_values(db, entry)

    await rig.append(range(150))
    expected = await rig.expected()
    poison = expected["t1"][3]
    await rig.start_targets("t0", "t2")
    await rig.start_target("t1", apply=poisoned)
    player = rig.start_player(max_batch=1)  # (one entry a batch: writes in flight when the stream ends)
    await wait_until(lambda: failures >= 40 or rig.players[0][1].done(), 60)
    assert not rig.players[0][1].done() and "INTERNAL" in player.links["t1"].last_error
    assert rig.applied("t1") == expected["t1"][:3]  # (stays on the entry it cannot apply)
    await wait_until(lambda: all(rig.applied(t) == expected[t] for t in ("t0", "t2")), 30)
    await rig.stop_target("t1")
    await rig.start_target("t1")  # (the user mends the apply function)
    await rig.wait_delivered()


async def test_entries_of_megabytes_go_in_batches_a_target_accepts(rig: Rig) -> None:
    """Batches are bounded in bytes as well as entries, and targets take messages past gRPC's default
    4 MiB, so a backlog of large entries (or one entry over 4 MiB) is delivered, not refused for ever."""
    big = "x" * 1_000_000
    for i in range(8):
        await rig.writer.append([{"key": f"k{j}-{i}", "value": big} for j in range(3)])
    await rig.writer.append([{"key": "huge", "value": "y" * 5_000_000}])
    await rig.start_targets()
    rig.start_player()
    await rig.wait_delivered(timeout=60)


async def test_a_returning_target_gets_a_transactional_entry_at_the_current_index(rig: Rig) -> None:
    """A transactional producer's entry is delivered at its ACK, after the end of the entry at the
    current index: the recovery of a returning target reads past that end, so it yields the entry and
    the target does not lose it silently."""
    await rig.start_targets()
    player = rig.start_player()
    await rig.append(range(3))
    await rig.wait_delivered()
    await rig.stop_target("t1")
    publisher = Publisher(AppendService(rig.client))
    entry = WalEntry(parts=rig.writer.prepare(txn(100, n=12)).parts)
    assert "t1" in entry.parts
    [span] = await (await publisher.publish_uncommitted(WAL, entry))
    await (await publisher.write_ack_intents(publisher.build_ack_intents()))  # (committed, not late)
    await wait_until(lambda: player.dispatcher.current_index == span.begin, 30, interval=0.05)
    await rig.start_target("t1")  # (its recovery: (last ack, span.begin])
    await wait_until(lambda: player.dispatcher.queues["t1"].state.value == "N", 30, interval=0.05)
    await rig.append(range(3, 6))
    expected = await rig.wait_delivered()
    assert span.begin in expected["t1"]
    await publisher.service.aclose()


async def test_deliveries_go_over_the_transport_the_client_chose(rig: Rig, client_transport: str) -> None:
    """Over targets' data ports by default (learned from their GetLastAck answers), over gRPC when the
    client says so: either way every entry once, in order."""
    await rig.start_targets()
    rig.start_player()
    await rig.append(range(10))
    await rig.wait_delivered()
    on_data_ports = {t: any(conn.calls for conn in s._data.connections) for t, s in rig.servers.items()}
    assert on_data_ports == dict.fromkeys(rig.servers, client_transport == "tidings")


async def test_a_target_whose_data_port_fails_is_delivered_to_over_grpc(rig: Rig) -> None:
    """A data port that refuses (here: a GetLastAck answer naming a port nothing listens on) costs one
    connection attempt: the link delivers over gRPC, and nothing is lost or repeated."""
    await rig.start_targets()
    rig.servers["t1"]._data.servicer.data_port = free_port()
    rig.client.transport = "tidings"
    player = rig.start_player()
    await rig.append(range(20))
    await rig.wait_delivered()
    assert player.links["t1"]._data_down_until > 0 and not player.links["t1"].data_endpoint
    assert player.links["t0"].data_endpoint and player.links["t0"]._data_down_until == 0


async def test_a_target_whose_data_port_never_answers_is_delivered_to_over_grpc(rig: Rig) -> None:
    """A data port that takes connections and says nothing (a firewall's drop looks the same to a link
    that waits for the Open's answer): the link gives the port up and delivers over gRPC."""
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    try:
        await rig.start_targets()
        rig.servers["t2"]._data.servicer.data_port = silent.sockets[0].getsockname()[1]
        rig.client.transport = "tidings"
        player = rig.start_player()
        await rig.append(range(20))
        await rig.wait_delivered()
        assert player.links["t2"]._data_down_until > 0 and not player.links["t2"].data_endpoint
    finally:
        silent.close()
