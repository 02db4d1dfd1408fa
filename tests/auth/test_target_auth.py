"""A LogPlayer target holding keys serves no call without a token allowing it on `target=<id>`, and a
token for another target learns nothing of this one (DESIGN.md invariant 11; docs/design/production.md
§3.7, §3.12): every Target RPC checks its capability (a walk of the service's methods); a token whose
selector misses this target gets the answer a wrong target id gets (TARGET_NOT_FOUND), and its Deliver
fences nothing; a Deliver stream outliving its token applies nothing more; a LogPlayer holding the keys
(in this process), and `tidings logplayer run` with a token (a child process, with `tidings target serve
--auth-keys-file` children), deliver every WAL entry once, in order, over brokers holding the same keys;
`targets status` needs the token too."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

import tidings.auth.jwt as jwt_module
import tidings.auth.verifier as verifier_module
from tests.support.auth import KEY, bearer, refusals, token, walk_capabilities
from tests.support.cluster import TestCluster
from tests.support.logplayer import ENV, Procs, applied_log, wait_delivered
from tests.support.waiting import wait_until
from tidings.auth import KeyedAuthorizer, KeySet
from tidings.client import AsyncClient
from tidings.cluster.etcd import free_port
from tidings.logplayer.player import LogPlayer
from tidings.logplayer.target import TargetServer
from tidings.logplayer.wal import Target, Targets, WalWriter
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability
from tidings.protocol.protocol_pb2_grpc import TargetStub

KEYS = KeySet((KEY,))
WAL = "wal/auth"

# What each Target RPC needs (docs/design/production.md §3.7): a new RPC must be added here, with its check.
NEEDS = {"Deliver": Capability.APPEND, "GetLastAck": Capability.READ}


def _open(target: str, epoch: int = 1) -> pb.DeliverRequest:
    return pb.DeliverRequest(open=pb.DeliverRequest.Open(target=target, player="test", epoch=epoch, wal=WAL))


def _batch(prev: int, *indices: int) -> pb.DeliverRequest:
    entries = [pb.TargetEntry(index=i, mutations=[pb.Mutation(key=f"k{i}", value=b"1")]) for i in indices]
    return pb.DeliverRequest(prev_index=prev, entries=entries)


@pytest.fixture
async def target(tmp_path: Path) -> Any:
    """Target t0 holding KEYS, and a channel to it."""
    server = TargetServer("t0", tmp_path / "t0.sqlite", f"127.0.0.1:{free_port()}", log_applied=True, auth_keys=KEYS)
    await server.start()
    channel = grpc.aio.insecure_channel(server.endpoint)
    try:
        yield server, channel
    finally:
        await channel.close()
        await server.stop()


@pytest.fixture
def no_leeway(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens expire at their `exp` to the second (not 5 s later): the test waits for it."""
    monkeypatch.setattr(jwt_module, "LEEWAY", 0)
    monkeypatch.setattr(verifier_module, "LEEWAY", 0)


async def test_every_target_rpc_checks_its_capability_first(target: Any) -> None:
    """A walk of the Target service: each RPC without a token is UNAUTHENTICATED, with a token lacking its
    capability PERMISSION_DENIED, and with a token of exactly its capability gets past the check."""
    _server, channel = target
    await walk_capabilities(channel, "Target", NEEDS, "target=t0")


async def test_a_target_outside_the_selector_answers_as_a_wrong_target_and_takes_nothing(target: Any) -> None:
    """With a token for target=t1, GetLastAck and Deliver's Open of t0 give the very answer a target id
    this process does not serve gets (naming only the id asked, never t0), the Open fences nothing; a
    token for t0 is served on the same process."""
    server, channel = target
    stub, other = TargetStub(channel), bearer(token(Capability.APPEND | Capability.READ, "target=t1"))
    hidden_before = refusals("target", "TARGET_NOT_FOUND")

    async def first_answer(target_id: str, md: Any) -> pb.DeliverResponse:
        call = stub.Deliver(metadata=md)
        await call.write(_open(target_id))
        answer = await call.read()
        ended = await call.read()
        assert ended is grpc.aio.EOF or answer.status == pb.OK
        call.cancel()
        return answer

    for ask in (
        lambda t: stub.GetLastAck(pb.LastAckRequest(target=t), metadata=other),
        lambda t: first_answer(t, other),
    ):
        hidden, missing = await ask("t0"), await ask("t9")
        assert hidden.status == pb.TARGET_NOT_FOUND
        assert str(hidden) == str(missing).replace("t9", "t0")
    anyone = await stub.GetLastAck(pb.LastAckRequest(), metadata=other)  # ('': whichever target it serves)
    assert anyone.status == pb.TARGET_NOT_FOUND and "t0" not in anyone.detail, anyone
    assert server.store.fence == (0, 0) and server.store.wal == ""  # (the hidden Open took nothing over)
    assert refusals("target", "TARGET_NOT_FOUND") == hidden_before + 3
    mine = bearer(token(Capability.APPEND | Capability.READ, "target=t0"))
    assert (await stub.GetLastAck(pb.LastAckRequest(target="t0"), metadata=mine)).status == pb.OK
    call = stub.Deliver(metadata=mine)
    await call.write(_open("t0"))
    assert (await call.read()).status == pb.OK
    await call.write(_batch(-1, 10))
    assert (await call.read()).last_applied == 10
    call.cancel()


