"""`tidings cluster up --tls-cert --tls-key --tls-ca --metrics-tls`: its brokers serve mutual TLS (gRPC
and /metrics) and its own etcd serves TLS only, requiring client certificates; a client with the CA and
a certificate works, one without is refused in one line, and etcd refuses a plaintext client."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.cli._support import tidings
from tests.support.certs import Certs
from tests.support.waiting import wait_until_sync
from tidings.cluster.etcd import free_port
from tidings.keyspace.etcd import Etcd
from tidings.protocol.status import TransportError


def test_cluster_up_with_tls_serves_brokers_and_etcd_over_mutual_tls(tmp_path: Path, certs: Certs) -> None:
    cert, key = certs.issue("cluster")
    mine = ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(certs.ca_file))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidings.cli", "cluster", "up", "--brokers", "2", "--port", str(port), *mine,
         "--metrics-tls", "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines: list[str] = []
        wait_until_sync(lambda: lines.append(proc.stdout.readline()) or "ready" in lines[-1], 60)  # type: ignore[union-attr]
        assert any(line.startswith("tls      on, brokers and etcd") for line in lines), lines
        etcd = next(line.split()[1] for line in lines if line.startswith("etcd"))
        broker = f"127.0.0.1:{port + 1}"
        r = tidings("journals", "list", "--json", *mine, broker=broker)
        assert r.returncode == 0, r.stderr
        r = tidings("journals", "list", broker=broker)
        assert r.returncode == 1 and b"speaks TLS: pass --tls-ca" in r.stderr and r.stderr.count(b"\n") == 1
        with pytest.raises(TransportError, match="speaks TLS: pass --etcd-tls-ca"):
            asyncio.run(Etcd.connect(etcd, timeout=2))
        scraped = [line.split("metrics=")[1] for line in lines if line.startswith("broker") and "metrics=" in line]
        assert len(scraped) == 2 and all(url.startswith("https://") for url in scraped), lines
        ctx = ssl.create_default_context(cafile=str(certs.ca_file))
        ctx.load_cert_chain(cert, key)
        with urllib.request.urlopen(scraped[0].strip(), context=ctx, timeout=30) as answer:
            assert b"tidings_journals" in answer.read()
    finally:
        proc.terminate()
        proc.wait(timeout=90)
