"""No Shard RPC acts without a token allowing it, and a refusal reveals nothing of shards outside the
token's selector (DESIGN.md invariant 11; docs/design/production.md §3.7, §3.12), against real consumers
over real brokers and etcd, all holding the same keys: every Shard RPC checks its capability (a walk of
the service's methods, so a new RPC without one fails here); a shard outside the selector (its labels and
meta-label `id`) answers Stat, GetHints and Unassign exactly as a missing one, List leaves it out, Apply
can neither create, relabel nor delete it; a consumer holding the keys signs its own calls to the brokers
(reads, appends, recovery logs) and runs an application end to end, a hand-off included; one without
them is refused at start in one line."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import grpc
import pytest

from tests.support.auth import KEY, bearer, refusals, token, unrevisioned, walk_capabilities
from tests.support.cluster import TestCluster
from tests.support.consumers import PRIMARY, WORDS, Consumers, RecordedCounts
from tests.support.waiting import wait_until
from tidings.auth import BearerAuthorizer, KeyedAuthorizer, KeySet
from tidings.client import AppendService
from tidings.consumer.client import ShardClient
from tidings.consumer.service import Consumer, ConsumerConfig
from tidings.message import Publisher, read_committed
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability
from tidings.protocol.protocol_pb2_grpc import ShardStub
from tidings.protocol.specs import shard_from_dict
from tidings.protocol.status import UsageError

KEYS = KeySet((KEY,))
A, B = "auth/a", "auth/b"  # shards labelled app=a and app=b

# What each Shard RPC needs (Gazette's consumer/protocol/auth.go): a new RPC must be added here, with its check.
NEEDS = {
    "Stat": Capability.READ,
    "List": Capability.LIST,
    "Apply": Capability.APPLY,
    "GetHints": Capability.READ,
    "Unassign": Capability.APPLY,
}


def _shard(shard_id: str, app: str, **fields: Any) -> pb.ShardSpec:
    n = shard_id.rsplit("/", 1)[-1]
    spec = {"id": shard_id, "sources": [f"wc/in/{n}"], "max_txn_duration": "200ms", "labels": {"app": app}}
    return shard_from_dict({**spec, **fields})


@pytest.fixture
async def tc(brokers: Any) -> TestCluster:
    """Two brokers holding KEYS, with the journals of shards auth/a and auth/b (and their recovery logs)."""
    cluster: TestCluster = await brokers(auth_keys=KEYS)
    await cluster.add_broker("zone-a")
    await cluster.add_broker("zone-b")
    for n in ("a", "b"):
        await cluster.create_journal(f"wc/in/{n}", 1)
        await cluster.create_journal(f"wc/out/{n}", 1)
        recovery_log = {"content-type": "application/x-recoverylog"}
        await cluster.create_journal(f"wc/log/auth/{n}", 1, labels=recovery_log)
    return cluster


@pytest.fixture
async def consumers(tc: TestCluster, etcd_root: str, tmp_path: Any) -> Any:
    """Consumer processes over `tc`, holding its keys (tests/support/consumers.py)."""
    cs = Consumers(tc, etcd_root, tmp_path)
    try:
        yield cs
    finally:
        await cs.stop()


def _admin(consumer: Consumer) -> ShardClient:
    """A Shard client signing its own tokens with the consumers' keys (as an operator's process may)."""
    return ShardClient(consumer.endpoint, auth=KeyedAuthorizer(KEYS, sub="tests"))


async def _two_shards(consumers: Consumers, **fields: Any) -> Consumer:
    """A consumer serving shards auth/a (app=a) and auth/b (app=b) as primary."""
    c = await consumers.add("zone-a", app=RecordedCounts())
    async with _admin(c) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=_shard(s, s[-1], **fields)) for s in (A, B)])
    await wait_until(lambda: all(consumers.statuses(s) == {"zone-a/c0": PRIMARY} for s in (A, B)), 30)
    return c


async def test_every_shard_rpc_checks_its_capability_first(consumers: Consumers) -> None:
    """A walk of the Shard service: each RPC without a token is UNAUTHENTICATED, with a token lacking its
    capability PERMISSION_DENIED, and with a token of exactly its capability gets past the check."""
    consumer = await consumers.add("zone-a")
    async with grpc.aio.insecure_channel(consumer.endpoint) as ch:
        await walk_capabilities(ch, "Shard", NEEDS)


async def test_a_shard_outside_the_selector_answers_exactly_as_a_missing_one(consumers: Consumers) -> None:
    """With a token for app=a: Stat, GetHints and Unassign of auth/b give the very response a shard that
    does not exist gives; List leaves it out (also when asked for it by id); each hidden call is logged
    and counted for the operator."""
    consumer = await _two_shards(consumers, recovery_log_prefix="wc/log")
    tok = token(Capability.READ | Capability.LIST | Capability.APPLY, "app=a")
    hidden_before = refusals("shard", "SHARD_NOT_FOUND")
    async with grpc.aio.insecure_channel(consumer.endpoint) as ch:
        stub, md = ShardStub(ch), bearer(tok)
        calls = {
            "Stat": lambda s: stub.Stat(pb.StatRequest(shard=s, any_replica=True), metadata=md),
            "Stat(primary)": lambda s: stub.Stat(pb.StatRequest(shard=s), metadata=md, timeout=10),
            "GetHints": lambda s: stub.GetHints(pb.GetHintsRequest(shard=s), metadata=md),
            "Unassign": lambda s: stub.Unassign(pb.UnassignRequest(shards=[s], dry_run=True), metadata=md),
        }
        for name, call in calls.items():
            hidden, missing = await call(B), await call("auth/missing")
            assert hidden.status == pb.SHARD_NOT_FOUND, name
            # (each names the id it was asked, and nothing else of it)
            assert str(unrevisioned(hidden)) == str(unrevisioned(missing)).replace("auth/missing", B), name
            own = await call(A)
            assert own.status == pb.OK, (name, own)
        unassign_both = await stub.Unassign(pb.UnassignRequest(shards=[A, B], dry_run=True), metadata=md)
        assert unassign_both.status == pb.SHARD_NOT_FOUND and list(unassign_both.shards) == [B]
    assert refusals("shard", "SHARD_NOT_FOUND") == hidden_before + 5
    async with ShardClient(consumer.endpoint, auth=BearerAuthorizer(tok)) as sc:
        assert [s.spec.id for s in (await sc.list()).shards] == [A]
        assert list((await sc.list(labels.parse_selector(f"id={B}"))).shards) == []
        assert [s.spec.id for s in (await sc.list(labels.parse_selector(f"id={A},id={B}"))).shards] == [A]
    async with _admin(consumer) as sc:  # (the keys' holder, whose token has no selector, sees both)
        assert [s.spec.id for s in (await sc.list()).shards] == [A, B]
        await sc.unassign([A, B], dry_run=True)  # (a token for `id=A,id=B`: either shard, as in Gazette)


async def _specs(consumer: Consumer) -> dict[str, tuple[list[tuple[str, str]], int]]:
    async with _admin(consumer) as sc:
        return {s.spec.id: (labels.pairs(s.spec.labels), s.mod_revision) for s in (await sc.list()).shards}


async def test_apply_cannot_reach_outside_the_selector(consumers: Consumers) -> None:
    """An APPLY token for app=a creates no app=b shard, relabels no shard into or out of app=a, and deletes
    no app=b shard (that delete answers as one of a missing shard); its own shards it may change."""
    consumer = await _two_shards(consumers)
    before = await _specs(consumer)
    async with grpc.aio.insecure_channel(consumer.endpoint) as ch:
        stub, md = ShardStub(ch), bearer(token(Capability.APPLY | Capability.LIST, "app=a"))
        for shard_id, app in (("auth/new-b", "b"), (B, "a"), (A, "b")):
            revision = before[shard_id][1] if shard_id in before else 0
            change = pb.ShardApplyRequest.Change(upsert=_shard(shard_id, app), expect_mod_revision=revision)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Apply(pb.ShardApplyRequest(changes=[change]), metadata=md)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert exc.value.details() == f"not allowed to apply shard {shard_id} (outside your token's selector)"
        for expect in (before[B][1], 0, -1):  # (expecting its revision fails as for a missing shard; 0 and -1 pass)
            hidden, missing = [
                await stub.Apply(
                    pb.ShardApplyRequest(changes=[pb.ShardApplyRequest.Change(delete=s, expect_mod_revision=expect)]),
                    metadata=md,
                )
                for s in (B, "auth/missing")
            ]
            assert unrevisioned(hidden) == unrevisioned(missing), expect
            assert hidden.status == (pb.ETCD_TRANSACTION_FAILED if expect > 0 else pb.OK), expect
        assert await _specs(consumer) == before  # (nothing written)
        mine = _shard(A, "a")
        mine.labels.labels.append(pb.Label(name="tier", value="gold"))
        change = pb.ShardApplyRequest.Change(upsert=mine, expect_mod_revision=before[A][1])
        assert (await stub.Apply(pb.ShardApplyRequest(changes=[change]), metadata=md)).status == pb.OK
    assert (await _specs(consumer))[A][0] == [("app", "a"), ("tier", "gold")]


async def _produce(tc: TestCluster, journal: str, words: list[str]) -> None:
    async with tc.client() as c:
        pub = Publisher(AppendService(c))
        for i in range(0, len(words), 20):
            await (await pub.publish_committed(journal, *({"word": w} for w in words[i : i + 20])))
        await pub.service.aclose()


async def _downstream(tc: TestCluster, journal: str) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = {}
    async with tc.client() as c:
        async for env in read_committed(c, journal, block=False):
            seen.setdefault(env.message["word"], []).append(env.message["n"])
    return seen


async def _read_through(tc: TestCluster, consumer: Consumer, tok: str) -> None:
    """Stat, with a token for shard auth/a alone, until auth/a read through its source's write head."""
    async with tc.client() as c:
        head = await c.write_head("wc/in/a")
    async with ShardClient(consumer.endpoint, auth=BearerAuthorizer(tok)) as sc:
        assert (await sc.stat(A, {"wc/in/a": head})).read_through["wc/in/a"] >= head


