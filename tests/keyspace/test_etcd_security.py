"""etcd over TLS and as an etcd user (keyspace/etcd.py): against a real etcd serving TLS only and
requiring client certificates, a client with the CA and a certificate reads, writes, watches and keeps
a lease alive; one etcd refuses (no TLS, the wrong CA, no or a foreign certificate, a name its certificate
does not cover) fails in one line naming why and the --etcd-tls-* flag to fix, and an IPv6 endpoint in
any spelling of the certificate's address gets through. Against an etcd with
authentication enabled, a user's client does the same; a wrong password is one line naming the user
and the flags; a token etcd has expired is replaced and the call succeeds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from tests.support.certs import Certs
from tidings.cluster.etcd import EtcdProcess
from tidings.keyspace.etcd import Etcd
from tidings.protocol.status import TransportError, UsageError
from tidings.tls import load


async def _works(etcd: Etcd) -> None:
    """Put, get, a watch and a lease's keep-alive stream all go through."""
    _, rev = await etcd.get("/sec/none")
    watch = etcd.watch("/sec/", rev + 1)
    try:
        put = await etcd.put("/sec/a", b"1")
        kv, _ = await etcd.get("/sec/a")
        assert kv is not None and kv.value == b"1" and kv.mod_revision == put
        batch = await asyncio.wait_for(anext(watch), 10)
        assert [(e.type, e.kv.key) for e in batch.events] == [("put", "/sec/a")]
    finally:
        await watch.aclose()
    lease = await etcd.grant_lease(5)
    refreshed = asyncio.Event()
    keeper = asyncio.create_task(etcd.keep_alive(lease, 5, on_refresh=lambda _: refreshed.set()))
    try:
        await asyncio.wait_for(refreshed.wait(), 10)
    finally:
        keeper.cancel()
    assert (await etcd.lease_time_to_live(lease))[0] > 0


@pytest.fixture
def tls_etcd(certs: Certs, tmp_path: Path):
    cert, key = certs.issue("etcd", "127.0.0.1")
    tls = load(cert, key, certs.ca_file, "etcd", server=True)
    proc = EtcdProcess(tmp_path / "etcd", tls=tls).start()
    try:
        yield proc
    finally:
        proc.stop()


async def test_a_client_with_the_ca_and_a_certificate_uses_a_tls_etcd(tls_etcd: EtcdProcess, certs: Certs) -> None:
    cert, key = certs.issue("etcd-client")
    etcd = await Etcd.connect(tls_etcd.endpoint, tls=load(cert, key, certs.ca_file, "tidings", server=False))
    try:
        await _works(etcd)
    finally:
        await etcd.aclose()


async def test_an_ipv6_endpoint_written_in_full_reaches_a_tls_etcd(certs: Certs, tmp_path: Path) -> None:
    """gRPC checks a certificate's IP address against the endpoint's host as text, in its shortest form:
    `[0:0:0:0:0:0:0:1]` (or `[fd7d:0f65::11]`) is the address the certificate names, and must work."""
    cert, key = certs.issue("etcd6", "::1")
    proc = EtcdProcess(tmp_path / "etcd", host="::1", tls=load(cert, key, certs.ca_file, "etcd", server=True)).start()
    try:
        cert, key = certs.issue("etcd-client")
        port = proc.endpoint.rpartition(":")[2]
        etcd = await Etcd.connect(
            f"[0:0:0:0:0:0:0:1]:{port}", tls=load(cert, key, certs.ca_file, "tidings", server=False)
        )
        try:
            await _works(etcd)
        finally:
            await etcd.aclose()
    finally:
        proc.stop()


@pytest.mark.parametrize(
    ("client", "says"),
    [
        ("plaintext", "speaks TLS: pass --etcd-tls-ca"),
        ("wrong-ca", "certificate is not signed by the CA in --etcd-tls-ca: give that CA"),
        ("no-certificate", "requires a client certificate: pass --etcd-tls-cert and --etcd-tls-key"),
        ("foreign-certificate", "refused our client certificate"),
        ("wrong-name", "certificate is not valid for localhost: dial a name or address its certificate names"),
    ],
)
async def test_a_client_etcd_would_refuse_fails_in_one_line_naming_why(
    tls_etcd: EtcdProcess, certs: Certs, client: str, says: str
) -> None:
    cert, key = certs.issue("etcd-client", by_other=client in ("wrong-ca", "foreign-certificate"))
    tls = {
        "plaintext": None,
        "wrong-ca": load(cert, key, certs.other_ca_file, "tidings", server=False),
        "no-certificate": load(None, None, certs.ca_file, "tidings", server=False),
        "foreign-certificate": load(cert, key, certs.ca_file, "tidings", server=False),
        "wrong-name": load(cert, key, certs.ca_file, "tidings", server=False),
    }[client]
    endpoint = tls_etcd.endpoint
    if client == "wrong-name":  # (its certificate names 127.0.0.1 alone)
        endpoint = f"localhost:{endpoint.rpartition(':')[2]}"
    for user in ("", "tidings"):  # (and as an etcd user: its calls authenticate first)
        with pytest.raises(TransportError) as refused:
            await Etcd.connect(endpoint, timeout=2, tls=tls, user=user, password="s3cret")
        assert f"etcd {endpoint}" in str(refused.value) and says in str(refused.value), (user, refused.value)
        assert "\n" not in str(refused.value)


