"""The Spark source and sink reach brokers that serve mutual TLS through options `tlsCa`, `tlsCert`
and `tlsKey`: rows written by the sink are read back by the source, exactly; a query without them,
or with half of a certificate pair, fails in one line naming what to give. Real local Spark, real
brokers as child processes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.spark._support import NDJSON, error_message
from tests.support.certs import Certs
from tests.support.cluster import FAST_BROKER_FLAGS
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import spec_from_dict
from tidings.tls import load


@pytest.fixture
def tls_cluster(etcd, etcd_root, tmp_path, certs: Certs) -> Iterator[LocalCluster]:
    cert, key = certs.issue("spark-brokers")
    lc = LocalCluster(brokers=1, data_dir=tmp_path / "cluster", etcd=etcd.endpoint, root=etcd_root)
    lc.extra = [*FAST_BROKER_FLAGS, "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(certs.ca_file)]
    with lc:
        yield lc


def test_the_source_and_sink_reach_tls_brokers(spark, tls_cluster: LocalCluster, certs: Certs) -> None:
    cert, key = certs.issue("spark-client")
    tls = {"tlsCa": str(certs.ca_file), "tlsCert": str(cert), "tlsKey": str(key)}
    ep, journal = tls_cluster.endpoints[0], "spark/tls"

    async def create() -> None:
        spec = spec_from_dict({"name": journal, "replication": 1, "fragment": {"stores": [tls_cluster.store_url]},
                               **NDJSON})  # fmt: skip
        async with AsyncClient(ep, tls=load(cert, key, certs.ca_file, "test", server=False)) as c:
            await c.apply([pb.ApplyRequest.Change(upsert=spec)])

    asyncio.run(create())
    df = spark.createDataFrame([(i, f"n{i}") for i in range(100)], "id BIGINT, name STRING")
    df.write.format("tidings").option("broker", ep).option("journal", journal).options(**tls).mode("append").save()
    read = spark.read.format("tidings").option("broker", ep).option("journal", journal).options(**tls)
    rows = read.schema("id BIGINT, name STRING").load().collect()
    assert sorted((r.id, r.name) for r in rows) == [(i, f"n{i}") for i in range(100)]

    def plain():  # (a DataFrameReader is changed by .option: a new one each time)
        return spark.read.format("tidings").option("broker", ep).option("journal", journal).schema("id BIGINT")

    msg = error_message(lambda: plain().load().collect())
    assert "unreachable" in msg and "it may serve TLS: give options tlsCa" in msg, msg[:1500]
    half = plain().option("tlsCa", tls["tlsCa"]).option("tlsCert", tls["tlsCert"])
    msg = error_message(lambda: half.load().collect())
    assert "option 'tlsCert' needs its pair: give both tlsCert and tlsKey" in msg, msg[:1500]
    missing = plain().option("tlsCa", "/nonexistent/ca.pem")
    msg = error_message(lambda: missing.load().collect())
    assert "cannot read option 'tlsCa' /nonexistent/ca.pem" in msg, msg[:1500]
