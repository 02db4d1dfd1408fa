"""The LogPlayer's end-to-end tests (test_logplayer.py) run over both transports its client offers: targets'
data ports (tidings' framing, the default) and gRPC, through the TIDINGS_TRANSPORT variable."""

from __future__ import annotations

import pytest

from tidings.client._async import TRANSPORT_VARIABLE, TRANSPORTS


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "client_transport" in metafunc.fixturenames and metafunc.module.__name__.endswith("test_logplayer"):
        metafunc.parametrize("client_transport", TRANSPORTS, indirect=True)


@pytest.fixture(autouse=True)
def client_transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    transport = str(getattr(request, "param", "tidings"))
    monkeypatch.setenv(TRANSPORT_VARIABLE, transport)
    return transport
