"""The recovery-log operator surface: GetHints (any consumer process answers from etcd, every hint slot,
unusable values with the reason). Real etcd and brokers; consumers in this process."""

from __future__ import annotations

import grpc
import pytest

from tests.consumer.test_service import shard
from tests.support.consumers import PRIMARY, RecordedCounts
from tests.support.waiting import wait_until
from tidings.consumer.client import ShardClient
from tidings.consumer.recovery import CONTENT_TYPE
from tidings.consumer.recoverylog.hints import HintKeys, encode, fetch
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol import protocol_pb2_grpc as pb_grpc
from tidings.protocol.status import NoRecoveryLogError, ShardNotFoundError

LOG = "wc/log/wc/0"


async def served(cluster, consumers, app=None, log: bool = True, **fields):
    """wc/in/0 and wc/out/0, the recovery log (unless not `log`), and shard wc/0 recorded to it, primary
    on a first consumer (returned)."""
    await cluster.create_journal("wc/in/0", 1)
    await cluster.create_journal("wc/out/0", 1)
    if log:
        await cluster.create_journal(LOG, 1, labels={"content-type": CONTENT_TYPE}, fragment={"length": "8KiB"})
    a = await consumers.add("zone-a", app=app or RecordedCounts())
    async with ShardClient(a.endpoint) as sc:
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(0, recovery_log_prefix="wc/log", **fields))])
    if log:
        await wait_until(lambda: consumers.statuses("wc/0") == {"zone-a/c0": PRIMARY}, 30)
    return a


async def test_get_hints_answers_every_slot_from_etcd(cluster, consumers, etcd_client) -> None:
    a = await served(cluster, consumers, hint_backups=2)
    keys = HintKeys(a.hint_prefix, "wc/0", 2)

    async def recovered_stored() -> bool:
        return (await fetch(etcd_client, keys, LOG)).primary is not None

    await wait_until(recovered_stored, 10)
    # The primary stored its recovered hints (of an empty log) as primary and backup.0; backup.1 is unset.
    # A foreign value at backup.1 is reported as unusable, naming why.
    await etcd_client.put(keys.backup(1), encode(pb.FSMHints(log="wc/log/other")))
    held = await fetch(etcd_client, keys, LOG)
    assert held.primary is not None and held.backups[0] is not None

    async with ShardClient(a.endpoint) as sc:
        resp = await sc.get_hints("wc/0")
        assert (resp.log, resp.primary_hints.key, resp.primary_hints.hints) == (LOG, keys.primary, held.primary)
        assert [(r.key, r.hints if r.HasField("hints") else None) for r in resp.backup_hints] == [
            (keys.backup(0), held.backups[0]),
            (keys.backup(1), None),
        ]
        assert "'wc/log/other', not the shard's 'wc/log/wc/0'" in resp.backup_hints[1].error
        with pytest.raises(ShardNotFoundError, match="no shard 'wc/9'"):
            await sc.get_hints("wc/9")
        await sc.apply([pb.ShardApplyRequest.Change(upsert=shard(1))])  # (no recovery log)
        with pytest.raises(NoRecoveryLogError, match="'wc/1' has no recovery log"):
            await sc.get_hints("wc/1")
    async with grpc.aio.insecure_channel(a.endpoint) as channel:
        stub = pb_grpc.ShardStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetHints(pb.GetHintsRequest(shard="/bad"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "get_hints.shard" in refused.value.details()