async def test_a_deliver_stream_outliving_its_token_applies_nothing_more(target: Any, no_leeway: None) -> None:
    """The stream's next batch after its token's expiry is refused (UNAUTHENTICATED), nothing of it applied:
    the LogPlayer reconnects with a current token (the test below)."""
    server, channel = target
    exp = int(time.time()) + 2
    call = TargetStub(channel).Deliver(metadata=bearer(token(Capability.APPEND, "target=t0", ttl=2)))
    await call.write(_open("t0"))
    assert (await call.read()).last_applied == -1
    await call.write(_batch(-1, 10))
    assert (await call.read()).last_applied == 10
    await wait_until(lambda: time.time() > exp + 0.2, timeout=10)
    await call.write(_batch(10, 20))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call.read()
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert exc.value.details() == "the token expired during the stream: reconnect with a current one"
    assert server.store.last_applied == 10 and applied_log(server.db) == [10]


async def _wal_cluster(brokers: Any) -> TestCluster:
    tc: TestCluster = await brokers(auth_keys=KEYS)
    await tc.add_broker("zone-a")
    await tc.create_journal(WAL, 1)
    return tc


def _txn(i: int) -> list[dict[str, Any]]:
    return [{"key": f"k{i}-{j}", "value": {"i": i}} for j in range(3)]


async def test_a_logplayer_holding_the_keys_delivers_to_targets_holding_them_past_its_tokens_expiry(
    brokers: Any, tmp_path: Path, no_leeway: None
) -> None:
    """Brokers and targets hold keys; the LogPlayer signs its WAL reads and its Deliver and GetLastAck
    calls with the same keys, in tokens of 3 s: every target applies each of its entries once, in order,
    also those delivered after the first tokens expired (the targets end those streams; the LogPlayer
    reconnects with a token it signs then, and the broker's blocking read is opened again likewise)."""
    tc = await _wal_cluster(brokers)
    targets = Targets([Target(f"t{i}", f"127.0.0.1:{free_port()}") for i in range(2)])
    servers = [
        await TargetServer(t.id, tmp_path / f"{t.id}.sqlite", t.endpoint, log_applied=True, auth_keys=KEYS).start()
        for t in targets.targets
    ]
    keyed = KeyedAuthorizer(KEYS, sub="logplayer", ttl=3)
    async with AsyncClient(tc.brokers[0].endpoint, auth=keyed) as client, tc.client() as writing:
        writer = WalWriter(writing, WAL, targets)
        player = LogPlayer(client, WAL, targets, state_path=tmp_path / "player.state", start_wait=3.0)
        running = asyncio.create_task(player.run())
        try:
            for i in range(15):
                await writer.append(_txn(i))
            await wait_delivered(client, WAL, targets, 30.0, auth=keyed)
            expired = time.time() + 4  # (every token signed so far has expired then)
            await wait_until(lambda: time.time() > expired, timeout=10)
            for i in range(15, 30):
                await writer.append(_txn(i))
            expected = await wait_delivered(client, WAL, targets, 30.0, auth=keyed)
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            await writer.aclose()
            for server in servers:
                await server.stop()
    for t in targets.ids:
        assert expected[t] and applied_log(tmp_path / f"{t}.sqlite") == expected[t], t
    cut = [link.last_error for link in player.links.values()]
    assert any("token expired during the stream" in e for e in cut), cut


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidings.cli", *args], capture_output=True, text=True, env=ENV,
                          timeout=120)  # fmt: skip


async def test_the_cli_logplayer_with_a_token_delivers_to_targets_serving_with_keys(
    brokers: Any, tmp_path: Path
) -> None:
    """`tidings target serve --auth-keys-file` children, and `tidings logplayer run --auth-token-file` (a
    token without a selector: LIST and READ on the WAL, APPEND and READ on every target) deliver every entry once,
    in order; `targets status` with the token sees each target up, without it is refused."""
    tc = await _wal_cluster(brokers)
    keys_file, token_file = tmp_path / "auth-keys", tmp_path / "logplayer.token"
    keys_file.write_text(base64.b64encode(KEY).decode() + "\n")
    token_file.write_text(token(Capability.LIST | Capability.READ | Capability.APPEND, sub="logplayer") + "\n")
    targets = Targets([Target(f"t{i}", f"127.0.0.1:{free_port()}") for i in range(2)])
    targets_file = tmp_path / "targets.yaml"
    targets_file.write_text(json.dumps({"targets": [{"id": t.id, "endpoint": t.endpoint} for t in targets.targets]}))
    broker = tc.brokers[0].endpoint
    procs = Procs(tmp_path)
    try:
        for t in targets.targets:
            await procs.start_target(t.id, t.endpoint, "--auth-keys-file", str(keys_file))
        await procs.start("player", ["logplayer", "run", "--wal", WAL, "--targets", str(targets_file), "--broker",
                                     broker, "--state", str(tmp_path / "player.state"), "--progress", "0",
                                     "--auth-token-file", str(token_file)])  # fmt: skip
        async with tc.client() as writing:
            writer = WalWriter(writing, WAL, targets)
            for i in range(20):
                await writer.append(_txn(i))
            await writer.aclose()
            expected = await wait_delivered(writing, WAL, targets, 60.0, auth=KeyedAuthorizer(KEYS))
        for t in targets.ids:
            assert expected[t] and applied_log(tmp_path / f"{t}.sqlite") == expected[t], t
        status = ["targets", "status", "--targets", str(targets_file), "--json"]
        with_token = await asyncio.to_thread(_cli, *status, "--auth-token-file", str(token_file))
        assert with_token.returncode == 0, with_token.stderr
        rows = [json.loads(line) for line in with_token.stdout.splitlines()]
        assert [(r["id"], r["up"]) for r in rows] == [("t0", True), ("t1", True)]
        without = await asyncio.to_thread(_cli, *status)
        assert without.returncode == 1
        assert all("UNAUTHENTICATED: no token" in json.loads(line)["error"] for line in without.stdout.splitlines())
    finally:
        procs.stop_all()
