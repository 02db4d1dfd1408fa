"""Consumer processes run in the test's own process (the `consumers` fixture), with a word-count
application whose shards each keep a SQLite file and publish running counts to wc/out/{n}."""

from __future__ import annotations

from tidings.consumer import Application, SQLiteStore, sqlite_store
from tidings.consumer.service import Consumer, ConsumerConfig
from tidings.consumer.store_recorded import RecordedSQLiteStore
from tidings.protocol import protocol_pb2 as pb

COUNTS = "CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER NOT NULL)"
WORDS = ["apple", "banana", "cherry", "date", "elder", "fig", "grape"]
PRIMARY, FAILED, STANDBY = pb.ReplicaStatus.PRIMARY, pb.ReplicaStatus.FAILED, pb.ReplicaStatus.STANDBY


class Counts(Application):
    """Word count per shard: its own SQLite file (Shard.path), running counts to wc/out/{n}."""

    def new_store(self, shard) -> SQLiteStore:
        return SQLiteStore(shard.path(), schema=[COUNTS])

    async def consume_message(self, shard, store, env, publisher) -> None:
        word = env.message["word"]
        db = store.transaction()
        n = (db.execute("SELECT n FROM counts WHERE word = ?", (word,)).fetchone() or (0,))[0] + 1
        db.execute("INSERT INTO counts VALUES (?, ?) ON CONFLICT (word) DO UPDATE SET n = excluded.n", (word, n))
        await publisher.publish_uncommitted(out_journal(shard.spec.id), {"word": word, "n": n})

    async def finalize_txn(self, shard, store, publisher) -> None:
        pass


class RecordedCounts(Counts):
    """Counts whose store is recorded to the shard's recovery log (`sqlite_store`): no shared --data-dir."""

    def new_store(self, shard) -> SQLiteStore:
        return sqlite_store(shard, schema=[COUNTS])


class SmallRollovers(RecordedCounts):
    """Recorded counts whose database rolls over every few tens of KiB of log (the default is 4 MiB; a
    WAL checkpointed every few pages restarts, so the log outgrows the live files): the live part of the
    log moves on, and what lies before it can be pruned."""

    def new_store(self, shard) -> SQLiteStore:
        assert shard.recorder is not None and shard.recovery_dir is not None
        schema = [COUNTS, "PRAGMA wal_autocheckpoint=8"]
        return RecordedSQLiteStore(shard.recorder, shard.recovery_dir, schema, rollover_min_bytes=16 << 10)


def out_journal(shard_id: str) -> str:
    return "wc/out/" + shard_id.rsplit("/", 1)[-1]


def counts(path) -> dict[str, int]:
    store = SQLiteStore(path)
    try:
        return dict(store.db.execute("SELECT word, n FROM counts").fetchall())
    finally:
        store.destroy()


class Consumers:
    def __init__(self, cluster, etcd_root: str, tmp_path) -> None:
        # (beside the brokers' root, not under it: their KeySpace would see these keys as its own)
        self.cluster, self.root, self.data_dir = cluster, etcd_root + "-consumer", tmp_path / "consumer"
        self.running: list[Consumer] = []
        self._n = 0

    async def add(self, zone: str = "zone-a", app=None, **config) -> Consumer:
        """A consumer process over the cluster's first broker, holding the brokers' keys if they have any
        (it signs its calls to them, and checks the Shard calls it serves), `config` overriding."""
        config.setdefault("auth_keys", getattr(self.cluster, "config", {}).get("auth_keys"))
        cfg = ConsumerConfig(
            etcd=self.cluster.etcd_endpoint,
            broker=self.cluster.brokers[0].endpoint,
            app=app or Counts(),
            zone=zone,
            suffix=f"c{self._n}",
            root=self.root,
            data_dir=self.data_dir,
            lease_ttl=2,
            exit_timeout=20.0,
            **config,
        )
        self._n += 1
        consumer = await Consumer(cfg).start()
        self.running.append(consumer)
        return consumer

    def statuses(self, shard_id: str) -> dict[str, int]:
        state = next(c for c in self.running if not c.stopped.is_set()).state
        return {f"{a.zone}/{a.suffix}": a.value.code for a in state.assignments.get(shard_id, [])}

    async def stop(self) -> None:
        from tidings.keyspace.etcd import Etcd

        for c in self.running:
            if not c.stopped.is_set():
                await c.stop(graceful=False)
        client = await Etcd.connect(self.cluster.etcd_endpoint)
        try:
            await client.delete_prefix(self.root + "/")
        finally:
            await client.aclose()
