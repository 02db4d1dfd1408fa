"""Tests run over both transports a client offers: tidings' own framing on data ports (the default) and
gRPC (the public interface), through the TIDINGS_TRANSPORT variable every client of the process (and the
CLI processes a test starts) reads. A conftest imports `client_transport` and sets
`pytest_generate_tests = over_both_transports(which)`, `which` choosing the tests (by module and name)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tidings.client._async import TRANSPORT_VARIABLE, TRANSPORTS


def over_both_transports(which: Callable[[str, str], bool]) -> Callable[[pytest.Metafunc], None]:
    """A pytest_generate_tests running the tests `which` accepts (by module and test name) once per transport."""

    def generate(metafunc: pytest.Metafunc) -> None:
        if "client_transport" in metafunc.fixturenames and which(metafunc.module.__name__, metafunc.function.__name__):
            metafunc.parametrize("client_transport", TRANSPORTS, indirect=True)

    return generate


@pytest.fixture(autouse=True)
def client_transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    transport = str(getattr(request, "param", "tidings"))
    monkeypatch.setenv(TRANSPORT_VARIABLE, transport)
    return transport