async def test_a_consumer_holding_the_keys_runs_an_application_end_to_end(
    tc: TestCluster, consumers: Consumers
) -> None:
    """Over brokers holding keys, a consumer holding the same keys reads its sources, appends its outputs
    and records its store to its recovery log (each call with a token it signed); a second one joins and
    the first hands off: the second plays the recovery log and goes on; every count is exact, once."""
    await _two_shards(consumers, recovery_log_prefix="wc/log")
    first = consumers.running[0]
    words = [WORDS[i % len(WORDS)] for i in range(120)]
    stat_a = token(Capability.READ, f"id={A}")
    await _produce(tc, "wc/in/a", words[:60])
    await _read_through(tc, first, stat_a)
    second = await consumers.add("zone-b", app=RecordedCounts())
    producing = asyncio.ensure_future(_produce(tc, "wc/in/a", words[60:]))
    await first.stop(graceful=True)
    await producing
    await wait_until(lambda: consumers.statuses(A) == {"zone-b/c1": PRIMARY}, 30)
    await _read_through(tc, second, stat_a)
    expected = {w: list(range(1, n + 1)) for w, n in Counter(words).items()}
    assert await _downstream(tc, "wc/out/a") == expected
    seen = [  # (sub, cap, selector) of each token a broker verified (its verified-token cache)
        (claims.sub, claims.cap, labels.format_selector(claims.sel))
        for broker in tc.brokers
        for claims in broker.verifier._cache.values()  # type: ignore[union-attr]
    ]
    for who in (first.who, second.who):  # (their own tokens, each scoped to the journal it touched)
        mine = {(cap, sel) for sub, cap, sel in seen if sub == who}
        assert {(Capability.READ, "name=wc/in/a"), (Capability.APPEND, "name=wc/out/a")} <= mine, (who, mine)
        assert (Capability.APPEND, "name=wc/log/auth/a") in mine or (Capability.READ, "name=wc/log/auth/a") in mine
    assert (Capability.READ, "name=wc/log/auth/a") in {(c, s) for sub, c, s in seen if sub == second.who}


async def test_a_consumer_without_the_keys_is_refused_at_start_in_one_line(
    tc: TestCluster, etcd_root: str, tmp_path: Any
) -> None:
    """Brokers holding keys refuse a consumer's calls without a token: it says so at start (it would
    otherwise wait on its shards' reads for ever), naming the keys to give; with other keys, the same."""
    for keys in (None, KeySet((b"o" * 32,))):
        cfg = ConsumerConfig(etcd=tc.etcd_endpoint, broker=tc.brokers[0].endpoint, app=RecordedCounts(),
                             root=etcd_root + "-c", data_dir=tmp_path, lease_ttl=2, auth_keys=keys)  # fmt: skip
        with pytest.raises(UsageError, match="refuse its calls") as caught:
            await asyncio.wait_for(Consumer(cfg).start(), 20)
        said = str(caught.value)
        assert "\n" not in said and "--auth-keys" in said and "UNAUTHENTICATED" in said, said
        assert "--auth-token" not in said, said  # (a consumer takes no token)
