"""Every client test runs over both transports a client offers: tidings' own framing on the brokers' data
ports (the default) and gRPC (the public interface), through the TIDINGS_TRANSPORT variable every client
of the process (and the CLI processes a test starts) reads. test_wire.py is about the data port alone."""

from __future__ import annotations

import pytest

from tidings.client._async import TRANSPORT_VARIABLE, TRANSPORTS


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "client_transport" in metafunc.fixturenames and not metafunc.module.__name__.endswith("test_wire"):
        metafunc.parametrize("client_transport", TRANSPORTS, indirect=True)


@pytest.fixture(autouse=True)
def client_transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    transport = str(getattr(request, "param", "tidings"))
    monkeypatch.setenv(TRANSPORT_VARIABLE, transport)
    return transport
