"""A server lets no RPC act without a token allowing it (DESIGN.md invariant 11): no token, a header that
is not `Bearer`, a token lacking the capability and a cached token past its expiry are each refused
with their code and reason; `AA==` admits only requests with no token at all."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import grpc
import pytest

import tidings.auth.verifier as verifier_module
from tidings import auth
from tidings.auth import AuthError, KeySet, NoVerifier, Verifier, sign
from tidings.protocol import labels
from tidings.protocol.claims import NEVER, Capability, Claims

KEY = bytes(range(32))
KEYS = KeySet((KEY,))
NOW = 1_800_000_000


def _bearer(claims: Claims, key: bytes = KEY) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {sign(claims, key)}"),)


READ_ORDERS = Claims(cap=Capability.READ, sel=labels.parse_selector("app=orders"), iat=NOW, exp=NOW + 60, sub="bob")


def test_a_token_allowing_the_call_passes_with_its_claims() -> None:
    v = Verifier(KEYS)
    assert v.verify_metadata((("user-agent", "x"), *_bearer(READ_ORDERS)), Capability.READ, NOW) == READ_ORDERS
    header = _bearer(READ_ORDERS)[0][1].encode()
    assert v.verify_metadata((("authorization", header),), Capability.READ, NOW) == READ_ORDERS  # (bytes too)


@pytest.mark.parametrize(
    "metadata,code,reason",
    [
        pytest.param((), "UNAUTHENTICATED", "no token: pass --auth-token (TIDINGS_AUTH_TOKEN)", id="no-token"),
        pytest.param(None, "UNAUTHENTICATED", "no token: pass --auth-token", id="no-metadata"),
        pytest.param(
            (("authorization", "Basic Ym9iOnB3"),),
            "UNAUTHENTICATED",
            "invalid or unsupported Authorization header (expected 'Bearer TOKEN')",
            id="basic",
        ),
        pytest.param((("authorization", "bearer x.y.z"),), "UNAUTHENTICATED", "invalid or unsupported", id="case"),
        pytest.param((("authorization", "Bearer "),), "UNAUTHENTICATED", "invalid or unsupported", id="empty"),
        pytest.param((("authorization", ""),), "UNAUTHENTICATED", "invalid or unsupported", id="empty-header"),
        pytest.param(_bearer(READ_ORDERS, b"x" * 32), "UNAUTHENTICATED", "token signature does not", id="foreign"),
        pytest.param(
            _bearer(Claims(cap=Capability.READ, iat=NOW - 100, exp=NOW - 10)),
            "UNAUTHENTICATED",
            "token expired 10 s ago",
            id="expired",
        ),
        pytest.param(
            _bearer(READ_ORDERS),
            "PERMISSION_DENIED",
            "token lacks the APPEND capability (it has READ)",
            id="lacks-append",
        ),
    ],
)
def test_each_refusal_has_its_code_and_reason(metadata: Any, code: str, reason: str) -> None:
    with pytest.raises(AuthError) as exc:
        Verifier(KEYS).verify_metadata(metadata, Capability.APPEND, NOW)
    assert (exc.value.code, exc.value.reason[: len(reason)]) == (code, reason)


def test_aa_admits_a_request_without_a_token_as_holding_what_it_needs() -> None:
    v = Verifier(KeySet((KEY,), allow_missing=True))
    claims = v.verify_metadata((), Capability.APPEND, NOW + 0.5)
    assert claims == Claims(cap=Capability.APPEND, iat=NOW, exp=NOW + 3600)
    assert not claims.allows(Capability.READ)  # (only what this call needs)


def test_aa_still_verifies_a_token_that_is_there() -> None:
    """A present token is never ignored: a bad one is refused, a weak one keeps its limits."""
    v = Verifier(KeySet((KEY,), allow_missing=True))
    with pytest.raises(AuthError, match="signature does not verify"):
        v.verify_metadata(_bearer(READ_ORDERS, b"x" * 32), Capability.READ, NOW)
    with pytest.raises(AuthError, match="invalid or unsupported Authorization header"):
        v.verify_metadata((("authorization", "Basic Ym9i"),), Capability.READ, NOW)
    with pytest.raises(AuthError, match="lacks the APPEND capability") as exc:
        v.verify_metadata(_bearer(READ_ORDERS), Capability.APPEND, NOW)
    assert exc.value.code == "PERMISSION_DENIED"


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = verifier_module.verify

    def verify(token: str, keys: Any, now: float) -> Claims:
        seen.append(token)
        return real(token, keys, now)

    monkeypatch.setattr(verifier_module, "verify", verify)
    return seen


def test_a_cached_token_is_verified_once_and_its_expiry_checked_at_each_use(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _counting(monkeypatch)
    v = Verifier(KEYS)
    md = _bearer(READ_ORDERS)
    for now in (NOW, NOW + 30, NOW + 60 + 5):  # (up to the leeway past exp)
        assert v.verify_metadata(md, Capability.READ, now) == READ_ORDERS
    assert len(seen) == 1
    with pytest.raises(AuthError, match="token expired 6 s ago"):
        v.verify_metadata(md, Capability.READ, NOW + 66)
    with pytest.raises(AuthError, match="token expired"):  # (dropped from the cache: verified again, refused)
        v.verify_metadata(md, Capability.READ, NOW + 66)
    assert len(seen) == 2


def test_the_capability_is_checked_at_each_use_of_a_cached_token(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _counting(monkeypatch)
    v = Verifier(KEYS)
    md = _bearer(READ_ORDERS)
    v.verify_metadata(md, Capability.READ, NOW)
    with pytest.raises(AuthError, match="lacks the APPEND"):
        v.verify_metadata(md, Capability.APPEND, NOW)
    assert len(seen) == 1


def test_the_cache_keeps_the_most_recently_used_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _counting(monkeypatch)
    v = Verifier(KEYS, cache_size=2)
    a, b, c = (_bearer(Claims(cap=Capability.READ, iat=NOW, exp=NOW + 60, sub=s)) for s in "abc")
    for md in (a, b, a, c, a, b):  # (c evicts b, the least recently used; b evicts ...)
        v.verify_metadata(md, Capability.READ, NOW)
    assert [t[-4:] for t in seen] == [md[0][1][-4:] for md in (a, b, c, b)]


def test_no_verifier_grants_everything_for_ever() -> None:
    claims = NoVerifier().verify_metadata((), Capability.REPLICATE)
    assert claims == Claims(cap=Capability.ALL, exp=NEVER)


class _Aborted(Exception):
    pass


class _Context:
    """A grpc.aio ServicerContext's two methods the verifier uses; abort raises, as grpc's does."""

    def __init__(self, metadata: Any) -> None:
        self.metadata = metadata
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> Any:
        return self.metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.aborted = (code, details)
        raise _Aborted


async def test_verify_aborts_the_rpc_with_the_refusals_code() -> None:
    v = Verifier(KEYS)
    now = int(time.time())  # (verify reads the clock)
    ok = _Context(_bearer(Claims(cap=Capability.ALL, iat=now, exp=NEVER)))
    assert (await v.verify(ok, Capability.APPEND)).cap == Capability.ALL and ok.aborted is None
    read = _bearer(Claims(cap=Capability.READ, iat=now, exp=NEVER))
    for md, code in [((), grpc.StatusCode.UNAUTHENTICATED), (read, grpc.StatusCode.PERMISSION_DENIED)]:
        ctx = _Context(md)
        with pytest.raises(_Aborted):
            await v.verify(ctx, Capability.APPEND)
        assert ctx.aborted is not None and ctx.aborted[0] == code


async def test_a_real_grpc_call_ends_with_the_code_and_reason() -> None:
    """Through grpc.aio: the client sees the code and the one-line reason, and an allowed call runs."""
    v = Verifier(KEYS)
    now = int(time.time())  # (the server verifies with its clock)

    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        claims = await v.verify(context, Capability.APPEND)
        return claims.sub.encode()

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(call)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Auth", {"Call": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            rpc = channel.unary_unary("/test.Auth/Call")
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await rpc(b"")
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert exc.value.details() == "no token: pass --auth-token (TIDINGS_AUTH_TOKEN)"
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await rpc(b"", metadata=_bearer(Claims(cap=Capability.READ, iat=now, exp=NEVER)))
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert exc.value.details() == "token lacks the APPEND capability (it has READ)"
            allowed = Claims(cap=Capability.APPEND, iat=now, exp=NEVER, sub="carol")
            assert await rpc(b"", metadata=_bearer(allowed)) == b"carol"
    finally:
        await server.stop(None)


def test_the_package_exports_are_sorted_and_load_no_grpc() -> None:
    """`tidings auth ...` commands import tidings.auth: it loads grpc only once a server aborts a call."""
    assert auth.__all__ == sorted(auth.__all__) and all(hasattr(auth, name) for name in auth.__all__)
    probe = "import sys, tidings.auth; print('grpc' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r


def test_refusals_log_once_per_peer_host_and_code_every_ten_seconds_and_count_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client retrying in a loop (a new port per connection, a new reason per token it makes up) cannot
    flood the log; every refusal counts."""
    from prometheus_client import REGISTRY

    def count() -> float:
        return REGISTRY.get_sample_value("tidings_auth_refusals_total", {"service": "test", "code": "X"}) or 0.0

    now = [100.0]
    refusals = verifier_module._RefusalLog("test", clock=lambda: now[0])
    before = count()
    caplog.set_level("INFO", logger="tidings.auth.verifier")
    for port, reason in [(1, "bad"), (2, "bad"), (3, "worse"), (4, "bad")]:
        refusals.note("Append", f"10.0.0.5:{port}", "", "X", reason)
    refusals.note("Append", "10.0.0.6:1", "bob", "X", "bad")
    now[0] += 10
    refusals.note("Read", "10.0.0.5:9", "", "X", "bad")
    for i in range(1000):  # (reasons the caller chose: a token's algorithm, its length)
        refusals.note("Append", f"10.0.0.5:{i}", "", "X", f"token algorithm junk{i} is not accepted")
    assert [r.getMessage() for r in caplog.records] == [
        "refused Append from 10.0.0.5:1: bad",
        "refused Append from 10.0.0.6:1 (sub bob): bad",
        "refused Read from 10.0.0.5:9: bad",
    ]
    assert count() == before + 1006


def test_a_call_may_go_on_until_its_token_expires_and_for_ever_without_auth() -> None:
    claims = Claims(cap=Capability.READ, iat=NOW, exp=NOW + 60)
    assert auth.expires_at(claims) == NOW + 65 and auth.seconds_left(claims, NOW) == 65  # (the leeway too)
    assert auth.seconds_left(NoVerifier().verify_metadata((), Capability.READ)) is None
