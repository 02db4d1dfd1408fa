"""The Spark source and sink reach brokers that serve mutual TLS through options `tlsCa`, `tlsCert`
and `tlsKey`, and brokers holding keys through option `authToken`: rows written by the sink are read
back by the source, exactly; a query without them, with half of a certificate pair, or with a token
that cannot work, fails in one line naming what to give. Real local Spark, real brokers as child
processes."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.spark._support import NDJSON, error_message
from tests.support.auth import KEY, token
from tests.support.certs import Certs
from tests.support.cluster import FAST_BROKER_FLAGS
from tidings.auth import KeyedAuthorizer, KeySet
from tidings.client import AsyncClient
from tidings.cluster import LocalCluster
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Capability
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


def test_the_source_and_sink_carry_an_auth_token_to_brokers_holding_keys(
    spark, etcd, etcd_root, tmp_path: Path
) -> None:
    """With option `authToken` the sink's rows reach brokers holding keys and the source reads them back,
    exactly; without it the query fails in one line naming the option; an expired token is refused on
    the driver before any call."""
    lc = LocalCluster(brokers=1, data_dir=tmp_path / "cluster", etcd=etcd.endpoint, root=etcd_root,
                      auth_keys=base64.b64encode(KEY).decode())  # fmt: skip
    lc.extra = list(FAST_BROKER_FLAGS)
    journal = "spark/auth"
    with lc:
        ep = lc.endpoints[0]

        async def create() -> None:
            spec = spec_from_dict({"name": journal, "replication": 1, "fragment": {"stores": [lc.store_url]}, **NDJSON})
            async with AsyncClient(ep, auth=KeyedAuthorizer(KeySet((KEY,)))) as c:
                await c.apply([pb.ApplyRequest.Change(upsert=spec)])

        asyncio.run(create())
        auth = {"authToken": token(Capability.LIST | Capability.READ | Capability.APPEND, "name:prefix=spark/")}
        df = spark.createDataFrame([(i, f"n{i}") for i in range(50)], "id BIGINT, name STRING")
        df.write.format("tidings").option("broker", ep).option("journal", journal).options(**auth).mode("append").save()

        def reader():  # (a DataFrameReader is changed by .option: a new one each time)
            return (
                spark.read.format("tidings")
                .option("broker", ep)
                .option("journal", journal)
                .schema("id BIGINT, name STRING")
            )

        rows = reader().options(**auth).load().collect()
        assert sorted((r.id, r.name) for r in rows) == [(i, f"n{i}") for i in range(50)]
        msg = error_message(lambda: reader().load().collect())
        assert f"tidings source: broker {ep} refused the query's call: UNAUTHENTICATED" in msg, msg[:1500]
        assert "no token: give option 'authToken'" in msg, msg[:1500]
        expired = token(Capability.READ, ttl=-60)
        msg = error_message(lambda: reader().option("authToken", expired).load().collect())
        assert "option 'authToken' is refused before use (expired" in msg and expired not in msg, msg[:1500]


@pytest.mark.parametrize(
    "value,says",
    [
        pytest.param("a b", "option 'authToken' has spaces", id="spaces"),
        pytest.param("x.y", "option 'authToken' is refused before use (malformed", id="not-a-token"),
        pytest.param("{expired}", "option 'authToken' is refused before use (expired", id="expired"),
    ],
)
def test_authtoken_mistakes_are_one_line_on_the_driver(value: str, says: str) -> None:
    """(No Spark needed: the options are checked where they are parsed, for the source and the sink.)"""
    from tidings.spark.options import OptionError, SourceOptions

    value = value.format(expired=token(Capability.READ, ttl=-60))
    with pytest.raises(OptionError) as exc:
        SourceOptions.parse({"journal": "a/b", "authToken": value})
    said = str(exc.value)
    assert said.startswith(f"tidings source: {says}") and "\n" not in said and value not in said.replace("'", ""), said
    good = SourceOptions.parse({"journal": "a/b", "authToken": f" {token(Capability.READ)}\n"})
    assert good.security.auth_token is not None and "auth_token" not in repr(good.security)
