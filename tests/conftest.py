"""Session fixtures: one real etcd child for the whole run; a unique key prefix per test."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator

import pytest
import uvloop

from tests.support.moto_s3 import MotoS3
from tidings.cluster.etcd import EtcdProcess
from tidings.cluster.postgres import PostgresProcess


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], object]]:
    """Tests run on uvloop, as every tidings process does (its transports and timing differ from asyncio's)."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdProcess]:
    """A real etcd on free loopback ports, stopped by PID at the end of the session."""
    proc = EtcdProcess()
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """A real S3 endpoint (moto's server) on a free loopback port, stopped by PID at the end of the session."""
    with MotoS3() as server:
        yield server


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresProcess]:
    """A real PostgreSQL server on a free loopback port (fsync off: tests), stopped by PID at the end."""
    with PostgresProcess(fsync=False) as server:
        yield server


@pytest.fixture
def pg_dsn(postgres: PostgresProcess) -> str:
    """A fresh database of the session's PostgreSQL server, for one test."""
    return postgres.create_database()


@pytest.fixture(scope="session")
def spark() -> Iterator:
    """One local[2] Spark session (its JVM a child process on loopback) for every Spark test."""
    from tidings.spark.local import local_session

    with local_session("tidings-tests") as session:
        yield session


@pytest.fixture
def etcd_root() -> str:
    """A unique root prefix per test, so tests never see each other's keys."""
    return f"/tidings-test/{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def etcd_client(etcd: EtcdProcess):
    """A client of the session's etcd, closed after the test."""
    from tidings.keyspace.etcd import Etcd

    client = await Etcd.connect(etcd.endpoint)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def cluster(etcd: EtcdProcess, etcd_root: str, tmp_path):
    """Three in-process brokers in three zones over the session etcd; stopped and cleaned after."""
    async with _brokers(etcd, etcd_root, tmp_path) as tc:
        for zone in ("zone-a", "zone-b", "zone-c"):
            await tc.add_broker(zone)
        yield tc


@pytest.fixture
async def brokers(etcd: EtcdProcess, etcd_root: str, tmp_path):
    """A cluster a test configures itself: `brokers(**config)` gives a TestCluster without brokers (each
    `add_broker` takes its own flags too); stopped and its keys deleted after."""
    async with contextlib.AsyncExitStack() as stack:
        yield lambda **config: stack.enter_async_context(_brokers(etcd, etcd_root, tmp_path, **config))


@contextlib.asynccontextmanager
async def _brokers(etcd: EtcdProcess, etcd_root: str, tmp_path, **config):
    from tests.support.cluster import TestCluster
    from tidings.keyspace.etcd import Etcd

    tc = TestCluster(etcd.endpoint, etcd_root, tmp_path, **config)
    try:
        yield tc
    finally:
        await tc.stop()
        client = await Etcd.connect(etcd.endpoint)
        try:
            await client.delete_prefix(etcd_root + "/")
        finally:
            await client.aclose()


def _local_cluster(etcd: EtcdProcess, root: str, data_dir) -> Iterator:
    from tests.support.cluster import FAST_BROKER_FLAGS
    from tidings.cluster import LocalCluster

    lc = LocalCluster(brokers=4, zones=3, data_dir=data_dir, etcd=etcd.endpoint, root=root)
    lc.extra = list(FAST_BROKER_FLAGS)
    try:
        lc.start()
        yield lc
    finally:
        lc.stop()


@pytest.fixture(scope="module")
def module_cluster(etcd: EtcdProcess, tmp_path_factory) -> Iterator:
    """One local cluster for a whole module (see `local_cluster`)."""
    yield from _local_cluster(etcd, f"/tidings-test/{uuid.uuid4().hex[:12]}", tmp_path_factory.mktemp("cluster"))


@pytest.fixture
def local_cluster(request, etcd: EtcdProcess, etcd_root: str, tmp_path):
    """Four brokers as child processes over three zones (a spare for R=3), on the session etcd. A
    module that sets SHARE_CLUSTER = True (its tests only create journals of their own names and
    never stop a broker: the Spark tests) shares one cluster among its tests (starting one costs
    seconds)."""
    if getattr(request.module, "SHARE_CLUSTER", False):
        yield request.getfixturevalue("module_cluster")
        return
    yield from _local_cluster(etcd, etcd_root, tmp_path)


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """Test certificates: one CA for the session (tests/support/certs.py)."""
    from tests.support.certs import Certs

    return Certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def consumers(cluster, etcd_root, tmp_path):
    """Consumer processes in this process over `cluster` (tests/support/consumers.py)."""
    from tests.support.consumers import Consumers

    cs = Consumers(cluster, etcd_root, tmp_path)
    try:
        yield cs
    finally:
        await cs.stop()


def _dump_asyncio_tasks(signum, frame) -> None:  # debugging aid: `kill -USR1 <pytest pid>`
    import asyncio
    import sys

    from tidings.tasks import task_stacks

    try:
        asyncio.get_event_loop()
        lines = task_stacks()
    except RuntimeError:
        return
    print("\n".join(lines), file=sys.stderr, flush=True)


import signal as _signal  # noqa: E402

_signal.signal(_signal.SIGUSR1, _dump_asyncio_tasks)