@pytest.fixture
async def auth_etcd(tmp_path: Path) -> AsyncIterator[EtcdProcess]:
    """An etcd with authentication on: root, and user `tidings` (password `s3cret`) with read-write on all
    keys."""
    proc = EtcdProcess(tmp_path / "etcd").start()
    try:
        ch = grpc.aio.insecure_channel(proc.endpoint)
        auth = rpc.AuthStub(ch)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="rootpw"))
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
        await auth.UserAdd(rpc.AuthUserAddRequest(name="tidings", password="s3cret"))
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="tidings"))
        perm = rpc.Permission(permType=rpc.Permission.READWRITE, key=b"\0", range_end=b"\0")
        await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name="tidings", perm=perm))
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="tidings", role="tidings"))
        await auth.AuthEnable(rpc.AuthEnableRequest())
        await ch.close()
        yield proc
    finally:
        proc.stop()


async def test_an_etcd_user_reads_writes_and_keeps_a_lease(auth_etcd: EtcdProcess) -> None:
    etcd = await Etcd.connect(auth_etcd.endpoint, user="tidings", password="s3cret")
    try:
        await _works(etcd)
    finally:
        await etcd.aclose()
    anonymous = await Etcd.connect(auth_etcd.endpoint)
    try:
        with pytest.raises(TransportError, match=r"user name is empty|permission denied"):
            await anonymous.put("/sec/b", b"2")
    finally:
        await anonymous.aclose()


async def test_a_wrong_password_is_one_line_naming_the_user(auth_etcd: EtcdProcess) -> None:
    with pytest.raises(UsageError, match=r"refused user tidings: .*TIDINGS_ETCD_PASSWORD") as refused:
        await Etcd.connect(auth_etcd.endpoint, user="tidings", password="wrong")
    assert "\n" not in str(refused.value) and "wrong" not in str(refused.value)


async def test_a_token_etcd_no_longer_takes_is_replaced(auth_etcd: EtcdProcess) -> None:
    """(etcd forgets a user's tokens when its password is set, as when they expire unused.)"""
    etcd = await Etcd.connect(auth_etcd.endpoint, user="tidings", password="s3cret")
    raw = grpc.aio.insecure_channel(auth_etcd.endpoint)
    try:
        await etcd.put("/sec/t", b"1")
        stale = etcd._user._token  # type: ignore[union-attr]
        root = await rpc.AuthStub(raw).Authenticate(rpc.AuthenticateRequest(name="root", password="rootpw"))
        await rpc.AuthStub(raw).UserChangePassword(
            rpc.AuthUserChangePasswordRequest(name="tidings", password="s3cret"), metadata=(("token", root.token),)
        )
        with pytest.raises(grpc.aio.AioRpcError, match="invalid auth token"):
            await rpc.KVStub(raw).Range(rpc.RangeRequest(key=b"/sec/t"), metadata=(("token", stale),))
        await etcd.put("/sec/t", b"2")  # (refused for its token, authenticated again, retried)
        kv, _ = await etcd.get("/sec/t")
        assert kv is not None and kv.value == b"2"
    finally:
        await raw.close()
        await etcd.aclose()


async def test_calls_refused_together_authenticate_once_and_a_watch_outlives_it(
    auth_etcd: EtcdProcess,
) -> None:
    """(A token etcd forgot, say after its restart: every waiting call is refused at once.)"""
    etcd = await Etcd.connect(auth_etcd.endpoint, user="tidings", password="s3cret")
    raw = grpc.aio.insecure_channel(auth_etcd.endpoint)
    try:
        _, rev = await etcd.get("/sec/none")
        watch = etcd.watch("/sec/", rev + 1)
        root = await rpc.AuthStub(raw).Authenticate(rpc.AuthenticateRequest(name="root", password="rootpw"))
        await rpc.AuthStub(raw).UserChangePassword(
            rpc.AuthUserChangePasswordRequest(name="tidings", password="s3cret"), metadata=(("token", root.token),)
        )
        before = etcd.authentications
        await asyncio.gather(*(etcd.put(f"/sec/c{i}", b"x") for i in range(20)))
        assert etcd.authentications - before == 1
        batch = await asyncio.wait_for(anext(watch), 10)  # (opened with the token etcd then forgot)
        assert {e.kv.key for e in batch.events} <= {f"/sec/c{i}" for i in range(20)} and batch.events
        await watch.aclose()
    finally:
        await raw.close()
        await etcd.aclose()
