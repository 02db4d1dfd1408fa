"""Every client test runs over both transports (tests/support/transports.py); test_wire.py is about the
data port alone."""

from tests.support.transports import client_transport, over_both_transports

__all__ = ["client_transport"]

pytest_generate_tests = over_both_transports(lambda module, _: not module.endswith("test_wire"))
